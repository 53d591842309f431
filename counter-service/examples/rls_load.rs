//! Envoy's rate limit protocol beside a strict check, on one service and one Redis: the real
//! server loop (the HTTP API and `--grpc-bind`'s gRPC) on loopback, a real `redis-server`, and
//! for each protocol `--clients` concurrent callers, each sending its next call when the last is
//! answered (closed loop: the calls a second the service sustains, not an overload), for
//! `--seconds` a phase. `ShouldRateLimit` with one descriptor and `POST /v1/check` count the same
//! limit (a token bucket) on keys drawn from `--keys`, through the same script (`check.lua`).
//! The phases alternate, `--rounds` times each, so a busy machine slows both alike. Redis's time
//! per call is `INFO commandstats`'s `cmdstat_evalsha` over the phase.
//!
//! `cargo run --release -p sluice-counter-service --example rls_load -- [--clients N]
//! [--seconds N] [--rounds N] [--keys N]` (`make bench-rls`; needs `redis-server`).
//! Prints a markdown table.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use clap::Parser;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use sluice_counter_service::rls::{Config, RateLimiter};
use sluice_counter_service::{app, server, AppState, Settings};
use sluice_tests::redis::Redis;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

const TOKEN: &str = "bench-token";
const CONFIG: &str = "domain: bench
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 1000000, algorithm: token_bucket}
";

#[derive(Parser, Debug)]
struct Options {
    #[arg(long, default_value_t = 16)]
    clients: usize,
    #[arg(long, default_value_t = 4.0)]
    seconds: f64,
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    #[arg(long, default_value_t = 1000)]
    keys: u64,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Grpc,
    Check,
}

#[derive(Default)]
struct Phase {
    calls: u64,
    errors: u64,
    seconds: f64,
    latencies_us: Vec<u32>,
    redis_us: f64,
    redis_calls: f64,
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> Result<()> {
    let options = Options::parse();
    let redis = Redis::start()?;
    let settings = Settings::parse_from([
        "sluice-counter-service",
        "--redis-url",
        &redis.url(),
        "--token",
        TOKEN,
        "--max-connections",
        "1024",
    ]);
    let state = AppState::new(settings)?;
    let config = Arc::new(RwLock::new(Arc::new(Config::parse(CONFIG)?)));
    let http = TcpListener::bind("127.0.0.1:0").await?;
    let grpc = TcpListener::bind("127.0.0.1:0").await?;
    let (http_address, grpc_address) = (http.local_addr()?, grpc.local_addr()?);
    for (listener, router, protocol) in [
        (http, app(state.clone()), server::Protocol::Http1),
        (
            grpc,
            RateLimiter::new(state.clone(), config).router(),
            server::Protocol::Http2,
        ),
    ] {
        let (settings, metrics) = (state.settings.clone(), state.metrics.clone());
        tokio::spawn(async move {
            server::serve_router(
                listener,
                router,
                &settings,
                metrics,
                None,
                protocol,
                std::future::pending(),
            )
            .await
        });
    }
    let mut results: Vec<(Kind, Phase)> = Vec::new();
    for _ in 0..options.rounds {
        for kind in [Kind::Grpc, Kind::Check] {
            let before = evalsha(&redis)?;
            let mut phase = match kind {
                Kind::Grpc => grpc_phase(grpc_address, &options).await?,
                Kind::Check => check_phase(http_address, &options).await?,
            };
            let after = evalsha(&redis)?;
            phase.redis_calls = after.0 - before.0;
            phase.redis_us = after.1 - before.1;
            results.push((kind, phase));
        }
    }
    println!(
        "| protocol | calls/s (median of {}) | p50 | p99 | Redis µs per call | errors |",
        options.rounds
    );
    println!("|---|---|---|---|---|---|");
    for kind in [Kind::Grpc, Kind::Check] {
        let mut phases: Vec<&Phase> = results
            .iter()
            .filter(|(k, _)| *k == kind)
            .map(|(_, p)| p)
            .collect();
        phases.sort_by(|a, b| rate(a).total_cmp(&rate(b)));
        let median = phases[phases.len() / 2];
        let mut latencies: Vec<u32> = phases
            .iter()
            .flat_map(|p| p.latencies_us.iter().copied())
            .collect();
        latencies.sort_unstable();
        let quantile = |q: f64| {
            let at = ((latencies.len() as f64 - 1.0) * q).round() as usize;
            latencies.get(at).copied().unwrap_or(0) as f64 / 1000.0
        };
        let redis_calls: f64 = phases.iter().map(|p| p.redis_calls).sum();
        let redis_us: f64 = phases.iter().map(|p| p.redis_us).sum();
        let errors: u64 = phases.iter().map(|p| p.errors).sum();
        let name = match kind {
            Kind::Grpc => "`ShouldRateLimit`, one descriptor (gRPC)",
            Kind::Check => "`POST /v1/check`, one key (HTTP/1.1)",
        };
        println!(
            "| {name} | {:.0} | {:.2} ms | {:.2} ms | {:.1} | {errors} |",
            rate(median),
            quantile(0.5),
            quantile(0.99),
            redis_us / redis_calls.max(1.0),
        );
    }
    println!(
        "\n{} clients a protocol, {} phases of {} s each, alternating; {} keys.",
        options.clients, options.rounds, options.seconds, options.keys
    );
    Ok(())
}

fn rate(phase: &Phase) -> f64 {
    phase.calls as f64 / phase.seconds.max(1e-9)
}

/// `cmdstat_evalsha`'s calls and usec.
fn evalsha(redis: &Redis) -> Result<(f64, f64)> {
    let info = redis.text(&["INFO", "commandstats"])?;
    let line = info
        .lines()
        .find(|l| l.starts_with("cmdstat_evalsha:"))
        .unwrap_or("");
    let field = |name: &str| -> f64 {
        line.split([':', ','])
            .find_map(|kv| kv.strip_prefix(name))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    };
    Ok((field("calls="), field("usec=")))
}

/// Runs `clients` callers of `call` for the phase's time.
async fn phase<F, Fut>(options: &Options, call: F) -> Result<Phase>
where
    F: Fn(u64) -> Fut + Send + Sync + Clone + 'static,
    Fut: std::future::Future<Output = bool> + Send,
{
    let deadline = Instant::now() + Duration::from_secs_f64(options.seconds);
    let latencies = Arc::new(Mutex::new(Vec::new()));
    let (calls, errors) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for client in 0..options.clients as u64 {
        let (call, latencies) = (call.clone(), latencies.clone());
        let (calls, errors, keys) = (calls.clone(), errors.clone(), options.keys);
        tasks.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            let mut n = client;
            while Instant::now() < deadline {
                let sent = Instant::now();
                let ok = call(n % keys).await;
                mine.push(sent.elapsed().as_micros().min(u32::MAX as u128) as u32);
                calls.fetch_add(1, Ordering::Relaxed);
                if !ok {
                    errors.fetch_add(1, Ordering::Relaxed);
                }
                n = n
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407)
                    >> 1;
            }
            if let Ok(mut all) = latencies.lock() {
                all.extend(mine);
            }
        }));
    }
    for task in tasks {
        task.await?;
    }
    let seconds = started.elapsed().as_secs_f64();
    let latencies_us = std::mem::take(&mut *latencies.lock().map_err(|_| "poisoned")?);
    Ok(Phase {
        calls: calls.load(Ordering::Relaxed),
        errors: errors.load(Ordering::Relaxed),
        seconds,
        latencies_us,
        ..Phase::default()
    })
}

