//! Shedding in the wasmtime host, on a virtual clock: slots shared by the workers, given back
//! however a stream ends, the wait queue served by the root's ticks, and the adaptive limit
//! following the upstream's latency.

#[path = "support/hosts.rs"]
mod hosts;

use std::sync::OnceLock;
use std::time::Duration;

use sluice_core::shed::Gauge;
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

fn gauge(proxy: &Proxy, bulkhead: &str) -> Gauge {
    let (bytes, _) = proxy
        .shared_data(&format!("sluice/shed/{bulkhead}"))
        .expect("the gauge is created at configuration");
    Gauge::decode(&bytes)
}

fn send(proxy: &Proxy, worker: usize, class: &str) -> Exchange {
    let spec = RequestSpec::get("/api/x").header("x-class", class);
    proxy.worker(worker).request(spec).unwrap()
}

fn status(exchange: &Exchange) -> Option<u32> {
    match exchange.state().unwrap() {
        ExchangeState::Continued { .. } => Some(200),
        ExchangeState::LocalResponse { status, .. } => Some(status),
        ExchangeState::Paused => None,
        ExchangeState::Reset => Some(0),
    }
}

const STATIC: &str = r#"{"shedding": {"class_header": "x-class",
  "bulkheads": [{"name": "api", "match": {"path_prefix": "/api/"}, "limit": {"static": 4}}]}}"#;

fn the_workers_share_the_slots_and_every_kind_of_end_gives_one_back() {
    let proxy = proxy(STATIC, 3);
    let held: Vec<Exchange> = (0..4).map(|i| send(&proxy, i % 3, "critical")).collect();
    assert!(held.iter().all(|e| status(e) == Some(200)));
    assert_eq!(gauge(&proxy, "api").in_flight, 4);
    let shed = send(&proxy, 2, "enterprise");
    let ExchangeState::LocalResponse {
        status: code,
        headers,
        body,
        details,
        ..
    } = shed.state().unwrap()
    else {
        panic!("not shed: {:?}", shed.state());
    };
    assert_eq!(code, 503);
    assert_eq!(
        details, "sluice_shed_concurrency",
        "the access log's details"
    );
    assert!(headers
        .iter()
        .any(|(k, v)| k == "x-sluice-shed" && v == "concurrency"));
    let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(body["error"], "overloaded");
    // What Envoy's access log may print (filter state `wasm.sluice.*`), asked for
    // (`access_log`); nginx keeps none. Not asked for, none.
    let state = shed.state().unwrap();
    assert_eq!(state.property("sluice.outcome"), None);
    let logged = crate::proxy(&STATIC.replacen('{', r#"{"access_log": true, "#, 1), 1);
    let _full: Vec<Exchange> = (0..4).map(|_| send(&logged, 0, "critical")).collect();
    let state = send(&logged, 0, "enterprise").state().unwrap();
    let facts = [
        "sluice.outcome",
        "sluice.rule",
        "sluice.bulkhead",
        "sluice.class",
        "sluice.key",
    ]
    .map(|name| state.property(name));
    let expected = match hosts::profile().is_nginx() {
        true => [None; 5],
        false => [Some("shed"), None, Some("api"), Some("enterprise"), None],
    };
    assert_eq!(facts, expected, "the outcome, the bulkhead and the class");

    // A response, a client reset before any response, a 504 from the host, a 503 reset.
    held[0].respond(200, &[]).unwrap();
    held[1].finish().unwrap();
    held[2].respond(504, &[]).unwrap();
    held[3].respond(503, &[]).unwrap();
    assert_eq!(gauge(&proxy, "api").in_flight, 0);

    // Many more, ended every way, on every worker: nothing leaks.
    let mut open = Vec::new();
    for i in 0..300 {
        let e = send(&proxy, i % 3, if i % 5 == 0 { "free" } else { "critical" });
        if status(&e) == Some(200) {
            open.push(e);
        }
        if open.len() >= 3 || i % 7 == 0 {
            for (j, e) in open.drain(..).enumerate() {
                match (i + j) % 3 {
                    0 => drop(e.respond(200, &[])),
                    1 => drop(e.finish()),
                    _ => drop(e.respond(500, &[])),
                }
            }
        }
    }
    for e in open {
        e.finish().unwrap();
    }
    assert_eq!(gauge(&proxy, "api").in_flight, 0);
    proxy.advance(Duration::from_millis(20)).unwrap();
    assert_eq!(proxy.metric("sluice.shed.api.in_flight"), Some(0));
    assert!(proxy.metric("sluice.shed.api.admitted").unwrap_or(0) > 200);
}

#[test]
fn a_waiter_gets_the_next_slot_on_a_tick_and_one_that_waits_too_long_is_shed() {
    let proxy = proxy(
        r#"{"shedding": {"class_header": "x-class", "bulkheads": [{"name": "api", "limit": {"static": 1},
            "queue": {"size": 4, "max_wait_ms": 50}}]}}"#,
        2,
    );
    let first = send(&proxy, 0, "critical");
    assert_eq!(status(&first), Some(200));
    let low = send(&proxy, 1, "free");
    let high = send(&proxy, 1, "premium");
    assert_eq!(status(&low), None, "waits");
    assert_eq!(status(&high), None, "waits");
    assert_eq!(proxy.metric("sluice.shed.api.queued"), Some(2));
    proxy.advance(Duration::from_millis(20)).unwrap();
    assert_eq!(status(&high), None, "no slot yet");
    // A slot frees on the other worker: the next tick of the waiters' worker seats the most
    // important one.
    first.respond(200, &[]).unwrap();
    proxy.advance(Duration::from_millis(10)).unwrap();
    assert_eq!(status(&high), Some(200));
    assert_eq!(status(&low), None);
    assert_eq!(gauge(&proxy, "api").in_flight, 1);
    // The other waits past 50 ms and gets its 503.
    proxy.advance(Duration::from_millis(40)).unwrap();
    let ExchangeState::LocalResponse {
        status: code,
        headers,
        details,
        ..
    } = low.state().unwrap()
    else {
        panic!("{:?}", low.state());
    };
    assert_eq!(code, 503);
    assert_eq!(details, "sluice_shed_queue_timeout");
    assert!(headers
        .iter()
        .any(|(k, v)| k == "x-sluice-shed" && v == "queue_timeout"));
    high.respond(200, &[]).unwrap();
    assert_eq!(gauge(&proxy, "api").in_flight, 0);
    assert_eq!(proxy.metric("sluice.shed.api.shed.queue_timeout"), Some(1));
    assert_eq!(proxy.metric("sluice.shed.api.class.free.shed"), Some(1));
}

