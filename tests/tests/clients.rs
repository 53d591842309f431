//! The example clients of docs/clients.md (`examples/clients/`: Rust, Python, JavaScript), each run as a subprocess
//! against the demo (`envoy/demo.yaml` with a small local limit) and against a test upstream that always fails. From
//! each client's own output (a line per try: its send and answer times in ms, the status, the Retry-After it got)
//! the tests check that it stops at the limit, sends nothing before the Retry-After it was given has passed since
//! the answer, then succeeds; that it stops after its attempts or its retry budget; and that it never sends a POST
//! twice unless sluice's body says sluice answered it. Envoy's counters confirm the clients sent what they printed.
//!
//! Needs `python3` and `node` (`make deps` installs Debian's `nodejs` when `node` is missing); run with `make test`.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::json;
use sluice_tests::envoy::{free_ports, repo_root, Demo, Envoy};

/// A generous bound on how late a client may send after its wait: well past any scheduling delay, well short of
/// another Retry-After.
const LATE_MS: u64 = 3_000;

/// How long a client may run: every run here takes a few seconds.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, Copy, PartialEq)]
enum Language {
    Rust,
    Python,
    JavaScript,
}

const LANGUAGES: [Language; 3] = [Language::Rust, Language::Python, Language::JavaScript];

impl Language {
    fn name(self) -> &'static str {
        match self {
            Language::Rust => "rust",
            Language::Python => "python",
            Language::JavaScript => "js",
        }
    }

    fn command(self) -> Command {
        let examples = repo_root().join("examples/clients");
        match self {
            Language::Rust => Command::new(env!("CARGO_BIN_EXE_backoff-client")),
            Language::Python => {
                let mut command = Command::new(program("python3"));
                command.arg(examples.join("backoff.py"));
                command
            }
            Language::JavaScript => {
                let mut command = Command::new(program("node"));
                command.arg(examples.join("backoff.mjs"));
                command
            }
        }
    }
}

/// `name` on the PATH; missing is an error that says how to install it, never a silent skip.
fn program(name: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
        .unwrap_or_else(|| {
            panic!(
                "`{name}` is not installed: the example clients' test runs it. Run `make deps` (it installs Debian's \
                 nodejs when `node` is missing: `scripts/apt-install.sh node=nodejs`)"
            )
        })
}

/// A try, as a client prints it.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Attempt {
    request: u64,
    try_: u64,
    /// When it was sent and when its answer came, in ms since the client started.
    sent_ms: u64,
    done_ms: u64,
    /// 0: a connection error.
    status: u16,
    retry_after: Option<u64>,
    /// The rate-limit headers' remaining and seconds until the quota is whole.
    remaining: Option<u64>,
    reset: Option<u64>,
}

/// One line of a client's output.
#[derive(Debug, Clone, PartialEq)]
enum Line {
    Attempt(Attempt),
    Wait {
        request: u64,
        ms: u64,
        reason: String,
    },
    GiveUp {
        request: u64,
        reason: String,
    },
    Summary {
        ok: u64,
        failed: u64,
        attempts: u64,
        retries: u64,
    },
}

fn parse(output: &str) -> Vec<Line> {
    output
        .lines()
        .map(|line| {
            let mut words = line.split(' ');
            let kind = words.next().unwrap_or_default();
            let fields: HashMap<&str, &str> = words.filter_map(|w| w.split_once('=')).collect();
            let text = |name: &str| -> String {
                fields
                    .get(name)
                    .unwrap_or_else(|| panic!("no {name} in {line:?}"))
                    .to_string()
            };
            let maybe = |name: &str| -> Option<u64> {
                match text(name).as_str() {
                    "-" => None,
                    // JavaScript prints a number past 2^53 as the nearest double (18446744073709552000).
                    value => Some(value.parse().unwrap_or_else(|_| {
                        value
                            .parse::<f64>()
                            .unwrap_or_else(|_| panic!("{name} in {line:?}"))
                            as u64
                    })),
                }
            };
            let number = |name: &str| maybe(name).unwrap_or_else(|| panic!("{name} in {line:?}"));
            match kind {
                "attempt" => Line::Attempt(Attempt {
                    request: number("request"),
                    try_: number("try"),
                    sent_ms: number("sent_ms"),
                    done_ms: number("done_ms"),
                    status: number("status") as u16,
                    retry_after: maybe("retry_after"),
                    remaining: maybe("remaining"),
                    reset: maybe("reset"),
                }),
                "wait" => Line::Wait {
                    request: number("request"),
                    ms: number("ms"),
                    reason: text("reason"),
                },
                "give_up" => Line::GiveUp {
                    request: number("request"),
                    reason: text("reason"),
                },
                "summary" => Line::Summary {
                    ok: number("ok"),
                    failed: number("failed"),
                    attempts: number("attempts"),
                    retries: number("retries"),
                },
                _ => panic!("a line the clients do not print: {line:?}"),
            }
        })
        .collect()
}

