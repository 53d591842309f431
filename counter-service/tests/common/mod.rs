//! What the service's tests share: a state for a real Redis, one-shot HTTP calls on `app()`,
//! and the real server on a loopback port.

#![allow(dead_code)]

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::thread::JoinHandle;
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, Request, StatusCode};
use clap::Parser;
use http_body_util::BodyExt;
use serde_json::Value;
use sluice_counter_service::{app, server, AppState, Settings};
use sluice_protocol::{LimitSpec, SyncEntry, SyncRequest};
use tokio::sync::oneshot;
use tower::ServiceExt;

pub const TOKEN: &str = "test-token";

/// Settings for the Redis at `redis_url`, with more flags.
pub fn settings(redis_url: &str, more: &[&str]) -> Settings {
    let mut args = vec!["--token", TOKEN];
    args.extend_from_slice(more);
    settings_without_token(redis_url, &args)
}

/// Settings for the Redis at `redis_url` without `--token`: `more` gives the credentials.
pub fn settings_without_token(redis_url: &str, more: &[&str]) -> Settings {
    let mut args = vec![
        "sluice-counter-service",
        "--redis-url",
        redis_url,
        // generous: the test machine is small and shared
        "--redis-timeout-ms",
        "1000",
    ];
    args.extend_from_slice(more);
    Settings::parse_from(args)
}

pub fn state(redis_url: &str) -> AppState {
    AppState::new(settings(redis_url, &[])).unwrap()
}

/// A response: status, `Retry-After` if any, the body as JSON (or a string), every header.
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub retry_after: Option<String>,
    pub body: Value,
    pub headers: HeaderMap,
}

/// One request through the whole router, without a socket.
pub async fn call(
    state: &AppState,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Body,
) -> Answer {
    let authorization = token.map(|token| format!("Bearer {token}"));
    call_authorized(state, method, path, authorization.as_deref(), body).await
}

/// One request with this `Authorization` header value (or none), without a socket.
pub async fn call_authorized(
    state: &AppState,
    method: &str,
    path: &str,
    authorization: Option<&str>,
    body: Body,
) -> Answer {
    let mut request = Request::builder().method(method).uri(path);
    if let Some(value) = authorization {
        request = request.header("authorization", value);
    }
    let request = request
        .header("content-type", "application/json")
        .body(body)
        .unwrap();
    let response = app(state.clone()).oneshot(request).await.unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    let retry_after = response
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_owned());
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let body = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    Answer {
        status,
        retry_after,
        body,
        headers,
    }
}

pub async fn post(state: &AppState, path: &str, json: &Value) -> Answer {
    call(
        state,
        "POST",
        path,
        Some(TOKEN),
        Body::from(json.to_string()),
    )
    .await
}

pub async fn get(state: &AppState, path: &str) -> Answer {
    call(state, "GET", path, None, Body::empty()).await
}

pub const TEN_PER_SECOND: LimitSpec = LimitSpec::token_bucket(10, 1_000, 10);

pub fn entry(key: &str, limits: &[LimitSpec], spent: u64, denied: u64) -> SyncEntry {
    SyncEntry {
        key: key.into(),
        limits: limits.to_vec(),
        spent,
        denied,
        round: 0,
        penalty_ms: 0,
    }
}

pub fn batch(proxy: &str, interval_ms: u64, entries: Vec<SyncEntry>) -> SyncRequest {
    SyncRequest {
        proxy: proxy.into(),
        interval_ms,
        entries,
        load: None,
        overrides_version: 0,
        overrides_delta: false,
        fleet_share: false,
        top: Vec::new(),
    }
}

/// The real server (`server::serve`) on a free loopback port, in a runtime of its own.
pub struct Server {
    pub address: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<io::Result<()>>>,
}