#[test]
fn a_waiter_whose_client_leaves_holds_nothing() {
    let proxy = proxy(
        r#"{"shedding": {"bulkheads": [{"name": "api", "limit": {"static": 1},
            "queue": {"size": 4, "max_wait_ms": 500}}]}}"#,
        1,
    );
    let first = send(&proxy, 0, "basic");
    let waiter = send(&proxy, 0, "basic");
    assert_eq!(status(&waiter), None);
    waiter.finish().unwrap();
    first.finish().unwrap();
    proxy.advance(Duration::from_millis(30)).unwrap();
    assert_eq!(gauge(&proxy, "api").in_flight, 0);
    assert_eq!(status(&send(&proxy, 0, "basic")), Some(200));
}

/// An upstream that answers after `latency`: requests sent one per `gap`, each answered when
/// its time comes, on a virtual clock.
fn drive(
    proxy: &Proxy,
    seconds: u64,
    gap: Duration,
    latency: impl Fn(usize) -> Duration,
) -> (usize, usize) {
    let mut open: Vec<(Exchange, Duration)> = Vec::new();
    let (mut admitted, mut shed) = (0, 0);
    let mut now = Duration::ZERO;
    let end = Duration::from_secs(seconds);
    while now < end {
        open.retain(|(e, at)| {
            if *at <= now {
                let _ = e.respond(200, &[]);
                false
            } else {
                true
            }
        });
        let e = send(proxy, admitted % 2, "basic");
        match status(&e) {
            Some(200) => {
                admitted += 1;
                open.push((e, now + latency(open.len())));
            }
            _ => shed += 1,
        }
        proxy.advance(gap).unwrap();
        now += gap;
    }
    for (e, _) in open {
        let _ = e.respond(200, &[]);
    }
    (admitted, shed)
}

fn the_adaptive_limit_falls_when_the_upstream_queues() {
    let proxy = proxy(
        r#"{"shedding": {"bulkheads": [{"name": "api", "limit": {"adaptive":
            {"min": 2, "max": 100, "initial": 40, "tolerance": 1.5, "window_ms": 100}}}]}}"#,
        2,
    );
    // 4 workers of 20 ms: latency grows with what is in flight beyond 4.
    let (admitted, shed) = drive(&proxy, 5, Duration::from_millis(2), |in_flight| {
        Duration::from_millis(20 * (1 + in_flight as u64 / 4))
    });
    let limit = proxy.metric("sluice.shed.api.limit").unwrap();
    assert!((4..=12).contains(&limit), "limit {limit}");
    assert!(
        shed > 0 && admitted > 500,
        "admitted {admitted}, shed {shed}"
    );
    let rtt = proxy.metric("sluice.shed.api.rtt_ms").unwrap();
    assert!(rtt <= 45, "rtt {rtt} ms");
}

