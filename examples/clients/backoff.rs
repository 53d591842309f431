//! `backoff-client`: an HTTP client that backs off as docs/clients.md asks, in Rust with `ureq` (the Python and
//! JavaScript clients next to it do exactly the same). It sends COUNT requests to URL, one after the other:
//! - a 429 or 503 with `Retry-After` is retried once that many seconds have passed since the answer came, not before;
//! - a 429, 502, 503 or 504 without it, or a connection error, is retried after an exponential backoff with full
//!   jitter: a random wait in [0, min(cap, base × 2^(try-1))];
//! - a non-idempotent request (POST, PATCH) is retried on a 503 only when sluice's body says sluice answered it
//!   (`error` is `overloaded`, `limiter_unavailable` or `rate_limited`): then it never reached the upstream;
//! - retries come out of a budget, token-bucket style as gRPC's retry throttling and Finagle's RetryBudget: it starts
//!   with BUDGET tokens (at most BUDGET), every new request puts 0.1 in, every retry takes 1 out, and a retry that
//!   finds less than 1 is not made; no request makes more than MAX_ATTEMPTS tries, nor waits a Retry-After longer
//!   than MAX_WAIT_S;
//! - with `--pace`, it limits itself from the rate-limit headers: after an answer saying none is left (`RateLimit:
//!   ...;r=0;t=T`, or `X-RateLimit-Remaining: 0` with `X-RateLimit-Reset`), it holds the next request T seconds
//!   (MAX_WAIT_S at most).
//!
//! It prints one line per try and per wait, times in milliseconds since it started (a monotonic clock):
//!   attempt request=4 try=1 sent_ms=12 done_ms=14 status=429 retry_after=2 remaining=0 reset=4
//!   wait request=4 ms=2000 reason=retry-after
//!   give_up request=5 reason=budget
//!   summary ok=5 failed=0 attempts=6 retries=1
//!
//! cargo run -p sluice-tests --bin backoff-client -- http://127.0.0.1:10000/api/x 8

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::process::ExitCode;
use std::time::{Duration, Instant};

const USAGE: &str =
    "usage: backoff-client URL COUNT [--method M] [--max-attempts N] [--budget N] [--base-ms N] \
                     [--cap-ms N] [--max-wait-s N] [--pace]";

struct Options {
    url: String,
    count: u64,
    method: String,
    max_attempts: u32,
    budget: f64,
    base_ms: u64,
    cap_ms: u64,
    max_wait_s: u64,
    pace: bool,
}

fn options() -> Result<Options, String> {
    let mut args = std::env::args().skip(1);
    let mut positional = Vec::new();
    let mut o = Options {
        url: String::new(),
        count: 0,
        method: "GET".into(),
        max_attempts: 5,
        budget: 10.0,
        base_ms: 100,
        cap_ms: 10_000,
        max_wait_s: 60,
        pace: false,
    };
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or(format!("{arg} needs a value"));
        let number = |v: String| {
            v.parse::<u64>()
                .map_err(|_| format!("{arg}: not a number: {v}"))
        };
        match arg.as_str() {
            "--method" => o.method = value()?.to_ascii_uppercase(),
            "--max-attempts" => o.max_attempts = number(value()?)? as u32,
            "--budget" => o.budget = number(value()?)? as f64,
            "--base-ms" => o.base_ms = number(value()?)?,
            "--cap-ms" => o.cap_ms = number(value()?)?,
            "--max-wait-s" => o.max_wait_s = number(value()?)?,
            "--pace" => o.pace = true,
            _ if arg.starts_with("--") => return Err(format!("unknown option {arg}")),
            _ => positional.push(arg),
        }
    }
    let [url, count] = positional.as_slice() else {
        return Err("URL and COUNT are required".into());
    };
    o.url = url.clone();
    o.count = count
        .parse()
        .map_err(|_| format!("COUNT: not a number: {count}"))?;
    Ok(o)
}

/// The retry budget: tokens a retry spends, that requests earn back.
struct Budget {
    tokens: f64,
    max: f64,
}

impl Budget {
    fn deposit(&mut self) {
        self.tokens = (self.tokens + 0.1).min(self.max);
    }
    fn withdraw(&mut self) -> bool {
        if self.tokens < 1.0 {
            return false;
        }
        self.tokens -= 1.0;
        true
    }
}

/// What one try got back; status 0 is a connection error.
struct Answer {
    status: u16,
    retry_after: Option<u64>,
    /// From `RateLimit` (r, t) or `X-RateLimit-Remaining` / `X-RateLimit-Reset`.
    remaining: Option<u64>,
    reset: Option<u64>,
    sluice_answered: bool,
}

