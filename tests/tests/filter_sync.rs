//! Cached and strict consistency in the wasmtime host: one batched sync per proxy per interval,
//! grants as leases, the circuit breaker and fallbacks, strict checks. The test plays the
//! counter service by answering the filter's callouts.

#[path = "support/hosts.rs"]
mod hosts;

use std::sync::OnceLock;
use std::time::Duration;

use sluice_core::protocol::{CheckResponse, Hints, Lease, SyncRequest, SyncResponse};
use sluice_host::{
    filter_wasm_path, ExchangeState, FilterModule, HttpCall, Proxy, ProxyOptions, RequestSpec,
};

fn module() -> &'static FilterModule {
    static MODULE: OnceLock<FilterModule> = OnceLock::new();
    MODULE.get_or_init(|| FilterModule::load(filter_wasm_path()).expect("build the filter first"))
}

fn config(consistency: &str, fallback: &str) -> String {
    format!(
        r#"{{"service": {{{service}, "token": "s3cret", "timeout_ms": 100,
             "sync_interval_ms": 100, "breaker_failures": 2, "breaker_cooldown_ms": 1000}},
           "rules": [{{"name": "shared", "key": ["header:x-api-key"], "consistency": "{consistency}",
                      "limits": [{{"requests": 100, "per": "second"}}]{fallback}}}]}}"#,
        service = hosts::service()
    )
}

fn proxy(config: &str, workers: usize, seed: u64) -> Proxy {
    let options = ProxyOptions {
        workers,
        seed,
        profile: hosts::profile(),
        ..ProxyOptions::new(hosts::config(config))
    };
    Proxy::new(module(), options).unwrap_or_else(|e| panic!("proxy did not start: {e:?}"))
}

fn request(key: &str) -> RequestSpec {
    RequestSpec::get("/").header("x-api-key", key)
}

/// Status the client sees; a paused request is reported as 0.
fn status(proxy: &Proxy, worker: usize, spec: RequestSpec) -> u32 {
    let exchange = proxy.worker(worker).request(spec).unwrap();
    match exchange.state().unwrap() {
        ExchangeState::Continued { .. } => {
            exchange.respond(200, &[]).unwrap();
            exchange.finish().unwrap();
            200
        }
        ExchangeState::LocalResponse { status, .. } => status,
        ExchangeState::Paused => 0,
        ExchangeState::Reset => 1,
    }
}

fn admitted(proxy: &Proxy, n: usize, key: &str) -> usize {
    (0..n)
        .filter(|i| status(proxy, i % proxy.workers(), request(key)) == 200)
        .count()
}

fn sync_calls(proxy: &Proxy) -> Vec<(HttpCall, SyncRequest)> {
    proxy
        .pending_calls()
        .into_iter()
        .filter(|c| c.header(":path") == Some("/v1/sync"))
        .map(|c| {
            let body = serde_json::from_slice(&c.body).expect("a sync body");
            (c, body)
        })
        .collect()
}

fn grant_all(proxy: &Proxy, call: &HttpCall, request: &SyncRequest, tokens: u64) {
    grant_all_of(proxy, call, request, tokens, tokens, 0);
}

fn grant_all_of(
    proxy: &Proxy,
    call: &HttpCall,
    request: &SyncRequest,
    tokens: u64,
    remaining: u64,
    reset_ms: u64,
) {
    let grants = request
        .entries
        .iter()
        .map(|_| Lease {
            tokens,
            ttl_ms: 300,
            remaining,
            reset_ms,
            token_ms: None,
            refused: None,
            penalty_ms: 0,
        })
        .collect();
    answer_sync(proxy, call, grants);
}

/// Answers a sync callout with these grants, one per entry, and the usual 100 ms hint.
fn answer_sync(proxy: &Proxy, call: &HttpCall, grants: Vec<Lease>) {
    answer_sync_advising(proxy, call, grants, 100);
}

/// Answers a sync callout with these grants and the advice to sync every `next_sync_ms`.
fn answer_sync_advising(proxy: &Proxy, call: &HttpCall, grants: Vec<Lease>, next_sync_ms: u64) {
    let response = SyncResponse {
        grants,
        hints: Hints {
            next_sync_ms,
            ..Hints::default()
        },
    };
    let body = serde_json::to_vec(&response).unwrap();
    proxy
        .answer_call(
            call.token,
            200,
            &[("content-type", "application/json")],
            &body,
        )
        .unwrap();
}

