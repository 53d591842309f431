//! The soak: real Envoy with sluice (a local, a cached and a strict rule), the real counter service and real
//! Redis under steady open-loop load for a while, with keys from a large key space that churns (a window of live
//! client keys slides forward: new keys arrive, old ones go cold and are never seen again). Every few seconds it
//! samples Envoy's heap (admin `/memory`: `allocated`, `heap_size`) and RSS, the service's RSS, Redis's key count
//! and `used_memory`, the proxy's and the service's sync and check errors, and the answers at the edge; it writes
//! the samples to `target/soak-series.csv` (`bench/plot_soak.py` draws them) and asserts that after the warm-up
//! (the first fifth of the run) every series stays flat: within the bounds below, which a leak of one record per
//! request or one Redis key per new client would cross (see [`Bounds`]).
//!
//! `SLUICE_SOAK_SECS` sets the duration (60 s in `make test`; `make soak` runs 600 s and plots), `SLUICE_SOAK_RATE`
//! the requests per second (200).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sluice_tests::envoy::{agent, get, repo_root, Envoy, EnvoyOptions, Template};
use sluice_tests::redis::Redis;
use sluice_tests::service::Service;

/// Live client keys at any moment (the window's width).
const LIVE_KEYS: u64 = 256;
/// New client keys per second: the window slides forward by this many, so a key is live for `LIVE_KEYS / CHURN`
/// = 8 s and then never comes back. Over 600 s that is about 19,000 distinct clients.
const CHURN_PER_SEC: f64 = 32.0;
/// Records each rule's key table holds per proxy: above the live window, far below the distinct keys of a run, so
/// the tables are full (and evict the cold keys) from about 8 s on, well inside the warm-up.
const MAX_KEYS: u64 = 512;
/// How long a key of the cached and strict rules lives in Redis after its last use, at most: the time its bucket
/// takes to refill (1 s at 1/s with a burst of 1) plus the lease lifetime (3 sync intervals: 0.3 s, or 3 s when the
/// service's backpressure stretches the interval tenfold) plus 1 s (`expire_key` in lua/prelude.lua), rounded up.
const REDIS_KEY_LIFETIME_SECS: f64 = 6.0;
/// The filter's callout timeout.
const TIMEOUT_MS: u64 = 500;
const SYNC_INTERVAL_MS: u64 = 100;
/// Load threads, each with its own keep-alive connection (open loop: a request is sent at its time whatever the
/// others are waiting for, as long as a thread is free).
const CONNECTIONS: usize = 8;

/// What "flat after the warm-up" allows, from the warm-up sample to the end of the run (each the median of three
/// consecutive samples, so one noisy sample neither passes nor fails the run): an absolute slack plus a share of
/// the value after the warm-up. Measured on a quiet run, each series moved by less than a tenth of its slack.
///
/// What a leak would do: one leaked shared-data record (about 100 bytes) per request, at 200 requests/s for the
/// 48 s after the warm-up of a 1-minute run, grows Envoy's heap by about 0.96 MB (the bound there is about
/// 0.7 MB), and by 9.6 MB after a 10-minute run's warm-up; a service leaking 1 KB per sync or check (about 50 a
/// second) grows by 2.4 MB in the minute (bound about 1.6 MB); Redis keys that outlived their refill would pile
/// up at 32 new clients a second per rule, past the live key space's bound within a few seconds.
struct Bounds;