fn send(agent: &ureq::Agent, o: &Options) -> Answer {
    let request = ureq::http::Request::builder()
        .method(o.method.as_str())
        .uri(&o.url)
        .body(ureq::SendBody::none());
    let response = match request.map(|r| agent.run(r)) {
        Ok(Ok(response)) => response,
        _ => {
            return Answer {
                status: 0,
                retry_after: None,
                remaining: None,
                reset: None,
                sluice_answered: false,
            }
        }
    };
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let number = |name: &str| header(name).and_then(|v| v.trim().parse::<u64>().ok());
    let (mut remaining, mut reset) = match header("ratelimit") {
        Some(value) => draft_fields(&value),
        None => (None, None),
    };
    if remaining.is_none() {
        remaining = number("x-ratelimit-remaining");
        // A reset as a Unix time (`x_ratelimit_reset: "unix"`) becomes seconds from now.
        reset = number("x-ratelimit-reset").map(|r| match r > 1_000_000_000 {
            true => r.saturating_sub(unix_now()),
            false => r,
        });
    }
    let retry_after = number("retry-after");
    let status = response.status().as_u16();
    let body = response.into_body().read_to_string().unwrap_or_default();
    let error = serde_json::from_str::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(str::to_owned));
    Answer {
        status,
        retry_after,
        remaining,
        reset,
        sluice_answered: matches!(
            error.as_deref(),
            Some("overloaded" | "limiter_unavailable" | "rate_limited")
        ),
    }
}

/// `r` and `t` of a `RateLimit` header (`"rule";r=0;t=4`); of several items, the one with the fewest left.
fn draft_fields(value: &str) -> (Option<u64>, Option<u64>) {
    let mut best: (Option<u64>, Option<u64>) = (None, None);
    for item in value.split(',') {
        let (mut r, mut t) = (None, None);
        for param in item.split(';').skip(1) {
            match param.trim().split_once('=') {
                Some(("r", v)) => r = v.parse().ok(),
                Some(("t", v)) => t = v.parse().ok(),
                _ => {}
            }
        }
        if r.is_some() && (best.0.is_none() || r < best.0) {
            best = (r, t);
        }
    }
    best
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A random number in [0, n], from the standard library's randomly keyed hasher.
fn random_up_to(n: u64) -> u64 {
    RandomState::new().hash_one(Instant::now()) % (n + 1)
}

fn show(value: Option<u64>) -> String {
    value.map_or("-".into(), |v| v.to_string())
}

fn main() -> ExitCode {
    let o = match options() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .proxy(None)
        .timeout_global(Some(Duration::from_secs(10)))
        .build()
        .into();
    let start = Instant::now();
    let ms = |at: Instant| at.duration_since(start).as_millis() as u64;
    let idempotent = matches!(
        o.method.as_str(),
        "GET" | "HEAD" | "OPTIONS" | "PUT" | "DELETE" | "TRACE"
    );
    let mut budget = Budget {
        tokens: o.budget,
        max: o.budget,
    };
    // After an answer with none left: when it came, and how long to hold the next request.
    let mut hold: Option<(Instant, Duration)> = None;
    let (mut ok, mut failed, mut attempts, mut retries) = (0, 0, 0, 0);
    for request in 1..=o.count {
        if let Some((since, wait)) = hold.take() {
            let left = wait.saturating_sub(since.elapsed());
            if !left.is_zero() {
                println!(
                    "wait request={request} ms={} reason=quota",
                    left.as_millis()
                );
                std::thread::sleep(left);
            }
        }
        budget.deposit();
        let mut attempt = 1;
        loop {
            let sent = Instant::now();
            let answer = send(&agent, &o);
            let done = Instant::now();
            attempts += 1;
            println!(
                "attempt request={request} try={attempt} sent_ms={} done_ms={} status={} retry_after={} \
                 remaining={} reset={}",
                ms(sent),
                ms(done),
                answer.status,
                show(answer.retry_after),
                show(answer.remaining),
                show(answer.reset),
            );
            // A hint of any length is held at most MAX_WAIT_S: a server cannot make the client sleep for ever.
            if o.pace && answer.remaining == Some(0) {
                hold = answer
                    .reset
                    .map(|t| (done, Duration::from_secs(t.min(o.max_wait_s))));
            }
            let give_up = |reason: &str| println!("give_up request={request} reason={reason}");
            if (200..400).contains(&answer.status) {
                ok += 1;
                break;
            }
            if !matches!(answer.status, 0 | 429 | 502 | 503 | 504) {
                give_up("status");
                failed += 1;
                break;
            }
            // A request that may have reached the upstream is not sent twice unless sending it twice is harmless.
            if !idempotent && answer.status != 429 && !answer.sluice_answered {
                give_up("not_idempotent");
                failed += 1;
                break;
            }
            if attempt >= o.max_attempts {
                give_up("attempts");
                failed += 1;
                break;
            }
            if answer.retry_after.is_some_and(|s| s > o.max_wait_s) {
                give_up("retry_after_too_long");
                failed += 1;
                break;
            }
            if !budget.withdraw() {
                give_up("budget");
                failed += 1;
                break;
            }
            let (wait_ms, reason) = match answer.retry_after {
                Some(seconds) => (seconds.saturating_mul(1_000), "retry-after"),
                None => {
                    let ceiling = o
                        .cap_ms
                        .min(o.base_ms.saturating_mul(1 << (attempt - 1).min(30)));
                    (random_up_to(ceiling), "backoff")
                }
            };
            println!("wait request={request} ms={wait_ms} reason={reason}");
            std::thread::sleep(Duration::from_millis(wait_ms).saturating_sub(done.elapsed()));
            retries += 1;
            attempt += 1;
        }
    }
    println!("summary ok={ok} failed={failed} attempts={attempts} retries={retries}");
    ExitCode::SUCCESS
}