fn one_batch_per_interval_whatever_the_worker_count() {
    let proxy = proxy(&config("cached", ""), 4, 1);
    for i in 0..8 {
        status(&proxy, i % 4, request("alice"));
        status(&proxy, i % 4, request("bob"));
    }
    proxy.advance(Duration::from_millis(100)).unwrap();
    let calls = sync_calls(&proxy);
    assert_eq!(calls.len(), 1, "one batch from four workers");
    let (call, batch) = &calls[0];
    // Envoy's cluster, or the address nginx dispatches to.
    let upstream = match hosts::profile() {
        sluice_host::HostProfile::Envoy => "sluice_service",
        sluice_host::HostProfile::NgxWasmModule => "127.0.0.1:8081",
    };
    assert_eq!(call.upstream, upstream);
    assert_eq!(call.header("authorization"), Some("Bearer s3cret"));
    assert_eq!(call.header(":method"), Some("POST"));
    assert_eq!(
        call.header(":scheme"),
        None,
        "plain HTTP unless service.tls"
    );
    assert_eq!(call.timeout, Some(Duration::from_millis(100)));
    let mut keys: Vec<_> = batch
        .entries
        .iter()
        .map(|e| (e.key.clone(), e.spent, e.denied))
        .collect();
    keys.sort();
    assert_eq!(
        keys,
        vec![
            ("shared\u{1f}alice".to_string(), 8, 0),
            ("shared\u{1f}bob".to_string(), 8, 0)
        ]
    );
    assert_eq!(batch.entries[0].limits[0].requests, 100);
    assert_eq!(batch.interval_ms, 100);
    assert!(batch.proxy.starts_with("p-"), "{}", batch.proxy);
    grant_all(&proxy, call, batch, 5);

    // Quiet interval: nothing new to report, one empty round still goes out (its answer carries
    // the bypass and the live overrides).
    proxy.advance(Duration::from_millis(100)).unwrap();
    let quiet = sync_calls(&proxy);
    assert_eq!(quiet.len(), 1, "one round per interval");
    let (_, batch) = &quiet[0];
    assert!(batch.entries.is_empty(), "{batch:?}");
}

fn a_grant_is_a_lease_spent_exactly_across_workers() {
    let proxy = proxy(&config("cached", ""), 3, 2);
    status(&proxy, 0, request("alice"));
    proxy.advance(Duration::from_millis(100)).unwrap();
    let calls = sync_calls(&proxy);
    let (call, batch) = &calls[0];
    grant_all(&proxy, call, batch, 7);
    assert_eq!(
        admitted(&proxy, 20, "alice"),
        7,
        "7 granted, spent on any worker"
    );

    // The next batch reports the spend and the unmet demand (and the workers' ticks on the way
    // hand their counters to the host).
    proxy.advance(Duration::from_millis(100)).unwrap();
    assert_eq!(proxy.metric("sluice.rule.shared.denied"), Some(13));
    let calls = sync_calls(&proxy);
    assert_eq!(calls.len(), 1);
    assert_eq!(
        (calls[0].1.entries[0].spent, calls[0].1.entries[0].denied),
        (7, 13)
    );
}

fn the_breaker_opens_falls_back_and_recovers() {
    let fallback =
        r#", "fallback": {"policy": "fail_open", "limits": [{"requests": 3, "per": "minute"}]}"#;
    let proxy = proxy(&config("cached", fallback), 2, 3);
    // Two failed syncs (a reset and a timeout) open the breaker.
    status(&proxy, 0, request("alice"));
    proxy.advance(Duration::from_millis(100)).unwrap();
    let (call, _) = sync_calls(&proxy).remove(0);
    proxy.fail_call(call.token).unwrap();
    assert!(
        proxy.is_alive(0) && proxy.is_alive(1),
        "a reset callout must not trap the VM"
    );
    status(&proxy, 1, request("alice"));
    proxy.advance(Duration::from_millis(100)).unwrap();
    assert_eq!(sync_calls(&proxy).len(), 1);
    proxy.advance(Duration::from_millis(150)).unwrap(); // the 100 ms callout timeout elapses
    assert_eq!(proxy.metric("sluice.sync.failed"), Some(2));
    assert_eq!(proxy.metric("sluice.sync.timeout"), Some(2));
    assert_eq!(proxy.metric("sluice.breaker.open"), Some(1));

    // Open: no callouts, requests decided by the fallback (3/minute, 2 spent already).
    proxy.advance(Duration::from_millis(300)).unwrap();
    assert!(
        sync_calls(&proxy).is_empty(),
        "an open breaker makes no calls"
    );
    assert_eq!(admitted(&proxy, 5, "alice"), 1);

    // After the cool-down (1 s, jittered by up to ±50%) one probe goes out; success closes it.
    let mut waited = Duration::ZERO;
    while sync_calls(&proxy).is_empty() && waited < Duration::from_millis(1_600) {
        proxy.advance(Duration::from_millis(25)).unwrap();
        waited += Duration::from_millis(25);
    }
    assert!(
        waited >= Duration::from_millis(150),
        "the probe waited for the cool-down: {waited:?}"
    );
    let calls = sync_calls(&proxy);
    assert_eq!(calls.len(), 1, "one probe");
    let (call, batch) = &calls[0];
    assert_eq!(
        (batch.entries.len(), batch.entries[0].spent),
        (1, 1),
        "the probe resends the first batch as it was (reset: it may have been applied); the key's \
         later spend waits for its answer"
    );
    grant_all(&proxy, call, batch, 50);
    proxy.advance(Duration::from_millis(25)).unwrap();
    assert_eq!(proxy.metric("sluice.breaker.open"), Some(0));
    assert_eq!(admitted(&proxy, 10, "alice"), 10, "grants again");
    proxy.advance(Duration::from_millis(100)).unwrap();
    let calls = sync_calls(&proxy);
    assert_eq!(
        calls[0].1.entries[0].spent,
        12,
        "then the spend held back (the second request and the fallback's) and the new one are reported"
    );
}

