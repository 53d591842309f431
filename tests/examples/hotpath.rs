//! What one request costs inside the filter, counted instead of timed: the wasm instructions
//! the VM runs (wasmtime's fuel, about one per instruction) and the host calls it makes, per
//! request, on the open path (every request admitted) and the deny path (almost every request
//! denied), for sluice and for the floor (the cheapest filter giving sluice's answers:
//! host/guests/floor). The same configurations as `bench/bench.py`: one rule keyed by client
//! address, legacy X-RateLimit-* headers, 2 workers, one client.
//!
//! The virtual clock moves a millisecond between requests and the workers' ticks fire on the way
//! as Envoy would fire them (sluice's is 1 s here): what a tick does, such as handing the
//! requests' counters to the host, is in the figures per request too.
//!
//! The same build gives the same counts on any machine: these are the figures to compare
//! before and after a change to the hot path. `floor-open-calls` and `floor-deny-calls` are the
//! floor making sluice's host calls and nothing else (`bench.py` runs them in Envoy to tell host
//! calls from wasm work); the example fails if `floor-open-calls` no longer makes exactly the host
//! calls `sluice-open` makes.
//!
//! `cargo run --release -p sluice-tests --features wasm --example hotpath [variant ...]` (after
//! `make build`; `make bench-hotpath` does both). Prints a markdown table.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{anyhow, Result};
use sluice_host::{
    filter_wasm_path, workspace_root, ExchangeState, FilterModule, Proxy, ProxyOptions, RequestSpec,
};

const REQUESTS: u64 = 2_000;
const WORKERS: usize = 2;
/// Nothing is ever denied at this rate: what is counted is the open path.
const OPEN_LIMIT: u64 = 1_000_000_000;
/// Almost every request of the run is denied.
const DENY_LIMIT: u64 = 100;

fn floor_wasm_path() -> PathBuf {
    match std::env::var_os("SLUICE_FLOOR_WASM") {
        Some(path) if !path.is_empty() => PathBuf::from(path),
        _ => workspace_root().join("target/wasm32-wasip1/release/sluice_floor.wasm"),
    }
}

fn sluice_config(requests_per_second: u64, algorithm: Option<&str>) -> String {
    let mut limit = serde_json::json!({
        "requests": requests_per_second, "per": "second", "burst": requests_per_second,
    });
    if let Some(algorithm) = algorithm {
        limit = match algorithm {
            "fixed_window" | "sliding_window" => serde_json::json!({
                "requests": requests_per_second.min(400_000), "per": "second",
                "algorithm": algorithm,
            }),
            "sliding_log" => serde_json::json!({
                "requests": requests_per_second.min(1_000), "per": "second",
                "algorithm": algorithm,
            }),
            _ => {
                limit["algorithm"] = algorithm.into();
                limit
            }
        };
    }
    serde_json::json!({
        "headers": "legacy",
        "rules": [{
            "name": "bench", "match": {"path_prefix": "/api/"}, "key": ["client_ip"],
            "limits": [limit], "mode": "enforce",
        }],
    })
    .to_string()
}

/// `config` with its rule counting its top keys.
fn with_top(config: String) -> String {
    let mut json: serde_json::Value = serde_json::from_str(&config).unwrap_or_default();
    json["rules"][0]["top_keys"] = 16.into();
    json.to_string()
}

struct Counted {
    instructions: f64,
    host_calls: f64,
    calls: BTreeMap<&'static str, u64>,
    admitted: u64,
}

/// Runs `REQUESTS` requests (after a warm-up) and counts what they cost.
fn count(module: &FilterModule, config: &str) -> Result<Counted> {
    let options = ProxyOptions {
        workers: WORKERS,
        ..ProxyOptions::new(config)
    };
    let proxy = Proxy::new(module, options).map_err(|e| anyhow!("{e:?}"))?;
    let send = |i: u64| -> Result<bool> {
        let spec = RequestSpec::get("/api/items").from("10.1.2.3:40000");
        let exchange = proxy.worker((i % WORKERS as u64) as usize).request(spec)?;
        let admitted = match exchange.state()? {
            ExchangeState::Continued { .. } => {
                exchange.respond(200, &[("content-length", "0")])?;
                true
            }
            ExchangeState::LocalResponse { .. } => false,
            other => return Err(anyhow!("unexpected state {other:?}")),
        };
        exchange.finish()?;
        proxy.forget_finished();
        Ok(admitted)
    };
    // Warm-up: the first requests of a key create its record; a denied run reaches its steady
    // state once the burst is spent.
    for i in 0..(DENY_LIMIT + 50) {
        send(i)?;
    }
    proxy.reset_host_calls();
    let mut admitted = 0;
    for i in 0..REQUESTS {
        admitted += u64::from(send(i)?);
        // A millisecond between requests: 1,000 a second, ten times the deny limit.
        proxy.advance(std::time::Duration::from_millis(1))?;
    }
    let calls = proxy.host_calls();
    Ok(Counted {
        instructions: proxy.instructions() as f64 / REQUESTS as f64,
        host_calls: proxy.host_call_total() as f64 / REQUESTS as f64,
        calls,
        admitted,
    })
}

