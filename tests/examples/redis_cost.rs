//! Redis's own CPU time per governed request: a fleet of proxies (the real filter in the
//! wasmtime host, two workers each) limits requests per API key through the real counter
//! service and a real Redis. The same arrivals (Poisson, keys drawn from a Zipf distribution
//! over 10,000 keys, and a uniform control) are played in real time once with a `cached` rule
//! and once with a `strict` one. Redis's CPU time (`INFO cpu`: `used_cpu_sys` +
//! `used_cpu_user`, the whole server) and its command time (`INFO commandstats`) are read
//! before and after each run, and divided by the requests the fleet admitted.
//!
//! `cargo run --release -p sluice-tests --features wasm,redis --example redis_cost -- [--rate N]
//! [--seconds N] [--limit N] [--proxies N] [--interval-ms N] [--keys N] [--exponent X]` (needs
//! the release filter and service builds and `redis-server`; `make bench-redis` does it all).
//! Prints markdown tables.

use std::thread;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{bail, Context, Result};
use sluice_host::{
    filter_wasm_path, Exchange, ExchangeState, FilterModule, Proxy, ProxyOptions, RequestSpec,
    VirtualClock,
};
use sluice_tests::redis::Redis;
use sluice_tests::service::Service;

#[path = "../tests/support/bridge.rs"]
mod bridge;
use bridge::{Bridge, Rng};

const WORKERS: usize = 2;
/// Threads forwarding the proxies' callouts to the service (strict checks wait on them).
const CALLERS: usize = 8;
/// How long a run may take beyond its arrivals, to settle strict checks and the last syncs.
const SETTLE: Duration = Duration::from_secs(3);

/// The knobs, with the defaults `make bench-redis` runs.
#[derive(Debug, Clone)]
struct Options {
    /// Arrivals per second, the whole fleet.
    rate: f64,
    seconds: f64,
    /// Requests per second per key (burst the same).
    limit: u64,
    proxies: usize,
    interval_ms: u64,
    keys: usize,
    exponent: f64,
    seed: u64,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            rate: 3_000.0,
            seconds: 10.0,
            limit: 10,
            proxies: 4,
            interval_ms: 100,
            keys: 10_000,
            exponent: 1.1,
            seed: 11,
        }
    }
}

fn options() -> Result<Options> {
    let mut o = Options::default();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        let value = args
            .get(i + 1)
            .with_context(|| format!("{} needs a value", args[i]))?;
        match args[i].as_str() {
            "--rate" => o.rate = value.parse()?,
            "--seconds" => o.seconds = value.parse()?,
            "--limit" => o.limit = value.parse()?,
            "--proxies" => o.proxies = value.parse()?,
            "--interval-ms" => o.interval_ms = value.parse()?,
            "--keys" => o.keys = value.parse()?,
            "--exponent" => o.exponent = value.parse()?,
            "--seed" => o.seed = value.parse()?,
            other => bail!("unknown option {other}"),
        }
        i += 2;
    }
    // Bounded in count and time: at most a minute and 200,000 arrivals a run.
    if !(o.rate > 0.0 && o.seconds > 0.0 && o.seconds <= 60.0 && o.rate * o.seconds <= 200_000.0) {
        bail!("--rate x --seconds must be at most 200,000 arrivals, --seconds at most 60");
    }
    if o.proxies == 0 || o.proxies > 16 || o.keys == 0 || o.limit == 0 {
        bail!("--proxies 1 to 16, --keys and --limit at least 1");
    }
    Ok(o)
}

/// A small deterministic generator (xorshift64*), so every run sees the same arrivals.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Keys {
    Zipf,
    Uniform,
}

impl Keys {
    fn name(self, o: &Options) -> String {
        match self {
            Keys::Zipf => format!("zipf {}", o.exponent),
            Keys::Uniform => "uniform".to_string(),
        }
    }
}

/// One arrival: microseconds from the start, the proxy, the key's rank (0 = most frequent).
type Arrival = (u64, usize, usize);

