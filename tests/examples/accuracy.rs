//! Accuracy of cached consistency: four proxies (wasmtime host, two workers each, the real
//! filter) share one limit through the real counter service and a real Redis. Uneven,
//! shifting arrivals are played in real time; what the fleet admitted is compared with what one
//! exact token bucket admits over the very same arrivals.
//!
//! `cargo run -p sluice-tests --bin accuracy -- [interval_ms ...]` (needs the release filter and
//! service builds and `redis-server`; `make bench-accuracy` does it all). Prints a markdown table.

use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Result;
use sluice_core::{Limit, LimitState, Period};
use sluice_host::{
    filter_wasm_path, ExchangeState, FilterModule, Proxy, ProxyOptions, RequestSpec, VirtualClock,
};
use sluice_tests::redis::Redis;
use sluice_tests::service::Service;

#[path = "../tests/support/bridge.rs"]
mod bridge;
use bridge::{Bridge, Rng};

const PROXIES: usize = 4;
const WORKERS: usize = 2;
/// The shared limit: 300 a second, bursts of 100.
const RATE: u64 = 300;
const BURST: u64 = 100;
const PHASE: Duration = Duration::from_secs(2);

/// (total requests per second, share of each proxy) per phase: uneven, shifting, over and
/// under the limit.
const PHASES: [(f64, [f64; PROXIES]); 6] = [
    (450.0, [0.55, 0.25, 0.15, 0.05]),
    (450.0, [0.05, 0.15, 0.25, 0.55]),
    (200.0, [0.25, 0.25, 0.25, 0.25]),
    (600.0, [0.70, 0.10, 0.10, 0.10]),
    (450.0, [0.10, 0.70, 0.10, 0.10]),
    (300.0, [0.40, 0.40, 0.10, 0.10]),
];

/// A small deterministic generator (xorshift64*), so every run sees the same arrivals.
/// Poisson arrivals per proxy and phase: (microseconds from the start, proxy).
fn arrivals(seed: u64) -> Vec<(u64, usize)> {
    let mut rng = Rng(seed);
    let mut all = Vec::new();
    for (i, (rate, shares)) in PHASES.iter().enumerate() {
        let start = i as f64 * PHASE.as_secs_f64();
        for (proxy, share) in shares.iter().enumerate() {
            let mut t = start;
            loop {
                t += -(1.0 - rng.next_f64()).ln() / (rate * share);
                if t >= start + PHASE.as_secs_f64() {
                    break;
                }
                all.push(((t * 1e6) as u64, proxy));
            }
        }
    }
    all.sort();
    all
}

fn config(interval_ms: u64, token: &str) -> String {
    format!(
        r#"{{"service": {{"cluster": "sluice_service", "token": "{token}", "timeout_ms": 250,
             "sync_interval_ms": {interval_ms}}},
           "rules": [{{"name": "shared", "key": ["const:all"],
             "limits": [{{"requests": {RATE}, "per": "second", "burst": {BURST}}}],
             "fallback": {{"policy": "fail_open",
               "limits": [{{"requests": {}, "per": "second", "burst": {}}}]}}}}]}}"#,
        RATE / PROXIES as u64,
        BURST / PROXIES as u64
    )
}

struct Outcome {
    interval_ms: u64,
    requests: usize,
    exact: u64,
    admitted: u64,
    syncs: u64,
    per_phase: Vec<(u64, u64)>,
    /// Every arrival: (microseconds from the start, exact admitted, fleet admitted).
    series: Vec<(u64, bool, bool)>,
}