fn headers_from_a_lease_describe_the_global_bucket() {
    let proxy = proxy(&config("cached", ""), 1, 11);
    status(&proxy, 0, request("alice"));
    proxy.advance(Duration::from_millis(100)).unwrap();
    let (call, batch) = sync_calls(&proxy).remove(0);
    grant_all_of(&proxy, &call, &batch, 3, 40, 5_000);
    let exchange = proxy.worker(0).request(request("alice")).unwrap();
    let response = exchange.respond(200, &[]).unwrap();
    assert_eq!(
        response.header("ratelimit"),
        Some("\"shared\";r=39;t=5"),
        "40 left globally, 5 s to full"
    );
    assert_eq!(
        response.header("ratelimit-policy"),
        Some("\"shared\";q=100;w=1")
    );
    status(&proxy, 0, request("alice"));
    status(&proxy, 0, request("alice"));
    let denied = proxy.worker(0).request(request("alice")).unwrap();
    let state = denied.state().unwrap();
    assert_eq!(state.local_status(), Some(429), "the lease of 3 is spent");
    assert_eq!(state.header("ratelimit"), Some("\"shared\";r=0;t=5"));
    assert_eq!(state.header("retry-after"), Some("1"));
}

fn a_wrong_token_is_counted_and_logged() {
    let proxy = proxy(&config("cached", ""), 1, 4);
    status(&proxy, 0, request("alice"));
    proxy.advance(Duration::from_millis(100)).unwrap();
    let (call, _) = sync_calls(&proxy).remove(0);
    let body = br#"{"error":"unauthorized","message":"missing or wrong bearer token"}"#;
    proxy.answer_call(call.token, 401, &[], body).unwrap();
    assert_eq!(proxy.metric("sluice.sync.unauthorized"), Some(1));
    assert!(proxy
        .log_messages(sluice_host::LogLevel::Error)
        .iter()
        .any(|m| m.contains("refused our token")));
}

fn the_service_can_turn_on_the_emergency_bypass() {
    let proxy = proxy(&config("cached", ""), 2, 5);
    status(&proxy, 0, request("alice"));
    proxy.advance(Duration::from_millis(100)).unwrap();
    let (call, batch) = sync_calls(&proxy).remove(0);
    let mut response = SyncResponse {
        grants: vec![
            Lease {
                tokens: 0,
                ttl_ms: 300,
                remaining: 0,
                reset_ms: 0,
                token_ms: None,
                refused: None,
                penalty_ms: 0,
            };
            batch.entries.len()
        ],
        hints: Hints {
            next_sync_ms: 100,
            ..Hints::default()
        },
    };
    response.hints.overrides.bypass = true;
    proxy
        .answer_call(
            call.token,
            200,
            &[],
            &serde_json::to_vec(&response).unwrap(),
        )
        .unwrap();
    proxy.advance(Duration::from_millis(25)).unwrap(); // every worker ticks and learns it
    assert_eq!(
        admitted(&proxy, 10, "alice"),
        10,
        "a zero grant, but bypassed"
    );
    proxy.advance(Duration::from_millis(25)).unwrap(); // the counters go out on the ticks
    assert_eq!(proxy.metric("sluice.bypassed"), Some(10));
}

fn two_proxies_share_nothing_locally() {
    let a = proxy(&config("cached", ""), 1, 6);
    let b = proxy(&config("cached", ""), 1, 7);
    status(&a, 0, request("alice"));
    status(&b, 0, request("alice"));
    a.advance(Duration::from_millis(100)).unwrap();
    b.advance(Duration::from_millis(100)).unwrap();
    let (_, batch_a) = sync_calls(&a).remove(0);
    let (_, batch_b) = sync_calls(&b).remove(0);
    assert_ne!(
        batch_a.proxy, batch_b.proxy,
        "each proxy has its own identity"
    );
    assert_eq!(batch_a.entries[0].spent, 1);
    assert_eq!(batch_b.entries[0].spent, 1);
}

