//! An open-loop load generator for the overload benchmark: request i is sent at start + i/R, on a
//! task of its own, whether or not earlier requests were answered (a closed loop such as wrk slows
//! down with the server and hides an overload). Each request picks a class by a seeded split of
//! `--classes` and says it in `x-sluice-class`.
//!
//! Sending stops at `--duration-s`; requests still out get at most `--timeout-ms` more (the timeout
//! of every request, counted from when it was sent; a timed-out request is failed). Latencies are
//! from when a request was sent (its task spawned, the task's own start included); the schedule
//! it kept shows in `achieved_rate` and `send_lag_ms` (how late each send was against its due time).
//!
//! Prints one JSON object on stdout: the offered and achieved rate, and per class and overall:
//! sent, ok (2xx), status counts, errors, timeouts, goodput (2xx answers per second of sending: ok / D,
//! the steady-state rate of successes, since answers arrive over [latency, D + latency]) and the
//! p50/p90/p99/max latency (ms) of the 2xx answers. `last_ok_s` says when the last 2xx arrived.
//!
//! `--phases` also reports the requests sent in each phase on their own; `--call SECONDS=URL` GETs
//! a URL at that time on the load's own clock (so a capacity change starts exactly with its
//! phase); `--timeline FILE` writes every request (sent, class, status, latency) as CSV. Every URL
//! must be on a loopback address: the load never leaves the machine.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper::{Request, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};
use sluice_overload::{loopback_http, percentile, Classes, SplitMix64};
use tokio::task::JoinSet;
use tokio::time::Instant;

const CLASS_HEADER: &str = "x-sluice-class";

#[derive(Parser, Debug)]
#[command(about = "Open-loop HTTP load: a fixed arrival schedule, never waiting for answers")]
struct Args {
    /// Absolute http:// URL on a loopback address (127.0.0.0/8, [::1], localhost); anything else is
    /// refused.
    #[arg(long)]
    url: String,
    /// Requests per second.
    #[arg(long)]
    rate: f64,
    /// Seconds of sending.
    #[arg(long, default_value_t = 10.0)]
    duration_s: f64,
    /// Timeout of each request, from when it was sent (a timed-out request is failed).
    #[arg(long, default_value_t = 5000)]
    timeout_ms: u64,
    /// Classes and their shares, "high:0.2,low:0.8": each request sends `x-sluice-class: <class>`.
    /// Without it, no class header.
    #[arg(long)]
    classes: Option<String>,
    /// Idle keep-alive connections kept for reuse. A request finding none idle opens a new one:
    /// sending never waits for a connection.
    #[arg(long, default_value_t = 256)]
    connections: usize,
    /// Seed of the class split.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Phase boundaries, seconds from the start ("4,8": 0-4, 4-8, 8-end): each phase's requests
    /// (by when they were sent) are also reported on their own, in "phases".
    #[arg(long)]
    phases: Option<String>,
    /// Also writes every request to this CSV file: when it was sent (s from the start), its class,
    /// its status (0: timed out or failed) and its latency (ms, empty unless answered).
    #[arg(long)]
    timeline: Option<std::path::PathBuf>,
    /// "SECONDS=URL": GETs the http:// URL at that time from the start, on the load's own clock
    /// (e.g. an upstream's capacity change, exactly at a phase boundary). Repeatable; each call's
    /// time and status are reported in "calls".
    #[arg(long = "call")]
    calls: Vec<String>,
}

enum Outcome {
    /// The status, the latency (ms, from when the request was sent) and when it was answered.
    Status(u16, f64, Instant),
    Timeout,
    Error(String),
}

#[derive(Default)]
struct Tally {
    sent: u64,
    ok: u64,
    statuses: BTreeMap<u16, u64>,
    errors: u64,
    timeouts: u64,
    ok_latencies_ms: Vec<f64>,
    last_ok: Option<Instant>,
}