/// A client's run: its lines, and its output for messages.
#[derive(Debug)]
struct Run {
    language: Language,
    lines: Vec<Line>,
    output: String,
}

impl Run {
    fn attempts(&self) -> Vec<Attempt> {
        self.lines
            .iter()
            .filter_map(|line| match line {
                Line::Attempt(attempt) => Some(*attempt),
                _ => None,
            })
            .collect()
    }

    fn statuses(&self) -> Vec<u16> {
        self.attempts().iter().map(|a| a.status).collect()
    }

    fn give_ups(&self) -> Vec<(u64, String)> {
        self.lines
            .iter()
            .filter_map(|line| match line {
                Line::GiveUp { request, reason } => Some((*request, reason.clone())),
                _ => None,
            })
            .collect()
    }

    fn summary(&self) -> (u64, u64, u64, u64) {
        match self.lines.last() {
            Some(&Line::Summary {
                ok,
                failed,
                attempts,
                retries,
            }) => (ok, failed, attempts, retries),
            _ => panic!(
                "{:?} ended without its summary:\n{}",
                self.language, self.output
            ),
        }
    }

    /// Every try after a wait: it was sent no earlier than the wait after the previous try's answer, and not much
    /// later. A wait for Retry-After is exactly the Retry-After that answer carried. Returns how many retries
    /// followed a Retry-After.
    #[track_caller]
    fn check_waits(&self) -> usize {
        let mut honoured = 0;
        let mut previous: Option<(u64, u64, Option<u64>)> = None; // (request, done_ms, retry_after)
        let mut wait: Option<(u64, String)> = None;
        for line in &self.lines {
            match line {
                Line::Wait { ms, reason, .. } => wait = Some((*ms, reason.clone())),
                Line::Attempt(Attempt {
                    request,
                    try_,
                    sent_ms,
                    done_ms,
                    retry_after,
                    ..
                }) => {
                    if *try_ > 1 {
                        let (before_request, before_done, before_retry_after) =
                            previous.unwrap_or_else(|| panic!("a retry first:\n{}", self.output));
                        assert_eq!(before_request, *request, "{}", self.output);
                        let (ms, reason) = wait.clone().unwrap_or_else(|| {
                            panic!("a retry without a wait before it:\n{}", self.output)
                        });
                        if let Some(seconds) = before_retry_after {
                            assert_eq!(
                                (ms, reason.as_str()),
                                (seconds * 1_000, "retry-after"),
                                "{:?} did not wait the Retry-After it was given:\n{}",
                                self.language,
                                self.output
                            );
                            honoured += 1;
                        }
                        assert!(
                            *sent_ms >= before_done + ms,
                            "{:?} sent request {request} try {try_} at {sent_ms} ms, before {ms} ms had passed \
                             since the answer at {before_done} ms:\n{}",
                            self.language,
                            self.output
                        );
                        assert!(
                            *sent_ms <= before_done + ms + LATE_MS,
                            "{:?} sent its retry {} ms after the wait:\n{}",
                            self.language,
                            sent_ms - before_done - ms,
                            self.output
                        );
                    }
                    previous = Some((*request, *done_ms, *retry_after));
                    wait = None;
                }
                _ => {}
            }
        }
        honoured
    }
}

/// Runs `language`'s client with `args` (URL, COUNT, options) to its end.
fn run(language: Language, args: &[String]) -> Run {
    let child = language
        .command()
        .args(args)
        .env_remove("http_proxy")
        .env_remove("HTTP_PROXY")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("starting the {language:?} client: {e}"));
    // A client that never stops is killed (and fails) rather than holding the suite until nextest's timeout.
    let pid = child.id() as libc::pid_t;
    let (done, ended) = std::sync::mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        if ended.recv_timeout(CLIENT_TIMEOUT).is_err() {
            // SAFETY: kill(2) on the child this function started and has not reaped yet.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    });
    let output = child
        .wait_with_output()
        .unwrap_or_else(|e| panic!("running the {language:?} client: {e}"));
    let _ = done.send(());
    let _ = watchdog.join();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "the {language:?} client {args:?} failed ({}; killed after {CLIENT_TIMEOUT:?} if it ran that long):\n\
         {stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    Run {
        language,
        lines: parse(&stdout),
        output: stdout,
    }
}