fn check_answer(proxy: &Proxy, allowed: bool) {
    let call = proxy
        .pending_calls()
        .into_iter()
        .find(|c| c.header(":path") == Some("/v1/check"))
        .expect("a strict check");
    let request: sluice_core::protocol::CheckRequest = serde_json::from_slice(&call.body).unwrap();
    assert_eq!(request.key, "shared\u{1f}alice");
    let response = CheckResponse {
        allowed,
        remaining: if allowed { 4 } else { 0 },
        retry_after_ms: if allowed { 0 } else { 2_500 },
        reset_ms: 9_000,
        lease: None,
    };
    proxy
        .answer_call(
            call.token,
            200,
            &[],
            &serde_json::to_vec(&response).unwrap(),
        )
        .unwrap();
}

fn strict_requests_wait_for_the_service() {
    let proxy = proxy(&config("strict", ""), 2, 8);
    let exchange = proxy.worker(1).request(request("alice")).unwrap();
    assert_eq!(exchange.state().unwrap(), ExchangeState::Paused);
    check_answer(&proxy, true);
    let state = exchange.state().unwrap();
    assert!(state.is_continued(), "{state:?}");
    let response = exchange.respond(200, &[]).unwrap();
    assert_eq!(response.header("ratelimit"), Some("\"shared\";r=4;t=9"));

    let exchange = proxy.worker(0).request(request("alice")).unwrap();
    check_answer(&proxy, false);
    let state = exchange.state().unwrap();
    assert_eq!(state.local_status(), Some(429));
    assert_eq!(state.header("retry-after"), Some("3"));
    proxy.advance(Duration::from_millis(25)).unwrap(); // the counters go out on the ticks
    assert_eq!(proxy.metric("sluice.rule.shared.denied"), Some(1));
}

fn a_strict_check_that_times_out_falls_back() {
    let fallback =
        r#", "fallback": {"policy": "fail_open", "limits": [{"requests": 1, "per": "minute"}]}"#;
    let proxy = proxy(&config("strict", fallback), 1, 9);
    let first = proxy.worker(0).request(request("alice")).unwrap();
    proxy.advance(Duration::from_millis(100)).unwrap();
    assert!(
        first.state().unwrap().is_continued(),
        "fallback admitted it"
    );
    let second = proxy.worker(0).request(request("alice")).unwrap();
    proxy.advance(Duration::from_millis(100)).unwrap();
    assert_eq!(
        second.state().unwrap().local_status(),
        Some(429),
        "fallback of 1/minute"
    );
    // Two timeouts opened the breaker: the next request does not wait at all.
    proxy.advance(Duration::from_millis(10)).unwrap();
    let third = proxy.worker(0).request(request("alice")).unwrap();
    assert_eq!(
        third.state().unwrap().local_status(),
        Some(429),
        "decided at once"
    );
    assert_eq!(proxy.metric("sluice.check.failed"), Some(2));
}

fn fail_closed_denies_without_the_service() {
    let fallback = r#", "fallback": {"policy": "fail_closed"}"#;
    let proxy = proxy(&config("strict", fallback), 1, 10);
    let first = proxy.worker(0).request(request("alice")).unwrap();
    let call = proxy.pending_calls().remove(0);
    proxy.fail_call(call.token).unwrap();
    // Not a rate limit: the limiter could not decide.
    assert_eq!(first.state().unwrap().local_status(), Some(503));
    // Counted as refused for it (`unavailable`), not as let through uncounted.
    proxy.advance(Duration::from_secs(1)).unwrap();
    assert_eq!(proxy.metric("sluice.rule.shared.unavailable"), Some(1));
    assert_eq!(proxy.metric("sluice.rule.shared.uncounted"), Some(0));
    assert_eq!(proxy.metric("sluice.rule.shared.denied"), Some(0));
}