impl Tally {
    fn add(&mut self, outcome: &Outcome) {
        self.sent += 1;
        match outcome {
            Outcome::Status(status, ms, at) => {
                *self.statuses.entry(*status).or_default() += 1;
                if (200..300).contains(status) {
                    self.ok += 1;
                    self.ok_latencies_ms.push(*ms);
                    self.last_ok = Some(self.last_ok.map_or(*at, |t: Instant| t.max(*at)));
                }
            }
            Outcome::Timeout => self.timeouts += 1,
            Outcome::Error(_) => self.errors += 1,
        }
    }

    fn report(mut self, duration_s: f64, start: Instant) -> Value {
        self.ok_latencies_ms.sort_by(f64::total_cmp);
        let lat = |p| percentile(&self.ok_latencies_ms, p).map(round3);
        let statuses: BTreeMap<String, u64> = self
            .statuses
            .iter()
            .map(|(s, n)| (s.to_string(), *n))
            .collect();
        json!({
            "sent": self.sent,
            "ok": self.ok,
            "status": statuses,
            "errors": self.errors,
            "timeouts": self.timeouts,
            "success_rate": if self.sent > 0 { (self.ok as f64 / self.sent as f64 * 1e5).round() / 1e5 } else { 0.0 },
            "goodput": round3(self.ok as f64 / duration_s),
            "last_ok_s": self.last_ok.map(|t| round3((t - start).as_secs_f64())),
            "p50_ms": lat(50.0),
            "p90_ms": lat(90.0),
            "p99_ms": lat(99.0),
            "max_ms": lat(100.0),
        })
    }
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

fn fail(message: String) -> ! {
    eprintln!("sluice-load: {message}");
    std::process::exit(2);
}

type HttpClient = Client<HttpConnector, Empty<Bytes>>;

async fn one(
    client: HttpClient,
    uri: Uri,
    class: Option<String>,
    sent: Instant,
    timeout: Duration,
) -> Outcome {
    let mut request = Request::get(uri);
    if let Some(class) = class {
        request = request.header(CLASS_HEADER, class);
    }
    let request = match request.body(Empty::new()) {
        Ok(r) => r,
        Err(e) => return Outcome::Error(e.to_string()),
    };
    let exchange = async {
        let response = client.request(request).await.map_err(|e| {
            // The chain of sources says what actually went wrong (refused, reset, closed).
            let mut message = e.to_string();
            let mut source = std::error::Error::source(&e);
            while let Some(s) = source {
                message = format!("{message}: {s}");
                source = s.source();
            }
            message
        })?;
        let status = response.status().as_u16();
        response
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?;
        Ok::<u16, String>(status)
    };
    match tokio::time::timeout_at(sent + timeout, exchange).await {
        Ok(Ok(status)) => {
            let now = Instant::now();
            Outcome::Status(status, (now - sent).as_secs_f64() * 1000.0, now)
        }
        Ok(Err(e)) => Outcome::Error(e),
        Err(_) => Outcome::Timeout,
    }
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    if !(args.rate.is_finite() && args.rate > 0.0) {
        fail(format!("--rate must be > 0, got {}", args.rate));
    }
    if !(args.duration_s.is_finite() && args.duration_s > 0.0) {
        fail(format!("--duration-s must be > 0, got {}", args.duration_s));
    }
    let uri: Uri = args
        .url
        .parse()
        .unwrap_or_else(|e| fail(format!("--url {:?}: {e}", args.url)));
    if !loopback_http(&args.url) {
        fail(format!(
            "--url {:?}: expected an absolute http:// URL on a loopback address",
            args.url
        ));
    }
    let classes = args.classes.as_deref().map(|spec| {
        Classes::parse(spec).unwrap_or_else(|e| fail(format!("--classes {spec:?}: {e}")))
    });
    let timeout = Duration::from_millis(args.timeout_ms);
    let calls: Vec<(f64, Uri)> = args
        .calls
        .iter()
        .map(|spec| {
            let parsed = spec.split_once('=').and_then(|(at, url)| {
                let at: f64 = at.trim().parse().ok()?;
                let valid = at.is_finite() && at >= 0.0 && loopback_http(url);
                valid.then(|| url.parse::<Uri>().ok()).flatten().map(|url| (at, url))
            });
            parsed.unwrap_or_else(|| {
                fail(format!(
                    "--call {spec:?}: expected SECONDS=URL, SECONDS >= 0, URL http:// on a loopback address"
                ))
            })
        })
        .collect();

    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: HttpClient = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(args.connections)
        .build(connector);

    let names: Vec<String> = classes
        .as_ref()
        .map(|c| c.names().to_vec())
        .unwrap_or_default();
    // Request i is due at start + i/R, for every i/R < D.
    let total = (args.rate * args.duration_s).ceil() as u64;
    let in_flight = Arc::new(AtomicUsize::new(0));
    let mut max_in_flight = 0;
    let mut rng = SplitMix64::new(args.seed);
    let mut tasks = JoinSet::new();
    let mut lags_ms = Vec::with_capacity(total as usize);
    let start = Instant::now() + Duration::from_millis(20);
    // The same moment on the wall clock, so that a caller can put its own samples on this clock.
    let start_unix_s = (std::time::SystemTime::now() + Duration::from_millis(20))
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let mut called = JoinSet::new();
    for (at, url) in calls {
        let client = client.clone();
        called.spawn(async move {
            tokio::time::sleep_until(start + Duration::from_secs_f64(at)).await;
            let done = one(client, url.clone(), None, Instant::now(), timeout).await;
            let status = match done {
                Outcome::Status(status, ..) => json!(status),
                Outcome::Timeout => json!("timeout"),
                Outcome::Error(e) => json!(e),
            };
            json!({"at_s": round3(at), "url": url.to_string(), "status": status})
        });
    }
    let mut first_sent = None;
    let mut last_sent = start;
    for i in 0..total {
        let due = start + Duration::from_secs_f64(i as f64 / args.rate);
        if due > Instant::now() {
            tokio::time::sleep_until(due).await;
        }
        let now = Instant::now();
        first_sent.get_or_insert(now);
        last_sent = now;
        lags_ms.push((now - due).as_secs_f64() * 1000.0);
        let class = classes.as_ref().map(|c| c.pick(rng.next_f64()));
        let header = class.map(|c| names[c].clone());
        let (client, uri, in_flight) = (client.clone(), uri.clone(), in_flight.clone());
        max_in_flight = max_in_flight.max(in_flight.fetch_add(1, Ordering::Relaxed) + 1);
        tasks.spawn(async move {
            let outcome = one(client, uri, header, now, timeout).await;
            in_flight.fetch_sub(1, Ordering::Relaxed);
            (class, outcome, now)
        });
    }
    let sending_s = (last_sent - start).as_secs_f64();

    // Stragglers: every request times out by its send time + T; this is a backstop.
    let mut overall = Tally::default();
    let mut per_class: Vec<Tally> = names.iter().map(|_| Tally::default()).collect();
    let mut error_samples: BTreeMap<String, u64> = BTreeMap::new();
    let mut bounds: Vec<f64> = vec![0.0];
    if let Some(spec) = &args.phases {
        for b in spec.split(',').filter(|b| !b.trim().is_empty()) {
            match b.trim().parse::<f64>() {
                Ok(b) if b > *bounds.last().unwrap_or(&0.0) && b < args.duration_s => {
                    bounds.push(b)
                }
                _ => fail(format!(
                    "--phases {spec:?}: expected increasing seconds within the duration"
                )),
            }
        }
    }
    bounds.push(args.duration_s);
    let mut phases: Vec<(Tally, Vec<Tally>)> = bounds
        .windows(2)
        .map(|_| {
            (
                Tally::default(),
                names.iter().map(|_| Tally::default()).collect(),
            )
        })
        .collect();
    let backstop = last_sent + timeout + Duration::from_secs(1);
    let mut timeline = String::new();
    loop {
        match tokio::time::timeout_at(backstop, tasks.join_next()).await {
            Ok(Some(Ok((class, outcome, sent)))) => {
                let at = (sent - start).as_secs_f64();
                if args.timeline.is_some() {
                    let class = class.map_or("", |c| names[c].as_str());
                    let (status, ms) = match &outcome {
                        Outcome::Status(status, ms, _) => (*status, format!("{ms:.3}")),
                        _ => (0, String::new()),
                    };
                    timeline.push_str(&format!("{at:.4},{class},{status},{ms}\n"));
                }
                let phase = bounds
                    .windows(2)
                    .position(|w| at < w[1])
                    .unwrap_or(bounds.len() - 2);
                if let Some((all, by_class)) = phases.get_mut(phase) {
                    all.add(&outcome);
                    if let Some(t) = class.and_then(|c| by_class.get_mut(c)) {
                        t.add(&outcome);
                    }
                }
                if let Outcome::Error(e) = &outcome {
                    if error_samples.len() < 8 || error_samples.contains_key(e) {
                        *error_samples.entry(e.clone()).or_default() += 1;
                    }
                }
                overall.add(&outcome);
                if let Some(c) = class {
                    per_class[c].add(&outcome);
                }
            }
            Ok(Some(Err(e))) => {
                overall.add(&Outcome::Error(format!("task: {e}")));
            }
            Ok(None) => break,
            Err(_) => {
                // Past the backstop: whatever is left counts as timed out (class unknown).
                let left = tasks.len();
                tasks.abort_all();
                for _ in 0..left {
                    overall.add(&Outcome::Timeout);
                }
                break;
            }
        }
    }
    let mut calls_out = Vec::new();
    while let Some(call) = called.join_next().await {
        calls_out.push(call.unwrap_or_else(|e| json!({"error": e.to_string()})));
    }
    let elapsed_s = (Instant::now() - start).as_secs_f64();
    if let Some(path) = &args.timeline {
        let csv = format!("sent_s,class,status,latency_ms\n{timeline}");
        if let Err(e) = std::fs::write(path, csv) {
            fail(format!("--timeline {}: {e}", path.display()));
        }
    }

    lags_ms.sort_by(f64::total_cmp);
    // The achieved rate: requests sent over the time they took to send (n - 1 gaps).
    let achieved = match first_sent {
        Some(first) if total > 1 && last_sent > first => {
            (total - 1) as f64 / (last_sent - first).as_secs_f64()
        }
        _ => total as f64 / args.duration_s,
    };
    let shares = classes.as_ref().map(Classes::shares).unwrap_or_default();
    let mut classes_out = serde_json::Map::new();
    for ((name, tally), share) in names.iter().zip(per_class).zip(shares) {
        let mut report = tally.report(args.duration_s, start);
        report["share"] = json!(round3(share));
        classes_out.insert(name.clone(), report);
    }
    let phases_out: Vec<Value> = phases
        .into_iter()
        .zip(bounds.windows(2))
        .map(|((all, by_class), w)| {
            let length = w[1] - w[0];
            let classes: serde_json::Map<String, Value> = names
                .iter()
                .zip(by_class)
                .map(|(n, t)| (n.clone(), t.report(length, start)))
                .collect();
            json!({"from_s": w[0], "to_s": w[1], "overall": all.report(length, start), "classes": classes})
        })
        .collect();
    let out = json!({
        "url": args.url,
        "start_unix_s": start_unix_s,
        "offered_rate": args.rate,
        "duration_s": args.duration_s,
        "timeout_ms": args.timeout_ms,
        "connections": args.connections,
        "sent": total,
        "achieved_rate": round3(achieved),
        "sending_s": round3(sending_s),
        "elapsed_s": round3(elapsed_s),
        "send_lag_ms": {
            "p50": percentile(&lags_ms, 50.0).map(round3),
            "p99": percentile(&lags_ms, 99.0).map(round3),
            "max": percentile(&lags_ms, 100.0).map(round3),
        },
        "max_in_flight": max_in_flight,
        "overall": overall.report(args.duration_s, start),
        "classes": classes_out,
        "error_samples": error_samples,
        "phases": phases_out,
        "calls": calls_out,
    });
    println!("{out}");
}