/// Poisson arrivals at `o.rate`, each at a proxy drawn uniformly and a key drawn from `keys`.
fn arrivals(o: &Options, keys: Keys) -> Vec<Arrival> {
    // The Zipf distribution's cumulative weights: rank k (from 1) weighs k^-exponent.
    let mut cumulative = Vec::with_capacity(o.keys);
    let mut total = 0.0;
    for k in 1..=o.keys {
        total += (k as f64).powf(-o.exponent);
        cumulative.push(total);
    }
    let mut rng = Rng(o.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let mut all = Vec::new();
    let mut t = 0.0;
    loop {
        t += -(1.0 - rng.next_f64()).ln() / o.rate;
        if t >= o.seconds {
            break;
        }
        let proxy = ((rng.next_f64() * o.proxies as f64) as usize).min(o.proxies - 1);
        let u = rng.next_f64();
        let rank = match keys {
            Keys::Zipf => cumulative.partition_point(|&c| c < u * total),
            Keys::Uniform => (u * o.keys as f64) as usize,
        }
        .min(o.keys - 1);
        all.push(((t * 1e6) as u64, proxy, rank));
    }
    all
}

/// Lower bounds on the sync entries any proxy-side batching could send for these arrivals:
/// the distinct (key, proxy) pairs (one report each, if a report could wait for the whole run),
/// and the fewest spans of one lease lifetime (three intervals) that cover every (key, proxy)'s
/// arrivals (a report cannot wait past its lease's lapse: a key a proxy sees again only after
/// that needs another entry).
fn floors(o: &Options, arrivals: &[Arrival]) -> (usize, usize) {
    let lifetime_us = 3 * o.interval_ms * 1_000;
    let mut seen: std::collections::HashMap<(usize, usize), Vec<u64>> = Default::default();
    for &(t, p, k) in arrivals {
        seen.entry((p, k)).or_default().push(t);
    }
    let mut spans = 0;
    for times in seen.values() {
        // arrivals are in time order; a span starts at the first arrival it does not cover
        let mut until = None;
        for &t in times {
            if until.is_none_or(|u| t >= u) {
                spans += 1;
                until = Some(t + lifetime_us);
            }
        }
    }
    (seen.len(), spans)
}

fn config(o: &Options, consistency: &str, token: &str) -> String {
    format!(
        r#"{{"service": {{"cluster": "sluice_service", "token": "{token}", "timeout_ms": 1000,
             "sync_interval_ms": {}}},
           "rules": [{{"name": "per-key", "key": ["header:x-api-key"], "consistency": "{consistency}",
             "limits": [{{"requests": {}, "per": "second", "burst": {}}}]}}]}}"#,
        o.interval_ms, o.limit, o.limit
    )
}

/// What Redis reports: CPU seconds of the server, and per command (name, calls, µs).
#[derive(Debug, Clone, Default)]
struct RedisStats {
    cpu_s: f64,
    commands: Vec<(String, u64, u64)>,
}