/// One request with a 600-byte key must not be able to stop a proxy's sync: the key goes out
/// as a fixed-size digest, and an entry the service refuses alone is dropped, not sent again.
fn a_long_key_cannot_stop_the_sync() {
    let proxy = proxy(&config("cached", ""), 2, 11);
    let long = "k".repeat(600);
    status(&proxy, 0, request(&long));
    status(&proxy, 1, request("alice"));
    proxy.advance(Duration::from_millis(100)).unwrap();
    let (call, batch) = sync_calls(&proxy).remove(0);
    assert_eq!(batch.entries.len(), 2);
    for entry in &batch.entries {
        assert!(
            entry.key.len() <= sluice_core::limiter::key::MAX_KEY_BYTES,
            "a {}-byte key went out",
            entry.key.len()
        );
    }
    // The service refuses one entry alone (as it would a key it cannot take).
    let refused_at = batch
        .entries
        .iter()
        .position(|e| e.key.contains("sha256:"))
        .expect("the long key, as a digest");
    let grants = (0..batch.entries.len())
        .map(|i| Lease {
            tokens: if i == refused_at { 0 } else { 50 },
            ttl_ms: if i == refused_at { 0 } else { 300 },
            remaining: 0,
            reset_ms: 0,
            token_ms: None,
            refused: (i == refused_at).then(|| "entries[0].key: refused".to_string()),
            penalty_ms: 0,
        })
        .collect();
    answer_sync(&proxy, &call, grants);
    assert_eq!(proxy.metric("sluice.sync.refused"), Some(1));
    assert_eq!(proxy.metric("sluice.sync.failed"), Some(0), "not a failure");
    assert_eq!(proxy.metric("sluice.breaker.open"), Some(0));
    assert_eq!(
        admitted(&proxy, 10, "alice"),
        10,
        "the good key got its lease"
    );
    proxy.advance(Duration::from_millis(100)).unwrap();
    let (_, next) = sync_calls(&proxy).remove(0);
    assert!(
        next.entries.iter().all(|e| !e.key.contains("sha256:")),
        "a refused entry is not sent again: {:?}",
        next.entries.iter().map(|e| &e.key).collect::<Vec<_>>()
    );
}

/// While the service is away (breaker open), a flood of unique keys must not grow the proxy's
/// memory: the shared queue and each worker's waiting keys stay bounded, the oldest forgotten.
/// When the service is back, batches stay under the body limit.
fn waiting_keys_stay_bounded_while_the_service_is_away() {
    use sluice_core::sync::outbox::{ANNOUNCE_PER_ROUND, MAX_BATCH_BYTES, MAX_BATCH_KEYS};
    let proxy = proxy(&config("cached", ""), 2, 12);
    // Open the breaker: two failed syncs.
    for _ in 0..2 {
        status(&proxy, 0, request("warm"));
        proxy.advance(Duration::from_millis(100)).unwrap();
        for (call, _) in sync_calls(&proxy) {
            proxy.fail_call(call.token).unwrap();
        }
    }
    assert_eq!(proxy.metric("sluice.breaker.open"), Some(1));
    let unique = 30_000;
    let value = "v".repeat(200);
    for i in 0..unique {
        status(&proxy, i % 2, request(&format!("{i}-{value}")));
        if i % 1_000 == 0 {
            proxy.advance(Duration::from_millis(10)).unwrap();
            for (call, _) in sync_calls(&proxy) {
                proxy.fail_call(call.token).unwrap();
            }
        }
    }
    let (items, bytes) = proxy
        .queue_size(sluice_core::sync::proxy::QUEUE_NAME)
        .unwrap();
    let most = 2 * 2 * ANNOUNCE_PER_ROUND as usize;
    assert!(
        items <= most,
        "{items} announcements ({bytes} bytes) queued for {unique} unique keys; at most {most}"
    );
    let dropped = proxy.metric("sluice.sync.dropped").unwrap_or(0);
    assert!(
        dropped > 0,
        "a flood beyond the bound forgets the oldest keys"
    );
    // The service comes back: every batch within the bounds, the breaker closes.
    let mut batches = 0;
    for _ in 0..200 {
        proxy.advance(Duration::from_millis(50)).unwrap();
        for (call, batch) in sync_calls(&proxy) {
            assert!(
                batch.entries.len() <= MAX_BATCH_KEYS,
                "{} entries",
                batch.entries.len()
            );
            assert!(
                call.body.len() <= MAX_BATCH_BYTES,
                "{} bytes",
                call.body.len()
            );
            grant_all(&proxy, &call, &batch, 1);
            batches += 1;
        }
        if batches > 3 && proxy.metric("sluice.breaker.open") == Some(0) {
            break;
        }
    }
    assert_eq!(
        proxy.metric("sluice.breaker.open"),
        Some(0),
        "after {batches} batches"
    );
}