fn run(module: &FilterModule, service: &Service, interval_ms: u64, seed: u64) -> Result<Outcome> {
    let clock = VirtualClock::starting_at(SystemTime::now());
    let proxies: Vec<Proxy> = (0..PROXIES)
        .map(|i| {
            let options = ProxyOptions {
                workers: WORKERS,
                clock: clock.clone(),
                seed: seed * 100 + i as u64 + 1,
                ..ProxyOptions::new(config(interval_ms, service.token()))
            };
            Proxy::new(module, options).map_err(|e| anyhow::anyhow!("proxy {i}: {e:?}"))
        })
        .collect::<Result<_>>()?;

    // Callouts go to the service on a few threads, so a slow answer never stalls arrivals.
    let mut bridge = Bridge::new(&service.url(), service.token(), 4, Duration::from_secs(2));

    let arrivals = arrivals(seed);
    let limit = Limit::new(RATE, Period::Second, Some(BURST)).map_err(anyhow::Error::msg)?;
    let start = Instant::now();
    let epoch_us = |at: SystemTime| {
        at.duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64)
    };
    let mut exact_bucket: Option<LimitState> = None;
    let (mut exact, mut admitted) = (0u64, 0u64);
    let mut per_phase = vec![(0u64, 0u64); PHASES.len()];
    let mut next_worker = [0usize; PROXIES];
    let mut series = Vec::with_capacity(arrivals.len());

    let set_clock = || clock.set(SystemTime::now());
    for (at_us, proxy) in &arrivals {
        let due = start + Duration::from_micros(*at_us);
        while Instant::now() < due {
            bridge.pump(&proxies, &set_clock)?;
            let left = due.saturating_duration_since(Instant::now());
            thread::sleep(left.min(Duration::from_micros(500)));
        }
        bridge.pump(&proxies, &set_clock)?;
        // The exact limiter sees the same arrival at the time the filter saw it (when this
        // loop runs late on a busy machine, both see the same late time).
        let t = epoch_us(clock.now());
        let bucket = exact_bucket.unwrap_or_else(|| LimitState::full(&limit, t));
        let (verdict, next) = bucket.take(&limit, t, 1);
        exact_bucket = Some(next);
        let phase = (*at_us / PHASE.as_micros() as u64) as usize;
        if verdict.allowed {
            exact += 1;
            per_phase[phase].0 += 1;
        }
        let worker = next_worker[*proxy];
        next_worker[*proxy] = (worker + 1) % WORKERS;
        let p = &proxies[*proxy];
        let exchange = p
            .worker(worker)
            .request(RequestSpec::get("/").from("192.0.2.1:1000"))
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let state = exchange.state().map_err(|e| anyhow::anyhow!("{e}"))?;
        let continued = matches!(state, ExchangeState::Continued { .. });
        series.push((*at_us, verdict.allowed, continued));
        if continued {
            admitted += 1;
            per_phase[phase].1 += 1;
            let _ = exchange.respond(200, &[]);
        }
        let _ = exchange.finish();
        p.forget_finished();
    }
    bridge.finish();
    // The filter hands its requests' counters to the host on its ticks: one more second of ticks
    // (at most one tick period) and every admitted request is in them.
    clock.advance(Duration::from_secs(1));
    for p in &proxies {
        p.fire_due().map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    let syncs = proxies
        .iter()
        .map(|p| p.metric("sluice.sync.ok").unwrap_or(0))
        .sum();
    let failed: u64 = proxies
        .iter()
        .map(|p| p.metric("sluice.sync.failed").unwrap_or(0))
        .sum();
    let allowed_by_metrics: u64 = proxies
        .iter()
        .map(|p| p.metric("sluice.rule.shared.allowed").unwrap_or(0))
        .sum();
    eprintln!("  syncs failed: {failed}, allowed by metrics: {allowed_by_metrics}");
    Ok(Outcome {
        interval_ms,
        requests: arrivals.len(),
        exact,
        admitted,
        syncs,
        per_phase,
        series,
    })
}

/// Where every run's arrivals go, for `bench/plot_accuracy.py`: `interval_ms,at_us,exact,fleet`.
const SERIES_CSV: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../target/accuracy-series.csv");

fn main() -> Result<()> {
    let intervals: Vec<u64> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let intervals = if intervals.is_empty() {
        vec![50, 100, 250]
    } else {
        intervals
    };
    let module = FilterModule::load(filter_wasm_path()).map_err(|e| anyhow::anyhow!("{e}"))?;
    let redis = Redis::start()?;
    let service = Service::start(&redis.url())?;
    println!(
        "{PROXIES} proxies x {WORKERS} workers, limit {RATE}/s burst {BURST} (one key), fallback {}/s burst {} per proxy, {} phases of {} s",
        RATE / PROXIES as u64,
        BURST / PROXIES as u64,
        PHASES.len(),
        PHASE.as_secs()
    );
    println!();
    println!("| sync interval | requests | exact admits | sluice admits | error | overshoot | wrongly denied | syncs ok |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut csv = String::from("interval_ms,at_us,exact,fleet\n");
    for interval in &intervals {
        // A fresh key per run: the same arrivals, a cold start each time.
        redis.query(&["FLUSHALL"])?;
        let o = run(&module, &service, *interval, 7)?;
        let error = (o.admitted as f64 - o.exact as f64) / o.exact as f64 * 100.0;
        println!(
            "| {} ms | {} | {} | {} | {:+.2}% | {:.2}% | {:.2}% | {} |",
            o.interval_ms,
            o.requests,
            o.exact,
            o.admitted,
            error,
            error.max(0.0),
            (-error).max(0.0),
            o.syncs
        );
        eprintln!("  per phase (exact, sluice): {:?}", o.per_phase);
        for (at_us, exact, fleet) in &o.series {
            csv.push_str(&format!(
                "{},{at_us},{},{}\n",
                o.interval_ms, *exact as u8, *fleet as u8
            ));
        }
    }
    std::fs::write(SERIES_CSV, csv)?;
    eprintln!("  arrivals of every run in {SERIES_CSV}");
    Ok(())
}
