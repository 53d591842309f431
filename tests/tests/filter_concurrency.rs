//! Per-key concurrency in the wasmtime host, on a virtual clock: a key's requests in flight
//! bounded across workers, the slot given back however the stream ends (a response, a client
//! reset, the host's 504 for an upstream timeout, a local reply by another rule), and a slot
//! whose end is never seen lapsing after `max_hold`.

#[path = "support/hosts.rs"]
mod hosts;

use std::sync::OnceLock;
use std::time::Duration;

use sluice_host::{
    filter_wasm_path, Exchange, ExchangeState, FilterModule, Proxy, ProxyOptions, RequestSpec,
};

fn module() -> &'static FilterModule {
    static MODULE: OnceLock<FilterModule> = OnceLock::new();
    MODULE.get_or_init(|| {
        FilterModule::load(filter_wasm_path())
            .unwrap_or_else(|e| panic!("{e}: build the filter first (`make test` does)"))
    })
}

fn proxy(config: &str, workers: usize) -> Proxy {
    let options = ProxyOptions {
        workers,
        profile: hosts::profile(),
        ..ProxyOptions::new(hosts::config(config))
    };
    Proxy::new(module(), options).unwrap_or_else(|e| panic!("proxy did not start: {e:?}"))
}

fn send(proxy: &Proxy, worker: usize, user: &str) -> Exchange {
    let spec = RequestSpec::get("/api/x").header("x-user", user);
    proxy.worker(worker).request(spec).unwrap()
}

fn status(exchange: &Exchange) -> u32 {
    match exchange.state().unwrap() {
        ExchangeState::Continued { .. } => 200,
        ExchangeState::LocalResponse { status, .. } => status,
        other => panic!("unexpected state {other:?}"),
    }
}

const THREE: &str = r#"{"headers": "both", "rules": [{"name": "inflight", "key": ["header:x-user"],
  "limits": [{"concurrent": 3, "max_hold": "1m"}]}]}"#;

fn a_keys_requests_in_flight_are_bounded_across_workers() {
    let proxy = proxy(THREE, 3);
    let held: Vec<Exchange> = (0..3).map(|i| send(&proxy, i, "alice")).collect();
    assert!(held.iter().all(|e| status(e) == 200));
    for worker in 0..3 {
        let denied = send(&proxy, worker, "alice");
        let ExchangeState::LocalResponse {
            status, headers, ..
        } = denied.state().unwrap()
        else {
            panic!("worker {worker}: admitted a fourth");
        };
        assert_eq!(status, 429);
        let header = |name: &str| {
            headers
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        };
        assert_eq!(header("retry-after").as_deref(), Some("1"));
        assert_eq!(header("x-ratelimit-limit").as_deref(), Some("3"));
        assert_eq!(header("x-ratelimit-remaining").as_deref(), Some("0"));
        assert_eq!(
            header("ratelimit-policy").as_deref(),
            Some("\"inflight\";q=3;qu=\"concurrent-requests\"")
        );
    }
    // Another key is not held back.
    assert_eq!(status(&send(&proxy, 1, "bob")), 200);
    proxy.advance(Duration::from_secs(1)).unwrap();
    assert_eq!(proxy.metric("sluice.rule.inflight.denied"), Some(3));
    assert_eq!(proxy.metric("sluice.rule.inflight.allowed"), Some(4));
}

fn every_kind_of_end_gives_the_slot_back() {
    let proxy = proxy(THREE, 3);
    // A response, a client reset, the host's 504 for an upstream timeout, a 503 reset: each
    // frees its slot, on whichever worker it ran.
    for round in 0..4 {
        let held: Vec<Exchange> = (0..3).map(|i| send(&proxy, i, "alice")).collect();
        assert!(held.iter().all(|e| status(e) == 200), "round {round}");
        assert_eq!(status(&send(&proxy, round % 3, "alice")), 429);
        for e in &held {
            match round {
                0 => drop(e.respond(200, &[]).unwrap()),
                1 => e.finish().unwrap(),
                2 => drop(e.respond(504, &[]).unwrap()),
                _ => drop(e.respond(503, &[]).unwrap()),
            }
        }
    }
    // Many more, ended every way on every worker: nothing leaks, and never more than three.
    let mut open: Vec<Exchange> = Vec::new();
    let mut admitted = 0;
    for i in 0..300usize {
        let e = send(&proxy, i % 3, "alice");
        match status(&e) {
            200 => {
                admitted += 1;
                open.push(e);
            }
            429 => assert_eq!(open.len(), 3, "request {i}: denied while a slot was free"),
            other => panic!("{other}"),
        }
        assert!(open.len() <= 3, "request {i}: {} in flight", open.len());
        if i % 4 == 3 {
            let e = open.remove((i / 4) % open.len());
            match i % 3 {
                0 => drop(e.respond(200, &[])),
                1 => drop(e.finish()),
                _ => drop(e.respond(504, &[])),
            }
        }
    }
    assert!(admitted >= 75, "one end every four requests: {admitted}");
    for e in open {
        e.finish().unwrap();
    }
    let again: Vec<Exchange> = (0..3).map(|i| send(&proxy, i, "alice")).collect();
    assert!(
        again.iter().all(|e| status(e) == 200),
        "all three slots back"
    );
}

/// A request another rule answers locally gives its slot back with its reply.
fn a_local_reply_by_another_rule_gives_the_slot_back() {
    let proxy = proxy(
        r#"{"rules": [
          {"name": "inflight", "key": ["header:x-user"], "limits": [{"concurrent": 1}]},
          {"name": "hourly", "key": ["header:x-user"], "limits": [{"requests": 1, "per": "hour"}]}]}"#,
        2,
    );
    let first = send(&proxy, 0, "alice");
    assert_eq!(status(&first), 200);
    first.respond(200, &[]).unwrap();
    for i in 0..10 {
        let e = send(&proxy, i % 2, "alice");
        let ExchangeState::LocalResponse { body, .. } = e.state().unwrap() else {
            panic!("request {i} admitted");
        };
        let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            body["rule"], "hourly",
            "request {i}: the slot of a denied request was kept"
        );
    }
}

/// A stream whose end the filter never sees (its worker crashed) holds its slot until
/// `max_hold`, and no longer.
fn a_lost_release_lapses_after_max_hold() {
    let proxy = proxy(THREE, 2);
    let _lost: Vec<Exchange> = (0..3).map(|i| send(&proxy, i % 2, "alice")).collect();
    proxy.advance(Duration::from_secs(59)).unwrap();
    assert_eq!(status(&send(&proxy, 0, "alice")), 429);
    proxy.advance(Duration::from_secs(2)).unwrap();
    let back: Vec<Exchange> = (0..3).map(|i| send(&proxy, i % 2, "alice")).collect();
    assert!(back.iter().all(|e| status(e) == 200), "lapsed after 1m");
    assert_eq!(status(&send(&proxy, 1, "alice")), 429);
}

both_hosts!(
    a_keys_requests_in_flight_are_bounded_across_workers,
    every_kind_of_end_gives_the_slot_back,
    a_local_reply_by_another_rule_gives_the_slot_back,
    a_lost_release_lapses_after_max_hold,
);