/// A strict check that fails counts against the breaker, but must not release a sync round in
/// flight: a second batch would then go out beside the first.
fn a_failed_strict_check_leaves_the_sync_round_alone() {
    let config = &format!(
        r#"{{"service": {{{service}, "timeout_ms": 1000,
          "sync_interval_ms": 100, "breaker_failures": 5}},
        "rules": [
          {{"name": "shared", "key": ["header:x-api-key"], "consistency": "cached",
           "limits": [{{"requests": 100, "per": "second"}}]}},
          {{"name": "exact", "key": ["header:x-api-key"], "consistency": "strict",
           "limits": [{{"requests": 100, "per": "second"}}]}}]}}"#,
        service = hosts::service()
    );
    let proxy = proxy(config, 1, 13);
    let _paused = proxy.worker(0).request(request("alice")).unwrap();
    proxy.advance(Duration::from_millis(100)).unwrap();
    assert_eq!(sync_calls(&proxy).len(), 1, "a round in flight");
    let check = proxy
        .pending_calls()
        .into_iter()
        .find(|c| c.header(":path") == Some("/v1/check"))
        .expect("the strict check");
    proxy.fail_call(check.token).unwrap();
    assert_eq!(proxy.metric("sluice.check.failed"), Some(1));
    let _ = proxy.worker(0).request(request("bob")).unwrap();
    proxy.advance(Duration::from_millis(150)).unwrap();
    assert_eq!(
        sync_calls(&proxy).len(),
        1,
        "the first batch is still in flight: no second one"
    );
}

/// The service advises a longer interval under backpressure; the proxy follows it, but tells the
/// service its own interval each round, so the advice comes back down once the service is well
/// (sending the advice back as its own made a slow moment last until the proxy restarted).
fn an_advised_interval_comes_back_down() {
    let proxy = proxy(&config("cached", ""), 1, 7);
    let answer = |call: &HttpCall, request: &SyncRequest, next_sync_ms: u64| {
        let grants = request
            .entries
            .iter()
            .map(|_| Lease {
                tokens: 10,
                ttl_ms: 3_000,
                remaining: 10,
                reset_ms: 0,
                token_ms: None,
                refused: None,
                penalty_ms: 0,
            })
            .collect();
        answer_sync_advising(&proxy, call, grants, next_sync_ms);
    };
    status(&proxy, 0, request("alice"));
    proxy.advance(Duration::from_millis(100)).unwrap();
    let calls = sync_calls(&proxy);
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].1.interval_ms, 100);
    // the service is slow: sync every second
    answer(&calls[0].0, &calls[0].1, 1_000);

    status(&proxy, 0, request("alice"));
    proxy.advance(Duration::from_millis(500)).unwrap();
    assert!(sync_calls(&proxy).is_empty(), "the advice is followed");
    proxy.advance(Duration::from_millis(600)).unwrap();
    let calls = sync_calls(&proxy);
    assert_eq!(calls.len(), 1, "a round a second");
    assert_eq!(
        calls[0].1.interval_ms, 100,
        "its own interval, not the advice"
    );
    // the service is well again: it answers the interval it was sent
    answer(&calls[0].0, &calls[0].1, calls[0].1.interval_ms);

    status(&proxy, 0, request("alice"));
    proxy.advance(Duration::from_millis(150)).unwrap();
    assert_eq!(sync_calls(&proxy).len(), 1, "every 100 ms again");
}

/// A proxy whose leases keep running out asks again early, but at most four rounds an interval.
fn exhausted_leases_sync_at_most_four_times_an_interval() {
    let proxy = proxy(&config("cached", ""), 2, 11);
    let mut rounds = 0;
    // 2 s of 1 ms steps, 4 requests a step on two keys, every lease 2 tokens
    for _ in 0..2_000 {
        for i in 0..4 {
            status(
                &proxy,
                i % 2,
                request(if i % 2 == 0 { "alice" } else { "bob" }),
            );
        }
        for (call, batch) in sync_calls(&proxy) {
            rounds += 1;
            grant_all(&proxy, &call, &batch, 2);
        }
        proxy.advance(Duration::from_millis(1)).unwrap();
    }
    assert!(rounds >= 20, "early rounds happen: {rounds}");
    assert!(rounds <= 4 * 20 + 1, "{rounds} rounds in 2 s at 100 ms");
}

/// A batch's keys, with their spent and denied counts.
type Reported = Vec<(String, u64, u64)>;

/// The keys of a batch, with their spent and denied counts.
fn reported(batch: &SyncRequest) -> Reported {
    let entries = batch.entries.iter();
    entries
        .map(|e| (e.key.clone(), e.spent, e.denied))
        .collect()
}

/// Plays `ms` milliseconds in 1 ms steps, calling `traffic` each, and answers every sync round
/// with leases of `tokens` (300 ms) on a global bucket holding no more, full in `reset_ms`.
/// Returns the rounds: when (ms from the start), and what they reported.
fn play(
    proxy: &Proxy,
    ms: u64,
    tokens: u64,
    reset_ms: u64,
    mut traffic: impl FnMut(u64),
) -> Vec<(u64, Reported)> {
    let mut rounds = Vec::new();
    for at in 0..ms {
        traffic(at);
        for (call, batch) in sync_calls(proxy) {
            rounds.push((at, reported(&batch)));
            grant_all_of(proxy, &call, &batch, tokens, tokens, reset_ms);
        }
        proxy.advance(Duration::from_millis(1)).unwrap();
    }
    rounds
}