/// Runs every `(language, args)` at once (the clients mostly sleep), in order of the list.
fn run_all(runs: Vec<(Language, Vec<String>)>) -> Vec<Run> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = runs
            .into_iter()
            .map(|(language, args)| scope.spawn(move || run(language, &args)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a client's run panicked"))
            .collect()
    })
}

fn args(url: String, count: u64, options: &[&str]) -> Vec<String> {
    let mut all = vec![url, count.to_string()];
    all.extend(options.iter().map(|o| o.to_string()));
    all
}

/// The demo with a small local limit per client address and path: 3 at once, then one every 4/3 s (a Retry-After
/// of 1 or 2 s); and a rule answering 503 under /export/, one every 4 s. `headers`: which rate-limit headers it sends
/// (`both`: the draft's and the legacy ones; `legacy` with its reset as a Unix time).
fn demo(headers: serde_json::Value) -> Envoy {
    let demo = Demo::shipped().unwrap();
    let mut plugin = json!({"headers": "both", "client_ip": {"trusted_hops": 0}, "rules": [
        {"name": "clients", "match": {"path_prefix": "/api/"}, "key": ["client_ip", "path"],
         "limits": [{"requests": 3, "per": "4s", "burst": 3}]},
        {"name": "export", "match": {"path_prefix": "/export/"}, "key": ["path"], "deny_status": 503,
         "limits": [{"requests": 1, "per": "4s"}]}]});
    for (name, value) in headers.as_object().into_iter().flatten() {
        plugin[name] = value.clone();
    }
    let closed = free_ports(1).unwrap()[0];
    Envoy::start(demo.options(plugin.to_string(), 2, closed).unwrap()).unwrap()
}

#[test]
fn each_client_stops_at_the_limit_and_resumes_after_retry_after() {
    // A second demo, started beside the first, has only X-RateLimit-Remaining and X-RateLimit-Reset (a Unix time) to
    // pace by. Its thread holds it until the clients are done: an Envoy dies with the thread that started it.
    let (url_tx, url_rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|scope| {
        scope.spawn(move || {
            let legacy = demo(json!({"headers": "legacy", "x_ratelimit_reset": "unix"}));
            let _ = url_tx.send(legacy.url(""));
            // Until the sender is dropped: the clients are done, or the test failed.
            let _ = stop_rx.recv();
        });
        let stop = stop_tx;
        let envoy = demo(json!({}));
        let legacy = url_rx.recv().expect("the second demo started");
        check_clients(&envoy, &legacy);
        drop(stop);
    });
}