async fn grpc_phase(address: std::net::SocketAddr, options: &Options) -> Result<Phase> {
    let channel = tonic::transport::Channel::from_shared(format!("http://{address}"))?
        .connect()
        .await?;
    let client = RateLimitServiceClient::new(channel);
    phase(options, move |key| {
        let mut client = client.clone();
        async move {
            let mut request = tonic::Request::new(RateLimitRequest {
                domain: "bench".into(),
                descriptors: vec![RateLimitDescriptor {
                    entries: vec![Entry {
                        key: "user".into(),
                        value: format!("u{key}"),
                    }],
                    ..Default::default()
                }],
                hits_addend: 0,
            });
            let value = format!("Bearer {TOKEN}").parse().expect("a header value");
            request.metadata_mut().insert("authorization", value);
            client.should_rate_limit(request).await.is_ok()
        }
    })
    .await
}

async fn check_phase(address: std::net::SocketAddr, options: &Options) -> Result<Phase> {
    // One keep-alive connection per caller, handed out by the caller's first key.
    let connections: Arc<Vec<tokio::sync::Mutex<Option<TcpStream>>>> = Arc::new(
        (0..options.clients)
            .map(|_| tokio::sync::Mutex::new(None))
            .collect(),
    );
    let next = Arc::new(AtomicU64::new(0));
    let clients = options.clients as u64;
    phase(options, move |key| {
        let (connections, next) = (connections.clone(), next.clone());
        async move {
            let slot = (next.fetch_add(1, Ordering::Relaxed) % clients) as usize;
            let Some(cell) = connections.get(slot) else {
                return false;
            };
            let mut guard = cell.lock().await;
            if guard.is_none() {
                *guard = TcpStream::connect(address).await.ok();
            }
            let Some(stream) = guard.as_mut() else {
                return false;
            };
            let body = format!(
                r#"{{"key":"check\u001fu{key}","limits":[{{"requests":1000000,"period_ms":3600000,"burst":1000000}}]}}"#
            );
            let request = format!(
                "POST /v1/check HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            );
            let ok = exchange(stream, request.as_bytes()).await.unwrap_or(false);
            if !ok {
                *guard = None;
            }
            ok
        }
    })
    .await
}

/// Writes one request and reads its answer (headers, then a `Content-Length` body): whether it
/// was a 200.
async fn exchange(stream: &mut TcpStream, request: &[u8]) -> std::io::Result<bool> {
    stream.write_all(request).await?;
    let mut buffer = Vec::with_capacity(512);
    let mut chunk = [0u8; 1024];
    loop {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(false);
        }
        buffer.extend_from_slice(&chunk[..n]);
        let Some(end) = buffer.windows(4).position(|w| w == b"\r\n\r\n") else {
            continue;
        };
        let head = String::from_utf8_lossy(&buffer[..end]).to_ascii_lowercase();
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        while buffer.len() < end + 4 + length {
            let n = stream.read(&mut chunk).await?;
            if n == 0 {
                return Ok(false);
            }
            buffer.extend_from_slice(&chunk[..n]);
        }
        return Ok(head.starts_with("http/1.1 200"));
    }
}