/// Shedding beside a counter service starts in nginx: the worker sets its one tick once
/// (ngx_wasm_module traps a second `proxy_set_tick_period_milliseconds`), and the slots still
/// come back however a stream ends.
fn shedding_and_a_service_share_one_tick() {
    let config = format!(
        r#"{{"service": {{{service}}},
          "rules": [{{"name": "r", "key": ["client_ip"], "consistency": "cached",
                     "limits": [{{"requests": 1000, "per": "second"}}]}}],
          "shedding": {{"bulkheads": [{{"name": "api", "limit": {{"static": 2}}}}]}}}}"#,
        service = hosts::service()
    );
    let proxy = proxy(&config, 2);
    let first = send(&proxy, 0, "");
    let second = send(&proxy, 1, "");
    assert_eq!(gauge(&proxy, "api").in_flight, 2);
    first.respond(200, &[]).unwrap();
    second.finish().unwrap();
    proxy.advance(Duration::from_millis(10)).unwrap();
    assert_eq!(gauge(&proxy, "api").in_flight, 0);
    assert!(proxy.is_alive(0) && proxy.is_alive(1));
}

/// Two bulkheads of a monitoring shedding: `watched` (the shedding's mode) and `told`, a warn
/// bulkhead; `ramped` enforces half its would-be sheds.
const MODES: &str = r#"{"shedding": {"mode": "monitor", "class_header": "x-class",
  "bulkheads": [{"name": "watched", "match": {"path_prefix": "/w/"}, "limit": {"static": 1}},
                {"name": "told", "match": {"path_prefix": "/t/"}, "limit": {"static": 1}, "mode": "warn"},
                {"name": "ramped", "match": {"path_prefix": "/r/"}, "limit": {"static": 1}, "mode": "enforce", "ramp_percent": 50}]}}"#;

fn send_to(proxy: &Proxy, worker: usize, path: &str, class: &str) -> Exchange {
    let spec = RequestSpec::get(path).header("x-class", class);
    proxy.worker(worker).request(spec).unwrap()
}

fn warn_lines(proxy: &Proxy) -> Vec<String> {
    proxy
        .log_messages(sluice_host::LogLevel::Warn)
        .into_iter()
        .filter(|m| m.contains("(warn) would shed"))
        .collect()
}

/// A warn bulkhead logs what it would have shed (the bulkhead, the class, the reason), at most a
/// line a second per worker with how many it skipped; a monitor bulkhead only counts. Before,
/// warn mode promised the line and wrote none.
fn a_warn_bulkhead_logs_its_would_be_sheds_once_a_second_per_worker() {
    let proxy = proxy(MODES, 1);
    let _held = [
        send_to(&proxy, 0, "/w/x", "basic"),
        send_to(&proxy, 0, "/t/x", "basic"),
    ];
    for _ in 0..3 {
        assert_eq!(status(&send_to(&proxy, 0, "/w/x", "free")), Some(200));
    }
    assert!(warn_lines(&proxy).is_empty(), "monitor only counts");
    for _ in 0..5 {
        assert_eq!(status(&send_to(&proxy, 0, "/t/x", "free")), Some(200));
    }
    assert_eq!(
        warn_lines(&proxy),
        ["sluice: bulkhead told (warn) would shed class free (concurrency)"],
        "one line a second"
    );
    proxy.advance(Duration::from_millis(1_100)).unwrap();
    assert_eq!(status(&send_to(&proxy, 0, "/t/x", "premium")), Some(200));
    let lines = warn_lines(&proxy);
    assert_eq!(
        lines.last().map(String::as_str),
        Some("sluice: bulkhead told (warn) would shed class premium (concurrency) (4 more since the last line)"),
        "{lines:?}"
    );
    proxy.advance(Duration::from_millis(20)).unwrap();
    assert_eq!(
        proxy.metric("sluice.shed.told.would_shed.concurrency"),
        Some(6)
    );
    assert_eq!(
        proxy.metric("sluice.shed.watched.would_shed.concurrency"),
        Some(3)
    );
}

