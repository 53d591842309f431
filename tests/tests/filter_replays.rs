//! A sync applied by the counter service whose answer never reached the proxy (a replica killed
//! after its script ran, a timeout) is not counted twice: the filter in the wasmtime host keeps
//! the batch in doubt and resends it first, with the round labels it was first sent with, and
//! the real service on a real Redis counts it once. The test carries each callout to the service
//! itself and decides what the filter hears back. The control strips the labels from the resent
//! batch: the service then counts it twice, which is what happened before the labels. Both
//! scenarios run under both hosts, Envoy and nginx.
#![cfg(all(feature = "wasm", feature = "redis"))]

#[path = "support/hosts.rs"]
mod hosts;

use std::sync::OnceLock;
use std::time::Duration;

use sluice_core::protocol::SyncRequest;
use sluice_host::{
    filter_wasm_path, ExchangeState, FilterModule, HostProfile, HttpCall, Proxy, ProxyOptions,
    RequestSpec,
};
use sluice_tests::redis::Redis;
use sluice_tests::service::Service;

fn module() -> &'static FilterModule {
    static MODULE: OnceLock<FilterModule> = OnceLock::new();
    MODULE.get_or_init(|| FilterModule::load(filter_wasm_path()).expect("build the filter first"))
}

/// A cached daily window, large enough that every request is admitted: the service's count of
/// it must equal what the proxy admitted.
fn proxy(token: &str) -> Proxy {
    let config = format!(
        r#"{{"service": {{{service}, "token": "{token}", "timeout_ms": 100,
             "sync_interval_ms": 100, "breaker_failures": 3, "breaker_cooldown_ms": 1000}},
           "rules": [{{"name": "shared", "key": ["header:x-api-key"], "consistency": "cached",
                      "limits": [{{"requests": 100000, "per": "day", "algorithm": "fixed_window"}}],
                      "fallback": {{"policy": "fail_open"}}}}]}}"#,
        service = hosts::service()
    );
    let options = ProxyOptions {
        workers: 2,
        seed: 31,
        profile: hosts::profile(),
        ..ProxyOptions::new(hosts::config(&config))
    };
    Proxy::new(module(), options).unwrap_or_else(|e| panic!("proxy did not start: {e:?}"))
}

/// Sends `n` requests for `key` and returns how many were admitted.
fn admitted(proxy: &Proxy, n: usize, key: &str) -> u64 {
    let mut admitted = 0;
    for i in 0..n {
        let spec = RequestSpec::get("/").header("x-api-key", key);
        let exchange = proxy.worker(i % proxy.workers()).request(spec).unwrap();
        if let ExchangeState::Continued { .. } = exchange.state().unwrap() {
            exchange.respond(200, &[]).unwrap();
            exchange.finish().unwrap();
            admitted += 1;
        }
    }
    admitted
}

/// The one sync callout the proxy makes after another interval.
fn next_sync(proxy: &Proxy) -> (HttpCall, SyncRequest) {
    proxy.advance(Duration::from_millis(100)).unwrap();
    let mut calls: Vec<_> = proxy
        .pending_calls()
        .into_iter()
        .filter(|c| c.header(":path") == Some("/v1/sync"))
        .collect();
    assert_eq!(calls.len(), 1, "one round per interval");
    let call = calls.remove(0);
    let body = serde_json::from_slice(&call.body).expect("a sync body");
    (call, body)
}

/// Carries the batch to the real service; its answer (a 200, JSON).
fn forward(service: &Service, batch: &SyncRequest) -> String {
    let reply = service
        .post("/v1/sync", &serde_json::to_string(batch).unwrap())
        .unwrap();
    assert_eq!(reply.status, 200, "{}", reply.body);
    reply.body
}

/// How the answer of an applied batch is lost.
#[derive(Clone, Copy)]
enum Loss {
    /// The replica died: Envoy answers a 503, nginx reports the broken connection (no headers,
    /// a `:dispatch_status`).
    Died,
    /// The callout timed out: Envoy answers a 504 of its own, nginx reports `timeout` (no headers,
    /// a `:dispatch_status`).
    TimedOut,
}

/// Admits some, loses the answer of the batch that reported them after the service applied it,
/// admits more, then lets every answer through. `strip` removes the labels from the resent
/// batch. Returns (admitted, counted, entries the service took for replays).
fn lose_an_answer(loss: Loss, strip: bool) -> (u64, u64, u64) {
    let redis = Redis::start().unwrap();
    let service = Service::start(&redis.url()).unwrap();
    let proxy = proxy(service.token());
    let mut total = admitted(&proxy, 5, "alice");
    assert_eq!(total, 5);

    let (call, first) = next_sync(&proxy);
    assert_eq!(first.entries.len(), 1);
    assert_ne!(first.entries[0].round, 0, "labeled");
    forward(&service, &first);
    assert_eq!(redis.only_window_count(), 5, "applied");
    match (loss, hosts::profile()) {
        (Loss::Died, HostProfile::Envoy) => proxy.answer_call(call.token, 503, &[], b"").unwrap(),
        (Loss::Died, HostProfile::NgxWasmModule) => proxy.fail_call(call.token).unwrap(),
        (Loss::TimedOut, _) => proxy.timeout_call(call.token).unwrap(),
    }
    assert_eq!(proxy.metric("sluice.sync.failed"), Some(1));

    total += admitted(&proxy, 3, "alice");
    let (call, mut second) = next_sync(&proxy);
    assert_eq!(
        second.entries, first.entries,
        "the batch in doubt is resent as it was, and alice's newer counts wait"
    );
    if strip {
        second.entries.iter_mut().for_each(|e| e.round = 0);
    }
    let answer = forward(&service, &second);
    proxy
        .answer_call(call.token, 200, &[], answer.as_bytes())
        .unwrap();

    let (call, third) = next_sync(&proxy);
    assert_eq!(third.entries.len(), 1);
    assert_eq!(third.entries[0].spent, 3, "the counts that waited");
    assert!(third.entries[0].round > first.entries[0].round);
    let answer = forward(&service, &third);
    proxy
        .answer_call(call.token, 200, &[], answer.as_bytes())
        .unwrap();
    (
        total,
        redis.only_window_count(),
        service.metric("replayed_entries"),
    )
}

fn a_batch_applied_but_unanswered_is_resent_and_counted_once() {
    for loss in [Loss::Died, Loss::TimedOut] {
        let (admitted, counted, replayed) = lose_an_answer(loss, false);
        assert_eq!(
            counted, admitted,
            "every admitted request counted exactly once"
        );
        assert_eq!(replayed, 1, "the service recognized the replay");
    }
}

fn without_the_labels_the_replay_is_counted_twice() {
    let (admitted, counted, replayed) = lose_an_answer(Loss::Died, true);
    assert_eq!(admitted, 8);
    assert_eq!(counted, admitted + 5, "the lost batch's 5 counted twice");
    assert_eq!(replayed, 0);
}

both_hosts!(
    a_batch_applied_but_unanswered_is_resent_and_counted_once,
    without_the_labels_the_replay_is_counted_twice,
);