/// Runs the clients against `envoy` (the rate-limit headers `both`) and `legacy` (a base URL: `legacy` headers).
fn check_clients(envoy: &Envoy, legacy: &str) {
    let mut plan = Vec::new();
    for language in LANGUAGES {
        let name = language.name();
        plan.push((language, args(envoy.url(&format!("/api/{name}")), 5, &[])));
        plan.push((
            language,
            args(envoy.url(&format!("/api/{name}-paced")), 5, &["--pace"]),
        ));
        plan.push((
            language,
            args(format!("{legacy}/api/{name}-paced"), 5, &["--pace"]),
        ));
        plan.push((
            language,
            args(
                envoy.url(&format!("/export/{name}")),
                2,
                &["--method", "POST"],
            ),
        ));
    }
    let runs = run_all(plan);
    let (mut denied, mut exports_denied) = (0, 0);
    for four in runs.chunks(4) {
        let [plain, paced, paced_legacy, post] = four else {
            unreachable!()
        };
        let refusals = plain.statuses().iter().filter(|s| **s == 429).count();
        assert_eq!(plain.check_waits(), refusals, "{}", plain.output);
        // Stops at the limit: three admitted (a full bucket), then refused with a Retry-After (a fourth within 4/3 s,
        // or a fifth within 8/3 s, is); every refusal is retried after exactly its Retry-After and the retry admitted
        // (Retry-After's guarantee: nobody else spends this key).
        let attempts = plain.attempts();
        assert_eq!(
            plain.statuses()[..3],
            [200, 200, 200],
            "{:?}:\n{}",
            plain.language,
            plain.output
        );
        assert_eq!(
            attempts[0].remaining,
            Some(2),
            "the RateLimit header's remaining: {}",
            plain.output
        );
        assert!(refusals >= 1, "never refused:\n{}", plain.output);
        for (i, attempt) in attempts.iter().enumerate() {
            if attempt.status == 429 {
                let retry_after = attempt.retry_after.expect("a 429 with a Retry-After");
                assert!((1..=2).contains(&retry_after), "{}", plain.output);
                let next = attempts.get(i + 1).expect("a retry after the 429");
                assert_eq!(
                    (next.request, next.try_, next.status),
                    (attempt.request, attempt.try_ + 1, 200),
                    "{}",
                    plain.output
                );
            }
        }
        assert!(plain.give_ups().is_empty(), "{}", plain.output);
        let (ok, failed, total, retries) = plain.summary();
        assert_eq!(
            (ok, failed, total, retries),
            (5, 0, 5 + refusals as u64, refusals as u64)
        );
        denied += refusals as u64;

        // Paced by the RateLimit header (or X-RateLimit-Remaining and -Reset): after the answer saying none is
        // left it holds the next request until the quota is whole again, and is never refused.
        for paced in [paced, paced_legacy] {
            assert_eq!(
                paced.statuses(),
                [200; 5],
                "{:?}:\n{}",
                paced.language,
                paced.output
            );
            // The first answer with none left (the third, unless the machine took over 4/3 s for three requests).
            let attempts = paced.attempts();
            let last = attempts
                .iter()
                .position(|a| a.remaining == Some(0))
                .unwrap_or_else(|| panic!("no answer with none left:\n{}", paced.output));
            let (third, fourth) = (attempts[last], attempts[last + 1]);
            let reset = third.reset.expect("a reset with r=0");
            // 4 s; as a Unix time, rounded to whole seconds twice.
            assert!((1..=5).contains(&reset), "{}", paced.output);
            assert!(
                paced
                    .lines
                    .iter()
                    .any(|l| matches!(l, Line::Wait { request, reason, .. }
                    if *request == fourth.request && reason == "quota")),
                "{}",
                paced.output
            );
            assert!(
                fourth.sent_ms >= third.done_ms + reset * 1_000,
                "{:?} sent at {} ms, before the quota's reset {} s after {} ms:\n{}",
                paced.language,
                fourth.sent_ms,
                reset,
                third.done_ms,
                paced.output
            );
            assert!(
                fourth.sent_ms <= third.done_ms + reset * 1_000 + LATE_MS,
                "{}",
                paced.output
            );
        }

        // A POST refused by sluice with a 503 was never processed: it is sent again after Retry-After (3 or 4 s).
        assert_eq!(
            post.statuses(),
            [200, 503, 200],
            "{:?}:\n{}",
            post.language,
            post.output
        );
        assert_eq!(post.check_waits(), 1, "{}", post.output);
        exports_denied += 1;
    }
    // Envoy refused exactly the tries the clients say were refused: none sent more than it printed.
    assert_eq!(
        envoy.stat_reaching("wasmcustom.sluice.rule.clients.denied", denied),
        denied
    );
    assert_eq!(
        envoy.stat_reaching("wasmcustom.sluice.rule.export.denied", exports_denied),
        exports_denied
    );
}

/// An upstream that answers every request 503, plain text without Retry-After (not sluice's answer), one connection
/// per request; under /huge-reset/ a 200 saying none is left for u64::MAX seconds, under /huge-retry-after/ a 503 with
/// a Retry-After of u64::MAX. Counts the requests per path.
struct Failing {
    port: u16,
    counts: Arc<Mutex<HashMap<String, u64>>>,
}

impl Failing {
    fn start() -> Failing {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let counts = Arc::new(Mutex::new(HashMap::new()));
        let seen = Arc::clone(&counts);
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let seen = Arc::clone(&seen);
                std::thread::spawn(move || {
                    let mut reader = BufReader::new(&stream);
                    let mut head = String::new();
                    if reader.read_line(&mut head).is_err() {
                        return;
                    }
                    let path = head.split(' ').nth(1).unwrap_or("").to_owned();
                    loop {
                        let mut line = String::new();
                        match reader.read_line(&mut line) {
                            Ok(0) | Err(_) => return,
                            Ok(_) if line == "\r\n" => break,
                            Ok(_) => {}
                        }
                    }
                    *seen.lock().unwrap().entry(path.clone()).or_insert(0) += 1;
                    // A hostile server's waits: the largest number of seconds a client can read.
                    let (status, extra) = if path.starts_with("/huge-reset/") {
                        ("200 OK", format!("ratelimit: \"x\";r=0;t={}\r\n", u64::MAX))
                    } else if path.starts_with("/huge-retry-after/") {
                        (
                            "503 Service Unavailable",
                            format!("retry-after: {}\r\n", u64::MAX),
                        )
                    } else {
                        ("503 Service Unavailable", String::new())
                    };
                    let body = "upstream down\n";
                    let reply = format!(
                        "HTTP/1.1 {status}\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n{extra}\
                         connection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = (&stream).write_all(reply.as_bytes());
                });
            }
        });
        Failing { port, counts }
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    fn count(&self, path: &str) -> u64 {
        self.counts.lock().unwrap().get(path).copied().unwrap_or(0)
    }
}