/// Each bulkhead sheds by its own mode: of a monitoring shedding, the enforce bulkhead with a
/// 50% ramp sheds about half its would-be sheds and lets the rest through, counted.
fn each_bulkhead_sheds_by_its_own_mode_and_ramp() {
    let proxy = proxy(MODES, 2);
    let _held = send_to(&proxy, 0, "/r/x", "basic");
    let mut shed = 0;
    for i in 0..200 {
        let e = send_to(&proxy, i % 2, "/r/x", "basic");
        match status(&e) {
            Some(503) => shed += 1,
            Some(200) => e.finish().unwrap(),
            other => panic!("{other:?}"),
        }
    }
    assert!(
        (60..=140).contains(&shed),
        "{shed} of 200 shed at a 50% ramp"
    );
    proxy.advance(Duration::from_millis(20)).unwrap();
    assert_eq!(
        proxy.metric("sluice.shed.ramped.shed.concurrency"),
        Some(shed)
    );
    assert_eq!(
        proxy.metric("sluice.shed.ramped.would_shed.concurrency"),
        Some(200 - shed)
    );
}

/// A proxy syncing with a counter service every 100 ms (the test plays the service), one
/// monitoring bulkhead of one slot.
fn synced() -> String {
    format!(
        r#"{{"service": {{{service}, "token": "t", "timeout_ms": 100, "sync_interval_ms": 100}},
          "shedding": {{"mode": "monitor", "class_header": "x-class",
                        "bulkheads": [{{"name": "api", "limit": {{"static": 1}}}}]}}}}"#,
        service = hosts::service()
    )
}

/// Lets the next sync go out and answers it with `live`: every worker applies it on its tick.
fn push_overrides(proxy: &Proxy, live: &sluice_core::protocol::LiveOverrides) {
    use sluice_core::protocol::{Hints, SyncRequest, SyncResponse};
    proxy.advance(Duration::from_millis(100)).unwrap();
    let calls: Vec<_> = proxy
        .pending_calls()
        .into_iter()
        .filter(|c| c.header(":path") == Some("/v1/sync"))
        .collect();
    assert!(!calls.is_empty(), "no sync went out");
    for call in calls {
        let request: SyncRequest = serde_json::from_slice(&call.body).unwrap();
        assert!(request.entries.is_empty());
        let mut response = SyncResponse {
            grants: Vec::new(),
            hints: Hints {
                next_sync_ms: 100,
                ..Hints::default()
            },
        };
        response.hints.overrides.live = Some(live.clone());
        let body = serde_json::to_vec(&response).unwrap();
        proxy.answer_call(call.token, 200, &[], &body).unwrap();
    }
    proxy.advance(Duration::from_millis(20)).unwrap();
}

fn bulkhead_override(
    version: u64,
    value: serde_json::Value,
) -> sluice_core::protocol::LiveOverrides {
    sluice_core::protocol::LiveOverrides {
        version,
        limits: [("bulkhead:api".to_string(), vec![value])].into(),
        ..Default::default()
    }
}

/// A live override turns a monitoring bulkhead to enforce and then widens its limit, on every
/// worker, without a reload; one that fails the configuration's checks is logged, counted and
/// left out (the bulkhead keeps what it had).
fn a_bulkheads_mode_and_limit_change_live() {
    let proxy = proxy(&synced(), 2);
    let held = send_to(&proxy, 0, "/x", "basic");
    assert_eq!(
        status(&send_to(&proxy, 1, "/x", "basic")),
        Some(200),
        "monitor"
    );
    push_overrides(
        &proxy,
        &bulkhead_override(2, serde_json::json!({"mode": "enforce"})),
    );
    for worker in 0..2 {
        assert_eq!(
            status(&send_to(&proxy, worker, "/x", "basic")),
            Some(503),
            "worker {worker}"
        );
    }
    push_overrides(
        &proxy,
        &bulkhead_override(
            3,
            serde_json::json!({"mode": "enforce", "limit": {"static": 0}}),
        ),
    );
    let refused: Vec<String> = proxy
        .log_messages(sluice_host::LogLevel::Warn)
        .into_iter()
        .filter(|m| m.contains("live override not applied"))
        .collect();
    assert!(
        refused
            .iter()
            .any(|m| m.contains("bulkheads.api.limit.static: must be between 1 and 1000000, got 0")),
        "{refused:?}"
    );
    // Left out: the bulkhead is as configured again (monitor), not at a limit of 0.
    assert_eq!(status(&send_to(&proxy, 0, "/x", "basic")), Some(200));
    push_overrides(
        &proxy,
        &bulkhead_override(
            4,
            serde_json::json!({"mode": "enforce", "limit": {"static": 3}}),
        ),
    );
    let more: Vec<Exchange> = (0..2)
        .map(|i| send_to(&proxy, i, "/x", "critical"))
        .collect();
    assert!(more.iter().all(|e| status(e) == Some(200)));
    held.finish().unwrap();
}