/// A lease of `tokens` for one request, answered at once (a global bucket full in
/// `reset_ms`): the first round (and its lease) starts the test.
fn leased(seed: u64, tokens: u64, reset_ms: u64) -> Proxy {
    let proxy = proxy(&config("cached", ""), 2, seed);
    assert_eq!(admitted(&proxy, 1, "alice"), 1);
    proxy.advance(Duration::from_millis(10)).unwrap();
    let (call, batch) = sync_calls(&proxy).remove(0);
    assert_eq!(reported(&batch), vec![("shared\u{1f}alice".into(), 1, 0)]);
    grant_all_of(&proxy, &call, &batch, tokens, tokens, reset_ms);
    proxy
}

/// A key whose lease still covers its spend reports at the next round all the same: the
/// service resizes a lease that is more than the demand (held, it stays parked).
fn a_covered_lease_reports_every_interval() {
    let proxy = leased(12, 10, 0);
    assert_eq!(admitted(&proxy, 3, "alice"), 3, "from the lease of 10");
    let rounds = play(&proxy, 150, 10, 0, |_| {});
    let alice: Vec<_> = rounds.iter().filter(|(_, r)| !r.is_empty()).collect();
    assert_eq!(alice.len(), 1, "{rounds:?}");
    assert!(alice[0].0 <= 100, "the next round: {rounds:?}");
    assert_eq!(alice[0].1, vec![("shared\u{1f}alice".into(), 3, 0)]);
}

/// Denials on an empty lease, every 10 ms on alternate workers: the rounds of `ms` ms, each
/// answered with an empty lease on a global bucket full in `reset_ms`.
fn starve(seed: u64, ms: u64, reset_ms: u64) -> Vec<(u64, Reported)> {
    let proxy = leased(seed, 0, reset_ms);
    play(&proxy, ms, 0, reset_ms, |at| {
        if at % 10 == 0 {
            let worker = (at / 10 % 2) as usize;
            assert_eq!(status(&proxy, worker, request("alice")), 429);
        }
    })
}

/// A key denied on an empty lease while the global bucket holds no token does not ask every
/// round (and its denials bring no round forward), but always before its lease lapses,
/// with every denial counted; once the bucket has a token again, it asks at once.
fn a_starved_key_asks_again_before_its_lease_lapses_not_every_round() {
    // 100 a second, burst 100: 2 s to full is a second in debt, no token for a second
    let rounds = starve(13, 1_000, 2_000);
    let alice: Vec<_> = rounds.iter().filter(|(_, r)| !r.is_empty()).collect();
    let denied: u64 = alice.iter().map(|(_, r)| r[0].2).sum();
    assert!(
        alice
            .windows(2)
            .all(|w| w[1].0 - w[0].0 >= 150 && w[1].0 - w[0].0 < 300),
        "one report every 150-300 ms of 300 ms leases: {alice:?}"
    );
    assert!(alice.len() >= 4, "{alice:?}");
    let last = alice.last().map_or(0, |(at, _)| *at);
    assert_eq!(
        denied,
        last / 10,
        "every denial before the last report counted: {alice:?}"
    );
    assert!(
        rounds.len() > alice.len() + 3,
        "the rounds between carry nothing: {rounds:?}"
    );
    // Its denials bring no round forward either: an early round could only bring an empty
    // lease (before, a round every quarter interval: about 40 in the second).
    assert!(
        rounds.len() <= 11,
        "one round an interval (100 ms): {} rounds {rounds:?}",
        rounds.len()
    );
    // full in 1 s: a token is back 10 ms after the answer, so every round asks
    let rounds = starve(14, 300, 1_000);
    let alice = rounds.iter().filter(|(_, r)| !r.is_empty()).count();
    assert!(alice >= 6, "{alice} reports in {rounds:?}");
}