impl Bounds {
    /// Envoy's `allocated` (its heap: shared data, queues, stats, connections).
    const ENVOY_HEAP_SLACK: u64 = 512 << 10;
    const ENVOY_HEAP_RATIO: f64 = 0.01;
    /// Envoy's RSS (adds the Wasm VMs' linear memories, which never shrink: a leak inside the filter shows here).
    const ENVOY_RSS_SLACK: u64 = 2 << 20;
    const ENVOY_RSS_RATIO: f64 = 0.01;
    /// The counter service's RSS.
    const SERVICE_RSS_SLACK: u64 = 1 << 20;
    const SERVICE_RSS_RATIO: f64 = 0.10;
    /// Redis's `used_memory`.
    const REDIS_MEMORY_SLACK: u64 = 512 << 10;
    const REDIS_MEMORY_RATIO: f64 = 0.10;
    /// Failed, timed-out or refused syncs and failed strict checks after the warm-up, as a share of those sent, plus
    /// a few: on a busy shared machine a Redis call now and then misses the service's Redis timeout (the service
    /// answers 503 and the callout fails), 10 checks of 1,718 and 3 syncs of 71 in the worst minute seen. A sync or
    /// check path that breaks (a refused token, a script error, a service that slows down as it runs) fails most of
    /// its calls.
    const SYNC_ERROR_SHARE: f64 = 0.02;
    const SYNC_ERROR_SLACK: u64 = 5;
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A well-mixed 64-bit hash (SplitMix64's finalizer): which key and which rule request `n` takes.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Request `n` of a run at `rate` per second: its path (half local, 30% cached, 20% strict) and client key (one of
/// the live window at its time).
fn request(n: u64, rate: f64) -> (&'static str, String) {
    let h = mix(n);
    let at = n as f64 / rate;
    let client = (CHURN_PER_SEC * at) as u64 + (h >> 8) % LIVE_KEYS;
    let path = match h % 10 {
        0..=4 => "/local/x",
        5..=7 => "/cached/x",
        _ => "/strict/x",
    };
    (path, format!("c{client}"))
}

/// The answers so far, by kind, updated by the load threads.
#[derive(Default)]
struct Outcomes {
    sent: AtomicU64,
    ok: AtomicU64,
    denied: AtomicU64,
    server_errors: AtomicU64,
    other: AtomicU64,
    transport_errors: AtomicU64,
    /// The first few unexpected answers, for the failure message.
    examples: std::sync::Mutex<Vec<String>>,
}

impl Outcomes {
    fn record(&self, outcome: Result<u16, String>) {
        let counter = match &outcome {
            Ok(200) => &self.ok,
            Ok(429) => &self.denied,
            Ok(s) if *s >= 500 => &self.server_errors,
            Ok(_) => &self.other,
            Err(_) => &self.transport_errors,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        if !matches!(outcome, Ok(200) | Ok(429)) {
            let mut examples = self.examples.lock().unwrap_or_else(|p| p.into_inner());
            if examples.len() < 5 {
                examples.push(format!("{outcome:?}"));
            }
        }
    }
}

/// Sends `total` requests at `rate` per second from `started`, each at its own time (late only if every thread is
/// busy), until `stop`.
fn load(
    envoy: &Envoy,
    rate: f64,
    total: u64,
    started: Instant,
    stop: &AtomicBool,
    outcomes: &Outcomes,
) {
    let next = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for _ in 0..CONNECTIONS {
            scope.spawn(|| {
                let mut client = agent();
                loop {
                    let n = next.fetch_add(1, Ordering::Relaxed) as u64;
                    if n >= total || stop.load(Ordering::Relaxed) {
                        return;
                    }
                    let due = started + Duration::from_secs_f64(n as f64 / rate);
                    if let Some(wait) = due.checked_duration_since(Instant::now()) {
                        std::thread::sleep(wait);
                    }
                    let (path, key) = request(n, rate);
                    let outcome = get(&client, &envoy.url(path), &[("x-client", key.as_str())])
                        .map(|reply| reply.status)
                        .map_err(|error| format!("{error:#}"));
                    if outcome.is_err() {
                        client = agent();
                    }
                    outcomes.sent.fetch_add(1, Ordering::Relaxed);
                    outcomes.record(outcome);
                }
            });
        }
    });
}

/// One sample of every series.
#[derive(Debug, Clone, Default)]
struct Sample {
    t: f64,
    envoy_allocated: u64,
    envoy_heap_size: u64,
    envoy_rss: u64,
    service_rss: u64,
    redis_keys: u64,
    redis_used_memory: u64,
    sent: u64,
    ok: u64,
    denied: u64,
    server_errors: u64,
    transport_errors: u64,
    sync_sent: u64,
    sync_ok: u64,
    sync_errors: u64,
    sync_dropped: u64,
    check_sent: u64,
    check_failed: u64,
    service_syncs: u64,
    service_errors: u64,
    /// The sync interval the service last advised (its backpressure hint), ms.
    next_sync_ms: u64,
}

const COLUMNS: &str = "t_s,envoy_allocated,envoy_heap_size,envoy_rss,service_rss,redis_keys,redis_used_memory,\
sent,ok,denied,server_errors,transport_errors,sync_sent,sync_ok,sync_errors,sync_dropped,check_sent,check_failed,\
service_syncs,service_errors,next_sync_ms";

impl Sample {
    fn csv(&self) -> String {
        format!(
            "{:.1},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}",
            self.t,
            self.envoy_allocated,
            self.envoy_heap_size,
            self.envoy_rss,
            self.service_rss,
            self.redis_keys,
            self.redis_used_memory,
            self.sent,
            self.ok,
            self.denied,
            self.server_errors,
            self.transport_errors,
            self.sync_sent,
            self.sync_ok,
            self.sync_errors,
            self.sync_dropped,
            self.check_sent,
            self.check_failed,
            self.service_syncs,
            self.service_errors,
            self.next_sync_ms
        )
    }
}

/// A number of Envoy's admin `/memory` (written as a JSON string).
fn memory_field(memory: &Value, name: &str) -> u64 {
    memory[name]
        .as_str()
        .and_then(|s| s.parse().ok())
        .or_else(|| memory[name].as_u64())
        .unwrap_or_else(|| panic!("no `{name}` in Envoy's /memory: {memory}"))
}

/// The sum of every line of the service's `/metrics` for `metric` (all its labels).
fn metric_sum(text: &str, metric: &str) -> u64 {
    text.lines()
        .filter(|line| {
            line.strip_prefix(metric)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

fn take(envoy: &Envoy, service: &Service, redis: &Redis, outcomes: &Outcomes, t: f64) -> Sample {
    let memory = get(&agent(), &envoy.admin_url("/memory"), &[])
        .and_then(|reply| reply.json())
        .expect("Envoy's admin /memory answers");
    let stats = envoy.stats().expect("Envoy's admin /stats answers");
    let stat = |name: &str| {
        stats
            .counter(&format!("wasmcustom.sluice.{name}"))
            .unwrap_or(0)
    };
    let metrics = service
        .get("/metrics")
        .expect("the service's /metrics answers")
        .body;
    let info = redis.text(&["INFO", "memory"]).expect("Redis answers INFO");
    let redis_used_memory = info
        .lines()
        .find_map(|line| line.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("INFO memory has used_memory");
    Sample {
        t,
        envoy_allocated: memory_field(&memory, "allocated"),
        envoy_heap_size: memory_field(&memory, "heap_size"),
        envoy_rss: sluice_tests::rss_bytes(envoy.pid()).unwrap_or(0),
        service_rss: sluice_tests::rss_bytes(service.pid().expect("the service runs")).unwrap_or(0),
        redis_keys: redis
            .text(&["DBSIZE"])
            .expect("Redis answers DBSIZE")
            .parse()
            .expect("DBSIZE is a number"),
        redis_used_memory,
        sent: outcomes.sent.load(Ordering::Relaxed),
        ok: outcomes.ok.load(Ordering::Relaxed),
        denied: outcomes.denied.load(Ordering::Relaxed),
        server_errors: outcomes.server_errors.load(Ordering::Relaxed)
            + outcomes.other.load(Ordering::Relaxed),
        transport_errors: outcomes.transport_errors.load(Ordering::Relaxed),
        sync_sent: stat("sync.sent"),
        sync_ok: stat("sync.ok"),
        sync_errors: stat("sync.failed") + stat("sync.timeout") + stat("sync.unauthorized"),
        sync_dropped: stat("sync.dropped"),
        check_sent: stat("check.sent"),
        check_failed: stat("check.failed"),
        service_syncs: metric_sum(&metrics, "sluice_syncs_total"),
        service_errors: metric_sum(&metrics, "sluice_errors_total"),
        next_sync_ms: metric_sum(&metrics, "sluice_next_sync_ms"),
    }
}

/// The median of a series over the three samples around index `i` (clamped to the run).
fn median3(samples: &[Sample], i: usize, series: impl Fn(&Sample) -> u64) -> u64 {
    let lo = i.saturating_sub(1).min(samples.len().saturating_sub(3));
    let mut values: Vec<u64> = samples[lo..(lo + 3).min(samples.len())]
        .iter()
        .map(series)
        .collect();
    values.sort_unstable();
    values[values.len() / 2]
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1 << 20) as f64)
}

#[test]
fn memory_keys_and_sync_errors_stay_flat_under_churning_load() {
    let duration = Duration::from_secs(env_or("SLUICE_SOAK_SECS", 60));
    let rate: f64 = env_or("SLUICE_SOAK_RATE", 200.0);
    let every = (duration / 120).clamp(Duration::from_secs(1), Duration::from_secs(5));

    let redis = Redis::start().unwrap();
    let service = Service::start(&redis.url()).unwrap();
    let limit = json!([{"requests": 1, "per": "second", "burst": 1}]);
    let rules = json!([
        {"name": "local", "match": {"path_prefix": "/local/"}, "key": ["header:x-client"],
         "consistency": "local", "limits": limit},
        {"name": "cached", "match": {"path_prefix": "/cached/"}, "key": ["header:x-client"],
         "consistency": "cached", "limits": limit},
        {"name": "strict", "match": {"path_prefix": "/strict/"}, "key": ["header:x-client"],
         "consistency": "strict", "limits": limit},
    ]);
    let plugin_config_json = json!({
        "max_keys": MAX_KEYS,
        "service": {
            "cluster": "sluice_service",
            "token": service.token(),
            "timeout_ms": TIMEOUT_MS,
            "sync_interval_ms": SYNC_INTERVAL_MS,
        },
        "rules": rules,
    })
    .to_string();
    let port = service.address().expect("the service listens").port();
    let envoy = Envoy::start(EnvoyOptions {
        template: Template::SluiceService,
        plugin_config_json,
        concurrency: 2,
        placeholders: vec![("SERVICE_PORT".to_owned(), port.to_string())],
    })
    .unwrap();

    let total = (rate * duration.as_secs_f64()) as u64;
    let outcomes = Outcomes::default();
    let stop = AtomicBool::new(false);
    let started = Instant::now();
    let mut samples = Vec::new();
    std::thread::scope(|scope| {
        let loader = scope.spawn(|| load(&envoy, rate, total, started, &stop, &outcomes));
        // Bounded: the load stops at `duration` whatever happens (a sample that panics stops it too).
        let _stop_on_exit = StopOnDrop(&stop);
        let mut next = started;
        while next <= started + duration {
            if let Some(wait) = next.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
            let t = started.elapsed().as_secs_f64();
            samples.push(take(&envoy, &service, &redis, &outcomes, t));
            next += every;
        }
        stop.store(true, Ordering::Relaxed);
        loader.join().expect("the load threads do not panic");
    });
    samples.push(take(
        &envoy,
        &service,
        &redis,
        &outcomes,
        started.elapsed().as_secs_f64(),
    ));

    let mut csv = format!("{COLUMNS}\n");
    for sample in &samples {
        let _ = writeln!(csv, "{}", sample.csv());
    }
    let out = repo_root().join("target").join("soak-series.csv");
    std::fs::write(&out, &csv).expect("writing target/soak-series.csv");

    let warm = samples
        .iter()
        .position(|s| s.t >= duration.as_secs_f64() / 5.0)
        .expect("samples after the warm-up");
    let end = samples.len() - 1;
    let first = &samples[warm];
    let last = &samples[end];
    let elapsed = last.t - first.t;

    let mut report = format!(
        "soak: {:.0} s at {rate}/s, {} samples every {every:?}, warm-up until {:.0} s; {} requests: {} 200, {} \
         429, {} 5xx or other, {} without an answer\n",
        last.t, samples.len(), first.t, last.sent, last.ok, last.denied, last.server_errors,
        last.transport_errors
    );
    let mut failures = Vec::new();
    let mut flat = |what: &str, series: fn(&Sample) -> u64, slack: u64, ratio: f64| {
        let (start, at_warm, at_end) = (
            series(&samples[0]),
            median3(&samples, warm, series),
            median3(&samples, end, series),
        );
        let allowed = at_warm + slack + (at_warm as f64 * ratio) as u64;
        let _ = writeln!(
            report,
            "  {what}: start {start}, after warm-up {at_warm}, end {at_end} (at most {allowed}: {} + {:.0}%)",
            mib(slack),
            ratio * 100.0
        );
        if at_end > allowed {
            failures.push(format!(
                "{what} grew from {at_warm} to {at_end} after the warm-up, more than {} + {:.0}%",
                mib(slack),
                ratio * 100.0
            ));
        }
    };
    flat(
        "Envoy allocated",
        |s| s.envoy_allocated,
        Bounds::ENVOY_HEAP_SLACK,
        Bounds::ENVOY_HEAP_RATIO,
    );
    flat(
        "Envoy RSS",
        |s| s.envoy_rss,
        Bounds::ENVOY_RSS_SLACK,
        Bounds::ENVOY_RSS_RATIO,
    );
    flat(
        "service RSS",
        |s| s.service_rss,
        Bounds::SERVICE_RSS_SLACK,
        Bounds::SERVICE_RSS_RATIO,
    );
    flat(
        "Redis used_memory",
        |s| s.redis_used_memory,
        Bounds::REDIS_MEMORY_SLACK,
        Bounds::REDIS_MEMORY_RATIO,
    );
    let _ = writeln!(
        report,
        "  Envoy heap_size: start {}, after warm-up {}, end {}",
        samples[0].envoy_heap_size, first.envoy_heap_size, last.envoy_heap_size
    );

    // Redis holds the keys of the cached and strict rules used within their lifetime: at most the live window
    // plus the clients that went cold within it, per rule, and a few of the service's own.
    let live_bound =
        (2.0 * (LIVE_KEYS as f64 + CHURN_PER_SEC * REDIS_KEY_LIFETIME_SECS)) as u64 + 16;
    let most_keys = samples[warm..]
        .iter()
        .map(|s| s.redis_keys)
        .max()
        .unwrap_or(0);
    let _ = writeln!(
        report,
        "  Redis keys: start {}, after warm-up {}, end {}, most after the warm-up {most_keys} (at most {live_bound}); \
         distinct clients in the run {}",
        samples[0].redis_keys,
        median3(&samples, warm, |s| s.redis_keys),
        median3(&samples, end, |s| s.redis_keys),
        LIVE_KEYS + (CHURN_PER_SEC * last.t) as u64
    );
    if most_keys > live_bound {
        failures.push(format!(
            "Redis held {most_keys} keys after the warm-up, more than the live key space allows ({live_bound})"
        ));
    }

    let syncs = last.sync_sent - first.sync_sent;
    let sync_errors = last.sync_errors - first.sync_errors;
    let checks = last.check_sent - first.check_sent;
    let check_errors = last.check_failed - first.check_failed;
    let service_errors = last.service_errors - first.service_errors;
    let dropped = last.sync_dropped - first.sync_dropped;
    let _ = writeln!(
        report,
        "  after the warm-up ({elapsed:.0} s): {syncs} syncs, {sync_errors} failed; {checks} strict checks, \
         {check_errors} failed; {} syncs at the service, {service_errors} service errors; {dropped} keys dropped \
         from the sync; the service advised syncing every {} ms after the warm-up, {} ms at the end",
        last.service_syncs - first.service_syncs,
        first.next_sync_ms,
        last.next_sync_ms
    );
    let allowed_errors =
        |sent: u64| Bounds::SYNC_ERROR_SLACK + (sent as f64 * Bounds::SYNC_ERROR_SHARE) as u64;
    if sync_errors > allowed_errors(syncs) || check_errors > allowed_errors(checks) {
        failures.push(format!(
            "sync errors {sync_errors} of {syncs}, check errors {check_errors} of {checks}: more than {} + {:.0}%",
            Bounds::SYNC_ERROR_SLACK,
            Bounds::SYNC_ERROR_SHARE * 100.0
        ));
    }
    if service_errors > allowed_errors(syncs + checks) {
        failures.push(format!("the service counted {service_errors} errors"));
    }
    if dropped > 0 {
        failures.push(format!("{dropped} keys were dropped from the sync"));
    }
    if syncs == 0 || checks == 0 {
        failures.push("no syncs or no strict checks after the warm-up".to_owned());
    }

    // The edge: every request answered 200 or 429, each rule admitting and denying (the mix is real), and the load
    // really offered (at least half the planned requests on a busy machine).
    let examples = outcomes
        .examples
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    if last.server_errors + last.transport_errors > 0 {
        failures.push(format!(
            "{} answers other than 200/429 and {} without an answer at the edge, e.g. {examples:?}",
            last.server_errors, last.transport_errors
        ));
    }
    if (last.sent as f64) < 0.5 * total as f64 {
        failures.push(format!("only {} of {total} requests were sent", last.sent));
    }
    let stats = envoy.stats().expect("Envoy's admin /stats answers");
    let mut per_rule = BTreeMap::new();
    for rule in ["local", "cached", "strict"] {
        let count = |what: &str| {
            stats
                .counter(&format!("wasmcustom.sluice.rule.{rule}.{what}"))
                .unwrap_or(0)
        };
        let (allowed, denied) = (count("allowed"), count("denied"));
        per_rule.insert(rule, (allowed, denied));
        if allowed == 0 || denied == 0 {
            failures.push(format!("rule {rule} allowed {allowed} and denied {denied}"));
        }
    }
    let _ = writeln!(report, "  per rule (allowed, denied): {per_rule:?}");
    let _ = writeln!(report, "  samples in {}", out.display());
    eprintln!("{report}");
    assert!(
        failures.is_empty(),
        "{}\n{report}\nsluice stats: {:?}",
        failures.join("\n"),
        envoy.sluice_stats()
    );
}

/// Sets the flag when dropped: the load stops if the sampling loop panics.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}
