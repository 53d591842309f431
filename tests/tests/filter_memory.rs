//! A worker's memory under a long, varied load: after a warm-up, tens of thousands more requests
//! (keys and paths of every size, up to 48 in flight, admitted and denied, keys evicted) must not
//! grow the VM's linear memory. The filter recycles its small blocks through per-size free lists
//! (filter/src/alloc.rs): a list that kept a block it should have reused, or a request that left
//! anything behind, grows the memory with the traffic. A wasm memory grows by 64 KiB pages, so
//! over 40,000 requests anything left behind of 2 bytes a request or more fails the test (a build
//! whose lists never give a block back grew by 176 MiB here). The warm-up fills what is bounded
//! by design: the worker's notes of denied keys (at most 4,096) and the lists' peak (the memory
//! reaches its plateau near request 27,000).
//!
//! It runs under both hosts. Under nginx the warm-up is the same, then 10,000 requests, not
//! 40,000 (anything of 7 bytes a request or more fails): the filter's allocations do not depend on
//! the host, only the headers and properties it reads do, and the full length twice would cost
//! the suite twice its time.

#[path = "support/hosts.rs"]
mod hosts;

use std::collections::VecDeque;
use std::sync::OnceLock;

use sluice_host::{
    filter_wasm_path, ExchangeState, FilterModule, HostProfile, Proxy, ProxyOptions, RequestSpec,
};

/// Requests of the warm-up, and requests measured after it, under each host.
fn lengths() -> (usize, usize) {
    match hosts::profile() {
        HostProfile::Envoy => (30_000, 40_000),
        HostProfile::NgxWasmModule => (30_000, 10_000),
    }
}

fn module() -> &'static FilterModule {
    static MODULE: OnceLock<FilterModule> = OnceLock::new();
    MODULE.get_or_init(|| {
        FilterModule::load(filter_wasm_path())
            .unwrap_or_else(|e| panic!("{e}: build the filter first (`make test` does)"))
    })
}

/// Per user (a header), five a minute; 1,024 keys per worker, fewer than the users, so keys are
/// evicted and come back; every response gets the rate-limit headers, every denial a 429 body.
const CONFIG: &str = r#"{"headers": "both", "max_keys": 1024,
  "rules": [{"name": "per-user", "match": {"path_prefix": "/api/"}, "key": ["header:x-user"],
             "limits": [{"requests": 5, "per": "minute", "burst": 5}]}]}"#;

/// xorshift64*: the same requests on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A request: one of 3,000 users (names of 1 to 300 bytes, longer than a key may be), a path of
/// up to 1,500 bytes (beyond the recycled sizes) and sometimes a query.
fn request(rng: &mut Rng) -> RequestSpec {
    let user = rng.below(3_000);
    let user_len = 1 + (user * 7919 % 300) as usize;
    // Built a string at a time, not a char at a time: the test's own debug build was an eighth
    // of the run.
    let hex = format!("{user:x}");
    let mut name = hex.repeat(user_len.div_ceil(hex.len()));
    name.truncate(user_len);
    let mut path = String::from("/api/");
    path.push_str(&"p".repeat(rng.below(1_500) as usize));
    if rng.below(4) == 0 {
        path.push('?');
        path.push_str(&"q".repeat(rng.below(600) as usize));
    }
    RequestSpec::get(&path)
        .header("x-user", &name)
        .from("192.0.2.7:40000")
}

/// Plays `count` requests on worker 0, up to `depth` in flight (it changes every 1,000
/// requests). Returns (admitted, denied).
fn play(proxy: &Proxy, rng: &mut Rng, count: usize) -> (u64, u64) {
    let (mut admitted, mut denied) = (0, 0);
    let mut in_flight = VecDeque::new();
    let mut depth = 1;
    for i in 0..count {
        if i % 1_000 == 0 {
            depth = 1 + rng.below(48) as usize;
        }
        let exchange = proxy.worker(0).request(request(rng)).unwrap();
        match exchange.state().unwrap() {
            // Held until `depth` others are in flight behind it.
            ExchangeState::Continued { .. } => {
                admitted += 1;
                in_flight.push_back(exchange);
            }
            // A local reply ends the stream at once.
            ExchangeState::LocalResponse { status, .. } => {
                assert_eq!(status, 429);
                denied += 1;
            }
            other => panic!("unexpected state {other:?}"),
        }
        while in_flight.len() > depth {
            if let Some(exchange) = in_flight.pop_front() {
                exchange.respond(200, &[("content-length", "0")]).unwrap();
                exchange.finish().unwrap();
            }
        }
        proxy.forget_finished();
    }
    for exchange in in_flight {
        exchange.finish().unwrap();
    }
    proxy.forget_finished();
    (admitted, denied)
}

fn memory_stops_growing_after_a_warm_up() {
    let options = ProxyOptions {
        workers: 1,
        profile: hosts::profile(),
        ..ProxyOptions::new(hosts::config(CONFIG))
    };
    let proxy = Proxy::new(module(), options).unwrap();
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    let (warm_up, measured) = lengths();
    let started = proxy.memory_bytes(0).unwrap();
    let warm = play(&proxy, &mut rng, warm_up);
    let warmed = proxy.memory_bytes(0).unwrap();
    let after = play(&proxy, &mut rng, measured);
    let ended = proxy.memory_bytes(0).unwrap();
    eprintln!(
        "linear memory: {started} bytes at start, {warmed} after {warm_up} requests {warm:?} \
         (admitted, denied), {ended} after {measured} more {after:?}"
    );
    assert!(proxy.is_alive(0));
    // Both kinds of request ran, at every depth, long enough to show a leak of a few bytes a request.
    assert!(after.0 > 1_000 && after.1 > 1_000, "{after:?}");
    assert!(
        ended <= warmed + 64 * 1024,
        "the worker's memory grew from {warmed} to {ended} bytes over {measured} requests after the warm-up"
    );
}

both_hosts!(memory_stops_growing_after_a_warm_up);