/// A class guaranteed half the slots (`premium`, 2 of 4) takes them from a full bulkhead, on any
/// worker, and no more; they come back however its streams end.
fn a_class_under_its_guaranteed_share_takes_a_slot_from_a_full_bulkhead() {
    let config = r#"{"shedding": {"class_header": "x-class", "classes": {"basic": 1.0},
      "guaranteed": {"premium": 0.5},
      "bulkheads": [{"name": "api", "limit": {"static": 4}}]}}"#;
    let proxy = proxy(config, 2);
    let held: Vec<Exchange> = (0..4).map(|i| send(&proxy, i % 2, "basic")).collect();
    assert!(held.iter().all(|e| status(e) == Some(200)));
    assert_eq!(status(&send(&proxy, 0, "basic")), Some(503));
    let premium: Vec<Exchange> = (0..2).map(|i| send(&proxy, i, "premium")).collect();
    assert!(
        premium.iter().all(|e| status(e) == Some(200)),
        "within its share"
    );
    assert_eq!(
        status(&send(&proxy, 1, "premium")),
        Some(503),
        "past its share"
    );
    assert_eq!(gauge(&proxy, "api").class_in_flight(2), 2);
    premium[0].respond(200, &[]).unwrap();
    premium[1].finish().unwrap();
    assert_eq!(gauge(&proxy, "api").class_in_flight(2), 0);
    assert_eq!(gauge(&proxy, "api").in_flight, 4);
}

/// The upstream's saturation report (`saturation_header`) counts, from its response only: a
/// client's request header of the same name, and a value that does not parse, change nothing.
fn the_upstreams_saturation_report_counts_from_its_response_only() {
    let config = r#"{"shedding": {"class_header": "x-class",
      "bulkheads": [{"name": "api", "limit": {"static": 100},
                     "saturation_header": "x-upstream-saturation"}]}}"#;
    let proxy = proxy(config, 2);
    let window = |response: Option<&str>, request: Option<&str>| {
        for i in 0..20 {
            let mut spec = RequestSpec::get("/api/x").header("x-class", "critical");
            if let Some(value) = request {
                spec = spec.header("x-upstream-saturation", value);
            }
            let e = proxy.worker(i % 2).request(spec).unwrap();
            let headers: Vec<(&str, &str)> = response
                .map(|v| vec![("x-upstream-saturation", v)])
                .unwrap_or_default();
            e.respond(200, &headers).unwrap();
        }
        // Past the window's end: its reports are published.
        proxy.advance(Duration::from_millis(150)).unwrap();
    };
    window(None, Some("100%"));
    for garbage in [
        "-1",
        "1e9",
        "NaN",
        "150%",
        "0.5.5",
        "99999999999999999999",
        "0x1",
    ] {
        window(Some(garbage), None);
    }
    let free = send(&proxy, 0, "free");
    assert_eq!(
        status(&free),
        Some(200),
        "nothing in flight, nothing reported"
    );
    free.respond(200, &[]).unwrap();
    // The upstream says 95% with nothing in flight here: free (0.7) and basic (0.8) are shed,
    // critical is not.
    window(Some("95%"), None);
    let shed = send(&proxy, 1, "free");
    let ExchangeState::LocalResponse {
        status: code,
        headers,
        ..
    } = shed.state().unwrap()
    else {
        panic!("not shed: {:?}", shed.state());
    };
    assert_eq!(code, 503);
    assert!(headers
        .iter()
        .any(|(k, v)| k == "x-sluice-shed" && v == "priority"));
    assert_eq!(status(&send(&proxy, 0, "basic")), Some(503));
    assert_eq!(status(&send(&proxy, 0, "critical")), Some(200));
    assert_eq!(gauge(&proxy, "api").in_flight, 1);
}

// The wait queue's two scenarios stay Envoy-only: `"host": "nginx"` refuses a bulkhead's `queue`, since a
// waiter is resumed from the root's tick through `proxy_set_effective_context`, which ngx_wasm_module does not
// implement (see docs/hosts.md).
both_hosts!(
    the_workers_share_the_slots_and_every_kind_of_end_gives_one_back,
    the_adaptive_limit_falls_when_the_upstream_queues,
    shedding_and_a_service_share_one_tick,
    a_warn_bulkhead_logs_its_would_be_sheds_once_a_second_per_worker,
    each_bulkhead_sheds_by_its_own_mode_and_ramp,
    a_bulkheads_mode_and_limit_change_live,
    a_class_under_its_guaranteed_share_takes_a_slot_from_a_full_bulkhead,
    the_upstreams_saturation_report_counts_from_its_response_only,
);