#[test]
fn each_client_stops_after_its_attempts_or_its_budget_and_never_resends_a_post_the_upstream_may_have_processed(
) {
    let upstream = Failing::start();
    let mut plan = Vec::new();
    for language in LANGUAGES {
        let name = language.name();
        let fast = ["--base-ms", "20", "--cap-ms", "200"];
        // One request, three tries at most, a budget to spare.
        let attempts = [&fast[..], &["--max-attempts", "3"]].concat();
        plan.push((
            language,
            args(upstream.url(&format!("/attempts/{name}")), 1, &attempts),
        ));
        // Six requests, five tries each at most, a budget of 2: two retries in all, then none.
        let budget = [&fast[..], &["--max-attempts", "5", "--budget", "2"]].concat();
        plan.push((
            language,
            args(upstream.url(&format!("/budget/{name}")), 6, &budget),
        ));
        // A POST answered 503 by the upstream, not by sluice: it may have been processed, so it is not sent again.
        let post = [&fast[..], &["--method", "POST"]].concat();
        plan.push((
            language,
            args(upstream.url(&format!("/post/{name}")), 2, &post),
        ));
    }
    // What a hostile server can send: waits no client can sleep through. A pacing hint is held at most
    // --max-wait-s, a longer Retry-After ends the request: no overflow, no endless sleep.
    for language in LANGUAGES {
        let name = language.name();
        let pace = ["--pace", "--max-wait-s", "1"];
        plan.push((
            language,
            args(upstream.url(&format!("/huge-reset/{name}")), 2, &pace),
        ));
        plan.push((
            language,
            args(upstream.url(&format!("/huge-retry-after/{name}")), 1, &[]),
        ));
    }
    let runs = run_all(plan);
    let (runs, hostile) = runs.split_at(LANGUAGES.len() * 3);
    for pair in hostile.chunks(2) {
        let [reset, retry_after] = pair else {
            unreachable!()
        };
        assert_eq!(reset.statuses(), [200, 200], "{}", reset.output);
        let held: Vec<u64> = reset
            .lines
            .iter()
            .filter_map(|l| match l {
                Line::Wait { ms, reason, .. } if reason == "quota" => Some(*ms),
                _ => None,
            })
            .collect();
        assert!(
            matches!(held.as_slice(), [ms] if *ms <= 1_000),
            "{}",
            reset.output
        );
        assert_eq!(retry_after.statuses(), [503], "{}", retry_after.output);
        assert_eq!(
            retry_after.give_ups(),
            [(1, "retry_after_too_long".to_owned())],
            "{}",
            retry_after.output
        );
    }
    for triple in runs.chunks(3) {
        let [attempts, budget, post] = triple else {
            unreachable!()
        };
        let name = attempts.language.name();
        assert_eq!(attempts.statuses(), [503; 3], "{}", attempts.output);
        assert_eq!(
            attempts.give_ups(),
            [(1, "attempts".to_owned())],
            "{}",
            attempts.output
        );
        assert_eq!(attempts.check_waits(), 0, "no Retry-After: backoff");
        assert_eq!(upstream.count(&format!("/attempts/{name}")), 3);
        // Full jitter: each wait at most base × 2^(try-1).
        for line in &attempts.lines {
            if let Line::Wait { ms, reason, .. } = line {
                assert_eq!(reason, "backoff", "{}", attempts.output);
                assert!(*ms <= 40, "{}", attempts.output);
            }
        }

        // The first request spends the budget (two retries), the five others earn 0.5 of a token: no retry.
        assert_eq!(budget.statuses(), [503; 8], "{}", budget.output);
        let give_ups: Vec<(u64, String)> = (1..=6).map(|r| (r, "budget".to_owned())).collect();
        assert_eq!(budget.give_ups(), give_ups, "{}", budget.output);
        assert_eq!(budget.summary(), (0, 6, 8, 2), "{}", budget.output);
        budget.check_waits();
        assert_eq!(upstream.count(&format!("/budget/{name}")), 8);

        assert_eq!(post.statuses(), [503, 503], "{}", post.output);
        assert_eq!(
            post.give_ups(),
            [
                (1, "not_idempotent".to_owned()),
                (2, "not_idempotent".to_owned())
            ],
            "{}",
            post.output
        );
        assert_eq!(upstream.count(&format!("/post/{name}")), 2);
    }
}