fn redis_stats(redis: &Redis) -> Result<RedisStats> {
    let cpu = redis.text(&["INFO", "cpu"])?;
    let field = |name: &str| -> f64 {
        cpu.lines()
            .find_map(|line| line.strip_prefix(&format!("{name}:")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0)
    };
    let cpu_s = field("used_cpu_sys") + field("used_cpu_user");
    let commandstats = redis.text(&["INFO", "commandstats"])?;
    let mut commands = Vec::new();
    for line in commandstats.lines() {
        let Some(rest) = line.strip_prefix("cmdstat_") else {
            continue;
        };
        let Some((name, values)) = rest.split_once(':') else {
            continue;
        };
        let value = |key: &str| -> u64 {
            values
                .split(',')
                .find_map(|kv| kv.strip_prefix(&format!("{key}=")))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        commands.push((name.to_string(), value("calls"), value("usec")));
    }
    Ok(RedisStats { cpu_s, commands })
}

/// A service counter from its `/metrics` (0 if absent).
fn service_counter(service: &Service, name: &str) -> u64 {
    service
        .get("/metrics")
        .ok()
        .and_then(|reply| {
            reply.body.lines().find_map(|line| {
                line.strip_prefix(name)
                    .filter(|rest| rest.starts_with(' '))
                    .and_then(|rest| rest.trim().parse::<f64>().ok())
            })
        })
        .map_or(0, |v| v as u64)
}

struct Outcome {
    keys: Keys,
    consistency: &'static str,
    requests: usize,
    admitted: u64,
    denied: u64,
    other: u64,
    redis_cpu_us: f64,
    command_us: u64,
    script_calls: u64,
    sync_entries: u64,
    failed: u64,
    seconds: f64,
}

/// Counts a request that is no longer waiting; false while it waits.
fn settle(exchange: &Exchange, counts: &mut (u64, u64, u64)) -> Result<bool> {
    match exchange.state().map_err(|e| anyhow::anyhow!("{e}"))? {
        ExchangeState::Paused => return Ok(false),
        ExchangeState::Continued { .. } => {
            counts.0 += 1;
            let _ = exchange.respond(200, &[]);
        }
        ExchangeState::LocalResponse { status: 429, .. } => counts.1 += 1,
        _ => counts.2 += 1,
    }
    let _ = exchange.finish();
    Ok(true)
}

fn run(
    module: &FilterModule,
    redis: &Redis,
    service: &Service,
    o: &Options,
    keys: Keys,
    consistency: &'static str,
    arrivals: &[Arrival],
) -> Result<Outcome> {
    redis.query(&["FLUSHALL"])?;
    let clock = VirtualClock::starting_at(SystemTime::now());
    let proxies: Vec<Proxy> = (0..o.proxies)
        .map(|i| {
            let options = ProxyOptions {
                workers: WORKERS,
                clock: clock.clone(),
                seed: o.seed * 100 + i as u64 + 1,
                ..ProxyOptions::new(config(o, consistency, service.token()))
            };
            Proxy::new(module, options).map_err(|e| anyhow::anyhow!("proxy {i}: {e:?}"))
        })
        .collect::<Result<_>>()?;
    let key_names: Vec<String> = (0..o.keys).map(|k| format!("key-{k}")).collect();

    let mut bridge = Bridge::new(
        &service.url(),
        service.token(),
        CALLERS,
        Duration::from_secs(2),
    );
    let set_clock = || clock.set(SystemTime::now());

    let entries_before = service_counter(service, "sluice_sync_entries_total");
    let before = redis_stats(redis)?;
    let start = Instant::now();
    let mut counts = (0u64, 0u64, 0u64);
    let mut waiting: Vec<Exchange> = Vec::new();
    let mut next_worker = vec![0usize; o.proxies];
    for &(at_us, proxy, rank) in arrivals {
        let due = start + Duration::from_micros(at_us);
        while Instant::now() < due {
            bridge.pump(&proxies, &set_clock)?;
            let left = due.saturating_duration_since(Instant::now());
            thread::sleep(left.min(Duration::from_micros(500)));
        }
        bridge.pump(&proxies, &set_clock)?;
        let worker = next_worker[proxy];
        next_worker[proxy] = (worker + 1) % WORKERS;
        let p = &proxies[proxy];
        let exchange = p
            .worker(worker)
            .request(
                RequestSpec::get("/api/x")
                    .header("x-api-key", &key_names[rank])
                    .from("192.0.2.1:1000"),
            )
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        if !settle(&exchange, &mut counts)? {
            waiting.push(exchange);
        }
        if !waiting.is_empty() {
            let mut still = Vec::with_capacity(waiting.len());
            for e in waiting.drain(..) {
                if !settle(&e, &mut counts)? {
                    still.push(e);
                }
            }
            waiting = still;
        }
        p.forget_finished();
    }
    // Strict checks still waiting are answered, and the last spend of a cached rule is
    // reported (its keys sync at the next round), within SETTLE.
    let end = Instant::now();
    let settle_until = end + SETTLE.min(Duration::from_millis(o.interval_ms * 5 + 500));
    while Instant::now() < settle_until {
        bridge.pump(&proxies, &set_clock)?;
        let mut still = Vec::with_capacity(waiting.len());
        for e in waiting.drain(..) {
            if !settle(&e, &mut counts)? {
                still.push(e);
            }
        }
        waiting = still;
        thread::sleep(Duration::from_millis(1));
    }
    for e in waiting.drain(..) {
        counts.2 += 1;
        let _ = e.finish();
    }
    bridge.finish();
    let after = redis_stats(redis)?;
    let seconds = end.duration_since(start).as_secs_f64();
    let entries_after = service_counter(service, "sluice_sync_entries_total");

    let calls = |stats: &RedisStats, names: &[&str]| -> (u64, u64) {
        stats
            .commands
            .iter()
            .filter(|(n, _, _)| names.contains(&n.as_str()))
            .fold((0, 0), |(c, u), (_, calls, usec)| (c + calls, u + usec))
    };
    let all: Vec<&str> = after.commands.iter().map(|(n, _, _)| n.as_str()).collect();
    let info = ["info"];
    let (_, command_after) = calls(&after, &all);
    let (_, command_before) = calls(&before, &all);
    let (_, info_after) = calls(&after, &info);
    let (_, info_before) = calls(&before, &info);
    let (scripts_after, _) = calls(&after, &["evalsha", "eval"]);
    let (scripts_before, _) = calls(&before, &["evalsha", "eval"]);
    let failed = proxies
        .iter()
        .map(|p| {
            p.metric("sluice.sync.failed").unwrap_or(0)
                + p.metric("sluice.check.failed").unwrap_or(0)
        })
        .sum();
    Ok(Outcome {
        keys,
        consistency,
        requests: arrivals.len(),
        admitted: counts.0,
        denied: counts.1,
        other: counts.2,
        redis_cpu_us: (after.cpu_s - before.cpu_s) * 1e6,
        // the benchmark's own INFO reads are not the fleet's
        command_us: (command_after - command_before)
            .saturating_sub(info_after.saturating_sub(info_before)),
        script_calls: scripts_after - scripts_before,
        sync_entries: entries_after.saturating_sub(entries_before),
        failed,
        seconds,
    })
}

fn main() -> Result<()> {
    let o = options()?;
    if std::env::var_os("SLUICE_SERVICE_BIN").is_none() {
        if let Some(path) = std::env::var_os("SLUICE_COUNTER_SERVICE").filter(|p| !p.is_empty()) {
            std::env::set_var("SLUICE_SERVICE_BIN", path);
        }
    }
    let module = FilterModule::load(filter_wasm_path()).map_err(|e| anyhow::anyhow!("{e}"))?;
    let redis = Redis::start()?;
    let service = Service::start(&redis.url())?;
    let version = redis.text(&["INFO", "server"])?;
    let version = version
        .lines()
        .find_map(|l| l.strip_prefix("redis_version:"))
        .unwrap_or("?")
        .trim()
        .to_string();
    println!(
        "{} proxies x {WORKERS} workers, one rule keyed by x-api-key, {}/s burst {} per key, sync every {} ms; \
         {} keys; Poisson arrivals, {}/s for {} s (the same arrivals for cached and strict); Redis {version}",
        o.proxies, o.limit, o.limit, o.interval_ms, o.keys, o.rate, o.seconds
    );
    println!();
    println!("| keys | rule | requests | admitted | denied | Redis CPU ms | Redis CPU µs / admitted | command µs / admitted | script calls | sync entries | entries / admitted | failed callouts |");
    println!("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    let mut outcomes = Vec::new();
    let mut bounds = Vec::new();
    for keys in [Keys::Zipf, Keys::Uniform] {
        let arrivals = arrivals(&o, keys);
        bounds.push((keys, floors(&o, &arrivals)));
        for consistency in ["cached", "strict"] {
            let r = run(&module, &redis, &service, &o, keys, consistency, &arrivals)?;
            let admitted = r.admitted.max(1) as f64;
            println!(
                "| {} | {} | {} | {} | {:.1}% | {:.1} | {:.2} | {:.2} | {} | {} | {:.3} | {} |",
                r.keys.name(&o),
                r.consistency,
                r.requests,
                r.admitted,
                r.denied as f64 * 100.0 / r.requests.max(1) as f64,
                r.redis_cpu_us / 1000.0,
                r.redis_cpu_us / admitted,
                r.command_us as f64 / admitted,
                r.script_calls,
                r.sync_entries,
                r.sync_entries as f64 / admitted,
                r.failed
            );
            eprintln!(
                "  {} {}: played in {:.1} s; {} requests neither admitted nor denied (429)",
                r.keys.name(&o),
                r.consistency,
                r.seconds,
                r.other
            );
            outcomes.push(r);
        }
    }
    println!();
    println!("| keys | Redis CPU per admitted request, cached / strict | command time, cached / strict |");
    println!("| --- | ---: | ---: |");
    for pair in outcomes.chunks(2) {
        let [cached, strict] = pair else { continue };
        let per = |r: &Outcome, v: f64| v / r.admitted.max(1) as f64;
        println!(
            "| {} | {:.3} | {:.3} |",
            cached.keys.name(&o),
            per(cached, cached.redis_cpu_us) / per(strict, strict.redis_cpu_us),
            per(cached, cached.command_us as f64) / per(strict, strict.command_us as f64)
        );
    }
    println!();
    println!("| keys | (key, proxy) pairs | per admitted (strict) | (key, proxy, {} ms lease lifetime) | per admitted (strict) |", 3 * o.interval_ms);
    println!("| --- | ---: | ---: | ---: | ---: |");
    for (keys, (pairs, triples)) in bounds {
        let admitted = outcomes
            .iter()
            .find(|r| r.keys == keys && r.consistency == "strict")
            .map_or(1, |r| r.admitted.max(1)) as f64;
        println!(
            "| {} | {} | {:.3} | {} | {:.3} |",
            keys.name(&o),
            pairs,
            pairs as f64 / admitted,
            triples,
            triples as f64 / admitted
        );
    }
    Ok(())
}