fn main() -> Result<()> {
    let sluice = FilterModule::load_metered(filter_wasm_path())?;
    let floor = FilterModule::load_metered(floor_wasm_path())?;
    let variants: Vec<(&str, &FilterModule, String)> = vec![
        ("floor-open", &floor, "open".into()),
        ("sluice-open", &sluice, sluice_config(OPEN_LIMIT, None)),
        ("floor-deny", &floor, "deny".into()),
        ("sluice-deny", &sluice, sluice_config(DENY_LIMIT, None)),
        // The floor making sluice's host calls and nothing else (host/guests/floor).
        ("floor-open-calls", &floor, "open+calls".into()),
        ("floor-deny-calls", &floor, "deny+calls".into()),
        (
            "sluice-open-gcra",
            &sluice,
            sluice_config(OPEN_LIMIT, Some("gcra")),
        ),
        (
            "sluice-deny-gcra",
            &sluice,
            sluice_config(DENY_LIMIT, Some("gcra")),
        ),
        (
            "sluice-open-fixed",
            &sluice,
            sluice_config(OPEN_LIMIT, Some("fixed_window")),
        ),
        (
            "sluice-deny-fixed",
            &sluice,
            sluice_config(DENY_LIMIT, Some("fixed_window")),
        ),
        (
            "sluice-open-sliding",
            &sluice,
            sluice_config(OPEN_LIMIT, Some("sliding_window")),
        ),
        (
            "sluice-deny-sliding",
            &sluice,
            sluice_config(DENY_LIMIT, Some("sliding_window")),
        ),
        (
            "sluice-deny-log",
            &sluice,
            sluice_config(DENY_LIMIT, Some("sliding_log")),
        ),
        // The rule counting its top keys (`top_keys`, 16 counters per kind).
        (
            "sluice-open-top",
            &sluice,
            with_top(sluice_config(OPEN_LIMIT, None)),
        ),
        (
            "sluice-deny-top",
            &sluice,
            with_top(sluice_config(DENY_LIMIT, None)),
        ),
    ];
    // Variants named on the command line, or all.
    let only: Vec<String> = std::env::args().skip(1).collect();
    let variants: Vec<_> = variants
        .into_iter()
        .filter(|(name, ..)| only.is_empty() || only.iter().any(|o| o == name))
        .collect();
    println!(
        "{REQUESTS} requests per variant after a warm-up, one client, {WORKERS} workers, \
         one every virtual millisecond\n"
    );
    println!("| variant | admitted | wasm instructions / request | host calls / request | host calls by name |");
    println!("| --- | ---: | ---: | ---: | --- |");
    // Each variant's host calls per request by name, to 1/10: what the floor's `open+calls` must match.
    let mut per_request: BTreeMap<&str, Vec<(&'static str, u64)>> = BTreeMap::new();
    for (name, module, config) in &variants {
        let counted = count(module, config)?;
        per_request.insert(
            name,
            counted
                .calls
                .iter()
                .map(|(call, n)| (*call, (*n * 10 + REQUESTS / 2) / REQUESTS))
                .filter(|(_, tenths)| *tenths > 0)
                .collect(),
        );
        let by_name = counted
            .calls
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(call, n)| {
                format!(
                    "{} {:.2}",
                    call.trim_start_matches("proxy_"),
                    *n as f64 / REQUESTS as f64
                )
            })
            .collect::<Vec<_>>()
            .join(", ");
        println!(
            "| {name} | {} | {:.0} | {:.2} | {by_name} |",
            counted.admitted, counted.instructions, counted.host_calls
        );
    }
    // The decomposition in Envoy holds only while the floor makes the host calls sluice makes.
    if let (Some(floor), Some(sluice)) = (
        per_request.get("floor-open-calls"),
        per_request.get("sluice-open"),
    ) {
        if floor != sluice {
            return Err(anyhow!(
                "the floor's open+calls no longer makes sluice's open-path host calls: \
                 floor {floor:?}, sluice {sluice:?} (tenths per request)"
            ));
        }
    }
    Ok(())
}
