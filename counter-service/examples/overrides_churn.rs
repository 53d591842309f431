//! What a large set of live overrides costs the sync while operators change it: a real
//! `redis-server` on loopback, the service's own code in process (no HTTP), the set filled with
//! `--keys` key overrides, then for `--seconds` one change every `--change-ms` (a key blocked,
//! then lifted) while `--proxies` simulated proxies sync every `--interval-ms`, each from the
//! version it last took. Run twice: proxies that take deltas (as this version's filter), and proxies that
//! do not (as older filters, and as every proxy was answered before deltas: the whole set after
//! every change). Prints, per mode, the sync rounds done, the answers that carried the whole set
//! or a delta, their JSON bytes, and the time to build and serialize one answer that carried
//! overrides (median, max).
//!
//! `cargo run --release -p sluice-counter-service --example overrides_churn -- [--keys N]
//! [--key-bytes N] [--seconds N] [--change-ms N] [--proxies N] [--interval-ms N]` (needs `redis-server`;
//! `SLUICE_REDIS_SERVER` names it if it is not on the `PATH`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use sluice_counter_service::overrides::{self, Change, Note};
use sluice_counter_service::{AppState, Settings};
use sluice_protocol::KeyAction;
use sluice_tests::redis::Redis;

#[derive(Parser)]
struct Args {
    /// Key overrides in the set.
    #[arg(long, default_value_t = 8_000)]
    keys: usize,
    /// Bytes of each key.
    #[arg(long, default_value_t = 100)]
    key_bytes: usize,
    /// How long each mode churns.
    #[arg(long, default_value_t = 5)]
    seconds: u64,
    /// One admin change every this many milliseconds.
    #[arg(long, default_value_t = 20)]
    change_ms: u64,
    /// Proxies syncing.
    #[arg(long, default_value_t = 4)]
    proxies: usize,
    /// Each proxy's sync interval (the next sync starts this long after an answer).
    #[arg(long, default_value_t = 10)]
    interval_ms: u64,
}

fn block(key: String) -> Change {
    Change::SetKey {
        rule: "api".into(),
        key: vec![key],
        action: KeyAction::Block,
        note: Note::default(),
    }
}

/// What one mode measured.
#[derive(Default)]
struct Run {
    rounds: u64,
    whole: u64,
    deltas: u64,
    whole_bytes: u64,
    delta_bytes: u64,
    /// Microseconds to answer and serialize one sync's overrides.
    build_us: Vec<u64>,
}

async fn churn(state: &AppState, args: &Args, delta: bool) -> Run {
    let stop = Arc::new(AtomicBool::new(false));
    let changer = {
        let (state, stop) = (state.clone(), stop.clone());
        let every = Duration::from_millis(args.change_ms);
        tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let key = format!("churn-{}", n % 2);
                let change = if n % 4 < 2 {
                    block(key)
                } else {
                    Change::DeleteKey {
                        rule: "api".into(),
                        key: vec![key],
                    }
                };
                let _ = overrides::write(&state, "bench", &change, 0).await;
                n += 1;
                tokio::time::sleep(every).await;
            }
        })
    };
    let proxies: Vec<_> = (0..args.proxies)
        .map(|_| {
            let (state, stop) = (state.clone(), stop.clone());
            let interval = Duration::from_millis(args.interval_ms);
            tokio::spawn(async move {
                let mut run = Run::default();
                let mut version = 0;
                while !stop.load(Ordering::Relaxed) {
                    let started = Instant::now();
                    let answer = overrides::for_sync(&state, version, delta, 0).await;
                    let bytes = serde_json::to_vec(&answer).map_or(0, |json| json.len() as u64);
                    let took_us = started.elapsed().as_micros() as u64;
                    run.rounds += 1;
                    if answer.live.is_some() || answer.delta.is_some() {
                        run.build_us.push(took_us);
                    }
                    if let Some(live) = &answer.live {
                        version = live.version;
                        run.whole += 1;
                        run.whole_bytes += bytes;
                    } else if let Some(changes) = &answer.delta {
                        version = changes.version;
                        run.deltas += 1;
                        run.delta_bytes += bytes;
                    }
                    tokio::time::sleep(interval).await;
                }
                run
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(args.seconds)).await;
    stop.store(true, Ordering::Relaxed);
    let _ = changer.await;
    let mut total = Run::default();
    for proxy in proxies {
        if let Ok(run) = proxy.await {
            total.rounds += run.rounds;
            total.whole += run.whole;
            total.deltas += run.deltas;
            total.whole_bytes += run.whole_bytes;
            total.delta_bytes += run.delta_bytes;
            total.build_us.extend(run.build_us);
        }
    }
    total
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let redis = Redis::start()?;
    let settings = Settings::parse_from([
        "sluice-counter-service",
        "--insecure-no-auth",
        "--redis-url",
        &redis.url(),
        "--redis-timeout-ms",
        "5000",
        "--overrides-max-bytes",
        "4194304",
    ]);
    let state = AppState::new(settings)?;
    let filler = "x".repeat(args.key_bytes.saturating_sub(10));
    for i in 0..args.keys {
        overrides::write(&state, "bench", &block(format!("{i:08}-{filler}")), 0).await?;
    }
    let whole = overrides::for_sync(&state, 0, false, 0).await;
    let set_bytes = serde_json::to_vec(&whole)?.len();
    println!(
        "{} key overrides of {} bytes: the whole set is {set_bytes} bytes of JSON; {} s of one change every {} ms, {} proxies syncing every {} ms",
        args.keys, args.key_bytes, args.seconds, args.change_ms, args.proxies, args.interval_ms
    );
    println!(
        "| proxies | sync rounds | whole sets | bytes | deltas | bytes | build µs, median | max |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for (name, delta) in [("whole set (before)", false), ("deltas", true)] {
        let mut run = churn(&state, &args, delta).await;
        run.build_us.sort_unstable();
        let median = run
            .build_us
            .get(run.build_us.len() / 2)
            .copied()
            .unwrap_or(0);
        let max = run.build_us.last().copied().unwrap_or(0);
        println!(
            "| {name} | {} | {} | {} | {} | {} | {median} | {max} |",
            run.rounds, run.whole, run.whole_bytes, run.deltas, run.delta_bytes
        );
    }
    Ok(())
}