impl Server {
    pub fn start(settings: Settings) -> Server {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let address = listener.local_addr().unwrap();
        let state = runtime.block_on(async { AppState::new(settings) }).unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            runtime.block_on(server::serve(listener, state, async {
                let _ = stopped.await;
            }))
        });
        Server {
            address,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// A new connection to the server.
    pub fn connect(&self) -> TcpStream {
        let stream = TcpStream::connect(self.address).unwrap();
        stream.set_nodelay(true).unwrap();
        stream
    }

    /// Asks the server to stop, and waits for it.
    pub fn stop(mut self) -> io::Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match self.thread.take() {
            Some(thread) => thread.join().unwrap(),
            None => Ok(()),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// A GET request for `path` that keeps the connection open.
pub fn get_request(path: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: sluice\r\n\r\n")
}

pub fn send(stream: &mut TcpStream, text: &str) {
    stream.write_all(text.as_bytes()).unwrap();
}

/// What the server sends within `within`: some bytes, `Ok(empty)` once it closed the
/// connection, or the error (`WouldBlock`/`TimedOut` when it sent nothing in time).
pub fn receive(stream: &mut TcpStream, within: Duration) -> io::Result<Vec<u8>> {
    stream.set_read_timeout(Some(within))?;
    let mut buffer = vec![0; 64 * 1024];
    let n = stream.read(&mut buffer)?;
    buffer.truncate(n);
    Ok(buffer)
}

/// Proxy `proxy`'s lease field on a token bucket's key, `l:<proxy>` (seven doubles packed, see
/// `lua/prelude.lua`'s lease_pack), as its numbers: grant, expiry (us), demand (tokens/s), last
/// sync (us), and its last round's epoch, counter and time written (us). `None` without one.
pub fn lease(redis: &sluice_tests::redis::Redis, key: &str, proxy: &str) -> Option<[f64; 7]> {
    const UNPACK: &str = "local v = redis.call('HGET', KEYS[1], ARGV[1]) \
        if not v then return false end \
        local n = {struct.unpack('<ddddddd', v)} \
        local out = {} \
        for i = 1, 7 do out[i] = string.format('%.17g', n[i]) end \
        return out";
    let field = format!("l:{proxy}");
    match redis.query(&["EVAL", UNPACK, "1", key, &field]).ok()? {
        sluice_tests::redis::Reply::Array(items) => {
            let numbers: Vec<f64> = items
                .iter()
                .filter_map(|item| item.text()?.parse().ok())
                .collect();
            numbers.try_into().ok()
        }
        _ => None,
    }
}

/// Rewrites proxy `proxy`'s lease on `key` as earlier versions of sync.lua kept it: as text in
/// p:q ("g x d s") with its round in r:q ("e c w", when it has one), or, `four_fields`, in four
/// fields g:q, x:q, d:q, s:q (the version before rounds).
pub fn to_earlier_layout(
    redis: &sluice_tests::redis::Redis,
    key: &str,
    proxy: &str,
    four_fields: bool,
) {
    let [g, x, d, s, e, c, w] = lease(redis, key, proxy).expect("a lease");
    redis.query(&["HDEL", key, &format!("l:{proxy}")]).unwrap();
    let text = |n: f64| format!("{n}");
    if four_fields {
        for (kind, value) in ["g", "x", "d", "s"].iter().zip([g, x, d, s]) {
            redis
                .query(&["HSET", key, &format!("{kind}:{proxy}"), &text(value)])
                .unwrap();
        }
        return;
    }
    let lease = [g, x, d, s].map(text).join(" ");
    redis
        .query(&["HSET", key, &format!("p:{proxy}"), &lease])
        .unwrap();
    if e != 0.0 || c != 0.0 {
        let round = [e, c, w].map(text).join(" ");
        redis
            .query(&["HSET", key, &format!("r:{proxy}"), &round])
            .unwrap();
    }
}

/// A file holding `text`, removed on drop (an admins file, a policy).
pub struct TextFile(std::path::PathBuf);

impl TextFile {
    pub fn new(text: &str) -> TextFile {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "sluice-{}-{}-service-test",
            std::process::id(),
            NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        std::fs::write(&path, text).unwrap();
        TextFile(path)
    }

    pub fn path(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for TextFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The shortest time a script lets a key live after writing it, on Redis's own clock: every
/// expiry is `expire_key`'s in `lua/prelude.lua` (or the log's in `lua/sliding_log.lua`), what
/// the state needs plus a second.
pub const SHORTEST_EXPIRY: std::time::Duration = std::time::Duration::from_secs(1);

/// Steps on the tests' clock against a real Redis, whose keys expire on Redis's own clock: a
/// key a step wrote lives at least [`SHORTEST_EXPIRY`] of real time, so a step that ends within
/// that of its segment's start (a segment's keys are its own) read nothing that expired early,
/// however far the tests' clock moved. A step that ends later on a busy machine is not judged,
/// and the caller starts a new segment (fresh keys, a fresh model) from the next step.
pub struct RedisClock {
    started: std::time::Instant,
    segment: u32,
    unjudged: usize,
}

impl RedisClock {
    pub fn new() -> RedisClock {
        RedisClock {
            started: std::time::Instant::now(),
            segment: 0,
            unjudged: 0,
        }
    }

    /// Whether the step just done can be judged; when it cannot, a new segment starts now.
    pub fn judged(&mut self) -> bool {
        if self.started.elapsed() < SHORTEST_EXPIRY {
            return true;
        }
        self.segment += 1;
        self.unjudged += 1;
        self.started = std::time::Instant::now();
        false
    }

    /// The segment's number, for its keys' names.
    pub fn segment(&self) -> u32 {
        self.segment
    }

    /// How many steps were not judged.
    pub fn unjudged(&self) -> usize {
        self.unjudged
    }
}

/// Runs `steps` (given the attempt, to name fresh keys) until one run took less than
/// [`SHORTEST_EXPIRY`] of real time, at most three times, and returns that run's answers: a
/// sequence checked against fixed answers means nothing once Redis may have expired a key in
/// its middle.
pub fn within_shortest_expiry<T>(mut steps: impl FnMut(u32) -> T) -> T {
    let mut attempt = 0;
    loop {
        let started = std::time::Instant::now();
        let answers = steps(attempt);
        let took = started.elapsed();
        if took < SHORTEST_EXPIRY || attempt == 2 {
            return answers;
        }
        eprintln!(
            "a run took {took:?} of real time (a key may have expired): again, on fresh keys"
        );
        attempt += 1;
    }
}

/// A long run on the tests' clock against a real Redis: a key written at the tests' time `v`
/// lives at least until `v` plus what the state needs, plus [`SHORTEST_EXPIRY`], of Redis's
/// real time. While the real time lags the tests' by less than that more than it ever did
/// (sampled at every call), no key the run still needs has expired; a run that falls behind
/// further (a busy machine's pause) is not judged, and the caller runs it again.
pub struct RedisPace {
    started: std::time::Instant,
    least_lag_us: i128,
}

impl RedisPace {
    pub fn new() -> RedisPace {
        RedisPace {
            started: std::time::Instant::now(),
            least_lag_us: i128::MAX,
        }
    }

    /// Whether the run, `virtual_us` into the tests' time, still keeps up.
    pub fn keeps_up(&mut self, virtual_us: u64) -> bool {
        let lag = self.started.elapsed().as_micros() as i128 - i128::from(virtual_us);
        self.least_lag_us = self.least_lag_us.min(lag);
        lag - self.least_lag_us < SHORTEST_EXPIRY.as_micros() as i128
    }
}