/// nginx given an Envoy cluster's name: its resolver does not know the name, the dispatch fails
/// with `:dispatch_status: resolver failure` and zero headers, which counts as a failed sync and
/// opens the breaker as any failure does.
#[test]
fn in_nginx_a_cluster_name_fails_like_any_unreachable_service() {
    hosts::run_as(sluice_host::HostProfile::NgxWasmModule, || {
        let config =
            config("cached", "").replace(hosts::service(), r#""cluster": "sluice_service""#);
        let options = ProxyOptions {
            profile: hosts::profile(),
            clusters: Some(Vec::new()),
            ..ProxyOptions::new(config)
        };
        let proxy = Proxy::new(module(), options).unwrap();
        for round in 0..2 {
            status(&proxy, 0, request(&format!("k{round}")));
            proxy.advance(Duration::from_millis(150)).unwrap();
        }
        assert!(
            proxy.pending_calls().is_empty(),
            "every sync failed at once"
        );
        assert!(proxy.metric("sluice.sync.failed").unwrap_or(0) >= 2);
        assert_eq!(proxy.metric("sluice.sync.ok"), Some(0));
    });
}

/// nginx with `service.tls`: every dispatch to the service asks ngx_wasm_module for TLS (`:scheme: https`), the
/// sync's and the strict check's, with the authority it checks the certificate against.
#[test]
fn in_nginx_service_tls_asks_every_dispatch_for_https() {
    hosts::run_as(sluice_host::HostProfile::NgxWasmModule, || {
        let config = config("cached", "").replace(
            hosts::service(),
            &format!(
                r#"{}, "authority": "sluice-service.internal", "tls": true"#,
                hosts::service()
            ),
        );
        let strict = config.replace(r#""consistency": "cached""#, r#""consistency": "strict""#);
        // the sync's, an interval on; the strict check's, at once (its request waits for it)
        for (config, wait) in [(config, 150), (strict, 0)] {
            let proxy = proxy(&config, 1, 1);
            status(&proxy, 0, request("alice"));
            proxy.advance(Duration::from_millis(wait)).unwrap();
            let calls = proxy.pending_calls();
            assert!(!calls.is_empty(), "a dispatch: {config}");
            for call in &calls {
                assert_eq!(
                    call.header(":scheme"),
                    Some("https"),
                    "{:?} {config}",
                    call.header(":path")
                );
                assert_eq!(call.header(":authority"), Some("sluice-service.internal"));
            }
        }
    });
}

/// A fail-closed cached key's second check races the sync its first one brought forward: the
/// service leased the key's rest to this proxy, then denied the check (it sets every lease
/// aside), and the check's answer came before the sync's. The check names the proxy as its
/// syncs do, the denial tells the lease, and the request is admitted from it; the sync's answer,
/// the same grant, then holds only what was left: 2 admitted in all, then 429.
fn a_check_answered_before_the_syncs_lease_is_admitted_from_it_once() {
    let fallback = r#", "fallback": {"policy": "fail_closed"}"#;
    let proxy = proxy(&config("cached", fallback), 1, 12);
    let first = proxy.worker(0).request(request("alice")).unwrap();
    check_answer(&proxy, true);
    assert!(first.state().unwrap().is_continued());
    proxy.advance(Duration::from_millis(100)).unwrap();
    let (sync, batch) = sync_calls(&proxy).remove(0);
    let second = proxy.worker(0).request(request("alice")).unwrap();
    let call = proxy
        .pending_calls()
        .into_iter()
        .find(|c| c.header(":path") == Some("/v1/check"))
        .expect("the second check");
    let asked: sluice_core::protocol::CheckRequest = serde_json::from_slice(&call.body).unwrap();
    assert_eq!(asked.proxy.as_deref(), Some(batch.proxy.as_str()));
    let told = CheckResponse {
        allowed: false,
        remaining: 0,
        retry_after_ms: 600,
        reset_ms: 9_000,
        lease: Some(sluice_core::protocol::CheckLease {
            tokens: 2,
            ttl_ms: 300,
        }),
    };
    let body = serde_json::to_vec(&told).unwrap();
    proxy.answer_call(call.token, 200, &[], &body).unwrap();
    let state = second.state().unwrap();
    assert!(state.is_continued(), "{state:?}");
    grant_all(&proxy, &sync, &batch, 2);
    assert_eq!(status(&proxy, 0, request("alice")), 200);
    assert_eq!(
        status(&proxy, 0, request("alice")),
        429,
        "the grant is spent"
    );
}

both_hosts!(
    one_batch_per_interval_whatever_the_worker_count,
    a_grant_is_a_lease_spent_exactly_across_workers,
    the_breaker_opens_falls_back_and_recovers,
    headers_from_a_lease_describe_the_global_bucket,
    a_wrong_token_is_counted_and_logged,
    the_service_can_turn_on_the_emergency_bypass,
    two_proxies_share_nothing_locally,
    strict_requests_wait_for_the_service,
    a_strict_check_that_times_out_falls_back,
    fail_closed_denies_without_the_service,
    a_long_key_cannot_stop_the_sync,
    waiting_keys_stay_bounded_while_the_service_is_away,
    a_failed_strict_check_leaves_the_sync_round_alone,
    an_advised_interval_comes_back_down,
    exhausted_leases_sync_at_most_four_times_an_interval,
    a_covered_lease_reports_every_interval,
    a_starved_key_asks_again_before_its_lease_lapses_not_every_round,
    a_check_answered_before_the_syncs_lease_is_admitted_from_it_once,
);
