//! Load shedding in core alone: admission by in-flight count, classes, deadlines, success rate,
//! degradation, the fleet level, the wait queue, modes, and the adaptive limit on a virtual
//! clock against a simulated upstream.

use sluice_core::shed::admission::{gauge, grpc_timeout_us};
use sluice_core::shed::{self, Queued, Samples, Seat, WaitQueue};
use sluice_core::{Effect, Exchange, Limiter, MemoryStore, Moment, PlainRequest, Step, Store};

const MS: u64 = 1_000;
const T0: u64 = 1_700_000_000_000_000;

fn limiter(json: &str) -> Limiter {
    build(json)
}

fn build(json: &str) -> Limiter {
    Limiter::new(sluice_core::parse(json.as_bytes()).unwrap())
}

fn at(now_us: u64) -> Moment {
    Moment::at(now_us)
}

fn shedding(bulkhead: &str) -> String {
    format!(
        r#"{{"shedding": {{"class_header": "x-class", "classes": {{"high": 0.9, "low": 0.7}},
            "bulkheads": [{bulkhead}]}}}}"#
    )
}

fn static_limit(n: u32) -> Limiter {
    limiter(&shedding(&format!(
        r#"{{"name": "api", "match": {{"path_prefix": "/api"}}, "limit": {{"static": {n}}},
            "expensive": [{{"path_prefix": "/api/search"}}], "timeout_ms": 1000}}"#
    )))
}

/// As [`static_limit`], believing the fleet level with `fleet_margin` (1: fully).
fn static_limit_with_margin(n: u32, margin: f64) -> Limiter {
    limiter(&format!(
        r#"{{"shedding": {{"class_header": "x-class", "classes": {{"high": 0.9, "low": 0.7}},
            "fleet_margin": {margin},
            "bulkheads": [{{"name": "api", "match": {{"path_prefix": "/api"}}, "limit": {{"static": {n}}},
            "expensive": [{{"path_prefix": "/api/search"}}], "timeout_ms": 1000}}]}}}}"#
    ))
}

fn request(class: &str) -> PlainRequest {
    PlainRequest::get("/api/x").with_header("x-class", class)
}

fn start(
    limiter: &Limiter,
    store: &mut MemoryStore,
    req: PlainRequest,
    m: Moment,
) -> (Exchange, Step, Vec<Effect>) {
    let mut req = req;
    Exchange::start(limiter, &mut req, None, m, store)
}

fn in_flight(limiter: &Limiter, store: &mut MemoryStore) -> u32 {
    gauge(limiter.policy().shedding.as_ref().unwrap(), 0, store).in_flight
}

fn reply(step: &Step) -> &sluice_core::Reply {
    match step {
        Step::Respond(r) => r,
        other => panic!("expected a reply, got {other:?}"),
    }
}

#[test]
fn beyond_the_limit_is_503_with_retry_after_and_a_json_reason_and_the_end_gives_the_slot_back() {
    let limiter = static_limit(4);
    let mut store = MemoryStore::default();
    let mut admitted = Vec::new();
    for _ in 0..4 {
        let (ex, step, _) = start(&limiter, &mut store, request("critical"), at(T0));
        assert_eq!(step, Step::Continue);
        admitted.push(ex);
    }
    assert_eq!(in_flight(&limiter, &mut store), 4);
    let (_, step, effects) = start(&limiter, &mut store, request("high"), at(T0));
    let r = reply(&step);
    assert_eq!(r.status, 503);
    let retry: u64 = r
        .headers
        .iter()
        .find(|h| h.0 == "retry-after")
        .unwrap()
        .1
        .parse()
        .unwrap();
    assert!((1..=2).contains(&retry));
    let body: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(body["error"], "overloaded");
    assert_eq!(body["reason"], "concurrency");
    assert_eq!(body["class"], "high");
    assert_eq!(body["bulkhead"], "api");
    assert!(effects
        .iter()
        .any(|e| matches!(e, Effect::Shed { would: false, .. })));
    assert_eq!(
        in_flight(&limiter, &mut store),
        4,
        "a shed request holds nothing"
    );

    // Ends however they end: with a response, or none at all (a reset).
    let mut first = admitted.remove(0);
    first.responded(200, T0 + 30 * MS);
    let effects = first.finish(&limiter, &mut store);
    assert!(effects.contains(&Effect::Finished {
        bulkhead: 0,
        latency_us: 30 * MS,
        status: 200,
        grpc_status: None,
    }));
    assert!(
        first.finish(&limiter, &mut store).is_empty(),
        "a second end does nothing"
    );
    for mut ex in admitted {
        assert!(
            ex.finish(&limiter, &mut store).is_empty(),
            "no response, no sample"
        );
    }
    assert_eq!(in_flight(&limiter, &mut store), 0);
    let (_, step, _) = start(&limiter, &mut store, request("high"), at(T0));
    assert_eq!(step, Step::Continue);
}

#[test]
fn each_class_is_shed_above_its_own_share_and_critical_never() {
    let limiter = static_limit(10);
    let mut store = MemoryStore::default();
    let mut held = Vec::new();
    let mut admit = |class: &str, store: &mut MemoryStore| {
        let (ex, step, _) = start(&limiter, store, request(class), at(T0));
        held.push(ex);
        step
    };
    for _ in 0..7 {
        assert_eq!(admit("low", &mut store), Step::Continue);
    }
    let step = admit("low", &mut store);
    assert_eq!(reply(&step).status, 503, "low stops at 70%");
    assert!(reply(&step).body.contains("\"priority\""));
    assert_eq!(admit("high", &mut store), Step::Continue);
    assert_eq!(admit("high", &mut store), Step::Continue);
    assert_eq!(
        reply(&admit("high", &mut store)).status,
        503,
        "high stops at 90%"
    );
    // An unknown class is the default (basic, 80%): shed too.
    assert_eq!(reply(&admit("nonsense", &mut store)).status, 503);
    for _ in 0..5 {
        assert_eq!(admit("critical", &mut store), Step::Continue);
    }
    assert_eq!(
        in_flight(&limiter, &mut store),
        14,
        "critical is counted, never shed"
    );
}

#[test]
fn a_route_can_name_the_class_of_requests_the_header_does_not() {
    let limiter = build(
        r#"{"shedding": {"class_header": "x-class", "default_class": "free",
            "class_routes": [{"match": {"path_prefix": "/api/checkout"}, "class": "critical"}],
            "bulkheads": [{"name": "api", "limit": {"static": 1}}]}}"#,
    );
    let mut store = MemoryStore::default();
    let (_held, _, _) = start(&limiter, &mut store, PlainRequest::get("/api/x"), at(T0));
    let (_, step, _) = start(&limiter, &mut store, PlainRequest::get("/api/x"), at(T0));
    assert!(reply(&step).body.contains("\"class\":\"free\""));
    let (_, step, _) = start(
        &limiter,
        &mut store,
        PlainRequest::get("/api/checkout/pay"),
        at(T0),
    );
    assert_eq!(step, Step::Continue, "the route's class: critical");
    // The trusted header wins over the route.
    let named = PlainRequest::get("/api/checkout/pay").with_header("x-class", "free");
    let (_, step, _) = start(&limiter, &mut store, named, at(T0));
    assert_eq!(reply(&step).status, 503);
    let bad = r#"{"shedding": {"class_routes": [{"match": {}, "class": "gold"}], "bulkheads": [{"name": "a", "limit": {"static": 1}}]}}"#;
    assert_eq!(
        sluice_core::parse(bad.as_bytes()).unwrap_err().field,
        "shedding.class_routes[0].class"
    );
}

#[test]
fn health_checks_and_requests_of_no_bulkhead_are_neither_shed_nor_counted() {
    let limiter = static_limit(1);
    let mut store = MemoryStore::default();
    let (_held, step, _) = start(&limiter, &mut store, request("critical"), at(T0));
    assert_eq!(step, Step::Continue);
    for path in ["/healthz", "/other"] {
        let (_, step, effects) = start(&limiter, &mut store, PlainRequest::get(path), at(T0));
        assert_eq!(step, Step::Continue, "{path}");
        assert!(!effects.iter().any(|e| matches!(e, Effect::Admitted { .. })));
    }
    assert_eq!(in_flight(&limiter, &mut store), 1);

    // bypass.paths skip shedding as they skip rules; bypass.cidrs only skip rules.
    let bypassing = build(
        r#"{"bypass": {"paths": ["/status"], "cidrs": ["10.0.0.0/8"]},
            "shedding": {"bulkheads": [{"name": "a", "limit": {"static": 1}}]}}"#,
    );
    let mut store = MemoryStore::default();
    let (_held, step, _) = start(&bypassing, &mut store, PlainRequest::get("/x"), at(T0));
    assert_eq!(step, Step::Continue);
    let (_, step, _) = start(&bypassing, &mut store, PlainRequest::get("/status"), at(T0));
    assert_eq!(step, Step::Continue);
    let mut trusted = PlainRequest::get("/x").from_ip("10.1.2.3");
    let step = Exchange::start(
        &bypassing,
        &mut trusted,
        "10.1.2.3".parse().ok(),
        at(T0),
        &mut store,
    )
    .1;
    assert_eq!(reply(&step).status, 503);
}

#[test]
fn the_degradation_header_names_the_level_and_overwrites_the_clients() {
    let limiter = static_limit_with_margin(10, 1.0);
    let mut store = MemoryStore::default();
    let (_, _, effects) = start(
        &limiter,
        &mut store,
        request("low").with_header("x-sluice-load-level", "critical"),
        at(T0),
    );
    assert!(effects.contains(&Effect::RequestHeader {
        name: "x-sluice-load-level".into(),
        value: "normal".into()
    }));
    // A fleet at 90%: high, and the expensive routes go first.
    let mut m = at(T0);
    m.fleet = Some(0.9);
    let (_, step, _) = start(
        &limiter,
        &mut store,
        PlainRequest::get("/api/search").with_header("x-class", "high"),
        m,
    );
    assert!(reply(&step).body.contains("\"degraded\""), "{step:?}");
    let (_, step, _) = start(&limiter, &mut store, request("premium"), m);
    assert_eq!(reply(&step).status, 503, "shed at or above its threshold");
    let (_, step, _) = start(&limiter, &mut store, request("enterprise"), m);
    assert_eq!(step, Step::Continue);
}

#[test]
fn the_fleet_level_sheds_the_classes_below_it_everywhere() {
    let limiter = static_limit_with_margin(100, 1.0);
    let mut store = MemoryStore::default();
    let mut m = at(T0);
    m.fleet = Some(0.75);
    let (_, step, _) = start(&limiter, &mut store, request("low"), m);
    assert!(reply(&step).body.contains("\"fleet\""));
    let (_, step, effects) = start(&limiter, &mut store, request("high"), m);
    assert_eq!(step, Step::Continue);
    assert!(effects.contains(&Effect::RequestHeader {
        name: "x-sluice-load-level".into(),
        value: "elevated".into()
    }));
    // Without the fleet switch, the fleet level is ignored.
    let off = build(
        r#"{"shedding": {"fleet": false, "bulkheads": [{"name": "a", "limit": {"static": 100}}]}}"#,
    );
    let (_, step, _) = start(
        &off,
        &mut store,
        PlainRequest::get("/x").with_header("x-class", "free"),
        m,
    );
    assert_eq!(step, Step::Continue);
}

/// A fleet level far above the proxy's own utilization is not believed: at most its own plus
/// `fleet_margin` (default 0.3). Whoever holds a proxy credential can report 1.0 for the fleet;
/// an idle proxy then acts on 0.3, and sheds no class nor degrades.
#[test]
fn a_fleet_level_far_above_the_proxys_own_is_not_believed() {
    let limiter = static_limit(100);
    let shedding = limiter.policy().shedding.clone().unwrap();
    assert_eq!(shedding.fleet_margin, 0.3);
    let mut store = MemoryStore::default();
    let mut lie = at(T0);
    lie.fleet = Some(1.0);
    let (_, step, effects) = start(&limiter, &mut store, request("low"), lie);
    assert_eq!(step, Step::Continue, "an idle proxy does not believe 1.0");
    assert!(effects.contains(&Effect::RequestHeader {
        name: "x-sluice-load-level".into(),
        value: "normal".into()
    }));
    let search = PlainRequest::get("/api/search").with_header("x-class", "low");
    assert_eq!(start(&limiter, &mut store, search, lie).1, Step::Continue);

    // What is believed: at most the bulkhead's smoothed utilization plus the margin.
    let gauge = |use_milli| shed::Gauge {
        use_milli,
        ..shed::Gauge::default()
    };
    let believed = |margin: f64, use_milli, fleet| {
        let shedding = shed::Shedding {
            fleet_margin: margin,
            ..shedding.clone()
        };
        shed::admission::believed_fleet(&shedding, &gauge(use_milli), fleet)
    };
    assert_eq!(believed(0.3, 0, Some(1.0)), Some(0.3));
    assert_eq!(believed(0.3, 500, Some(1.0)), Some(0.8));
    assert_eq!(
        believed(0.3, 500, Some(0.6)),
        Some(0.6),
        "a level near its own"
    );
    assert_eq!(believed(0.3, 0, Some(0.1)), Some(0.1));
    assert_eq!(
        believed(1.0, 0, Some(0.9)),
        Some(0.9),
        "1 believes it fully"
    );
    assert_eq!(believed(0.0, 400, Some(0.9)), Some(0.4), "0: its own only");
    assert_eq!(believed(0.3, 0, None), None);
    // what no service sends, in case: out of [0, 1] is clamped, NaN ignored
    assert_eq!(believed(1.0, 0, Some(7.0)), Some(1.0));
    assert_eq!(believed(1.0, 0, Some(-1.0)), Some(0.0));
    assert_eq!(believed(1.0, 0, Some(f64::NAN)), None);

    // A proxy at half its limit believes up to 0.8: the low class (0.7) goes by the fleet.
    let limiter = static_limit(10);
    let mut store = MemoryStore::default();
    let held: Vec<_> = (0..5)
        .map(|_| start(&limiter, &mut store, request("high"), at(T0)).0)
        .collect();
    let shedding = limiter.policy().shedding.clone().unwrap();
    let mut samples = vec![Samples::default()];
    for i in 0..40 {
        shed::tick(&shedding, &mut samples, T0 + i * 100 * MS, 0.5, &mut store);
    }
    let use_milli = gauge_of(&limiter, &mut store).use_milli;
    assert!((450..=500).contains(&use_milli), "{use_milli}");
    let mut busy = at(T0 + 4_000 * MS);
    busy.fleet = Some(1.0);
    let (_, step, _) = start(&limiter, &mut store, request("low"), busy);
    assert!(reply(&step).body.contains("\"fleet\""), "{step:?}");
    let (_, step, _) = start(&limiter, &mut store, request("high"), busy);
    assert_eq!(step, Step::Continue, "0.9 is above 0.8");
    drop(held);
}

fn gauge_of(limiter: &Limiter, store: &mut MemoryStore) -> shed::Gauge {
    gauge(limiter.policy().shedding.as_ref().unwrap(), 0, store)
}

#[test]
fn a_request_whose_deadline_is_shorter_than_the_upstreams_latency_is_shed_at_once() {
    let limiter = static_limit(100);
    let shedding = limiter.policy().shedding.clone().unwrap();
    let mut store = MemoryStore::default();
    // Teach the gauge a 200 ms latency through the tick.
    let mut samples = vec![Samples::default()];
    for _ in 0..10 {
        samples[0].answered(200 * MS, 200, None);
    }
    shed::tick(&shedding, &mut samples, T0, 0.5, &mut store);
    shed::tick(&shedding, &mut samples, T0 + 200 * MS, 0.5, &mut store);
    assert_eq!(gauge(&shedding, 0, &mut store).rtt_us, 200_000);
    let short = request("high").with_header("x-envoy-expected-rq-timeout-ms", "50");
    let (_, step, _) = start(&limiter, &mut store, short, at(T0));
    assert!(reply(&step).body.contains("\"deadline\""));
    let grpc = request("high").with_header("grpc-timeout", "100m");
    let (_, step, _) = start(&limiter, &mut store, grpc, at(T0));
    assert_eq!(reply(&step).status, 503);
    let long = request("high").with_header("grpc-timeout", "2S");
    assert_eq!(start(&limiter, &mut store, long, at(T0)).1, Step::Continue);
    // No header of its own: the bulkhead's timeout (1 s) is its deadline.
    assert_eq!(
        start(&limiter, &mut store, request("high"), at(T0)).1,
        Step::Continue
    );

    assert_eq!(grpc_timeout_us("1H"), Some(3_600_000_000));
    assert_eq!(grpc_timeout_us("250u"), Some(250));
    assert_eq!(grpc_timeout_us("123456789S"), None, "at most 8 digits");
    assert_eq!(grpc_timeout_us("5x"), None);
    assert_eq!(grpc_timeout_us(""), None);
}

#[test]
fn a_failing_upstream_is_shed_by_its_success_rate() {
    let limiter = limiter(&shedding(
        r#"{"name": "api", "limit": {"static": 1000},
            "success_rate": {"threshold": 0.95, "min_requests": 10}}"#,
    ));
    let shedding = limiter.policy().shedding.clone().unwrap();
    let mut store = MemoryStore::default();
    let mut samples = vec![Samples::default()];
    for i in 0..100 {
        samples[0].answered(10 * MS, if i % 2 == 0 { 500 } else { 200 }, None);
    }
    shed::tick(&shedding, &mut samples, T0, 0.5, &mut store);
    shed::tick(&shedding, &mut samples, T0 + 100 * MS, 0.5, &mut store);
    let ppm = gauge(&shedding, 0, &mut store).reject_ppm;
    assert!((400_000..550_000).contains(&ppm), "{ppm}");
    let mut shed = 0;
    for i in 0..100 {
        let mut m = at(T0);
        m.draw = i as f64 / 100.0;
        let (mut ex, step, _) = start(&limiter, &mut store, request("high"), m);
        if let Step::Respond(r) = &step {
            assert!(r.body.contains("\"errors\""));
            shed += 1;
        }
        ex.finish(&limiter, &mut store);
    }
    assert!((40..=55).contains(&shed), "{shed}");
    // critical is never shed, whatever the success rate.
    let mut m = at(T0);
    m.draw = 0.0;
    assert_eq!(
        start(&limiter, &mut store, request("critical"), m).1,
        Step::Continue
    );
}

#[test]
fn monitor_counts_what_it_would_shed_and_warn_tells_the_upstream_and_the_client() {
    for (mode, header) in [("monitor", false), ("warn", true)] {
        let limiter = limiter(&format!(
            r#"{{"shedding": {{"mode": "{mode}", "bulkheads": [{{"name": "a", "limit": {{"static": 1}}}}]}}}}"#
        ));
        let mut store = MemoryStore::default();
        let (_a, step, _) = start(&limiter, &mut store, PlainRequest::get("/x"), at(T0));
        assert_eq!(step, Step::Continue);
        let (mut b, step, effects) = start(&limiter, &mut store, PlainRequest::get("/x"), at(T0));
        assert_eq!(step, Step::Continue, "{mode} never sheds");
        assert!(
            effects
                .iter()
                .any(|e| matches!(e, Effect::Shed { would: true, .. })),
            "{mode}"
        );
        let warned = effects.iter().any(
            |e| matches!(e, Effect::RequestHeader { name, .. } if name == "x-sluice-would-shed"),
        );
        assert_eq!(warned, header, "{mode}");
        let response = b.response_headers(&limiter);
        assert_eq!(
            response.iter().any(|h| h.0 == "x-sluice-would-shed"),
            header,
            "{mode}"
        );
        assert_eq!(in_flight(&limiter, &mut store), 2, "admitted, so counted");
    }
}

#[test]
fn a_rate_limited_request_gives_its_slot_back_at_once() {
    let limiter = limiter(
        r#"{"rules": [{"name": "r", "key": ["const:all"], "limits": [{"requests": 1, "per": "minute"}]}],
            "shedding": {"bulkheads": [{"name": "a", "limit": {"static": 10}}]}}"#,
    );
    let mut store = MemoryStore::default();
    let (_held, step, _) = start(&limiter, &mut store, PlainRequest::get("/x"), at(T0));
    assert_eq!(step, Step::Continue);
    let (_, step, _) = start(&limiter, &mut store, PlainRequest::get("/x"), at(T0));
    assert_eq!(reply(&step).status, 429);
    assert_eq!(in_flight(&limiter, &mut store), 1);
}

#[test]
fn the_queue_waits_for_a_slot_most_important_first_and_sheds_what_waits_too_long() {
    let limiter = limiter(&shedding(
        r#"{"name": "api", "limit": {"static": 2},
            "queue": {"size": 2, "max_wait_ms": 50, "drop": "oldest"}}"#,
    ));
    let shedding = limiter.policy().shedding.clone().unwrap();
    let mut store = MemoryStore::default();
    let (mut a, _, _) = start(&limiter, &mut store, request("critical"), at(T0));
    let (_b, _, _) = start(&limiter, &mut store, request("critical"), at(T0));
    let mut queue = WaitQueue::default();
    let mut waiting = Vec::new();
    for (id, class) in [(1, "low"), (2, "high"), (3, "high")] {
        let (ex, step, _) = start(&limiter, &mut store, request(class), at(T0 + id as u64));
        let Step::Queue {
            seat,
            wait_budget_us,
            ..
        } = step
        else {
            panic!("{step:?}");
        };
        let queued = queue.push(
            &shedding,
            id,
            seat,
            T0 + id as u64,
            wait_budget_us,
            &mut store,
        );
        waiting.push((id, ex, queued));
    }
    assert_eq!(waiting[0].2, Queued::Waiting);
    assert_eq!(waiting[1].2, Queued::Waiting);
    let Queued::Evicted(old) = waiting[2].2 else {
        panic!("{:?}", waiting[2].2)
    };
    assert_eq!(old.id, 1, "the oldest leaves a full queue");
    // Nothing frees: nobody gets in.
    assert!(queue.admit(&shedding, None, &mut store).is_empty());
    // One slot frees: the high waiters are at 1 of 2, under 90%.
    a.finish(&limiter, &mut store);
    let seated = queue.admit(&shedding, None, &mut store);
    assert_eq!(seated.iter().map(|w| w.id).collect::<Vec<_>>(), vec![2]);
    let (_, mut ex2, _) = waiting.remove(1);
    ex2.seated(T0 + 10 * MS);
    assert!(ex2.holds_slot());
    // The other waits past its 50 ms and is shed.
    assert!(queue
        .expired(&shedding, T0 + 40 * MS, &mut store)
        .is_empty());
    let gone = queue.expired(&shedding, T0 + 60 * MS, &mut store);
    assert_eq!(gone.iter().map(|w| w.id).collect::<Vec<_>>(), vec![3]);
    assert!(queue.is_empty());
    assert_eq!(in_flight(&limiter, &mut store), 2);

    // drop: newest keeps the waiters and sheds the newcomer.
    let newest = limiter_with_drop("newest");
    let s = newest.policy().shedding.clone().unwrap();
    let mut q = WaitQueue::default();
    let seat = Seat {
        bulkhead: 0,
        class: 0,
    };
    let mut store = MemoryStore::default();
    assert_eq!(q.push(&s, 1, seat, T0, None, &mut store), Queued::Waiting);
    assert_eq!(q.push(&s, 2, seat, T0, None, &mut store), Queued::Full);
    // A deadline that leaves no time to wait: no queue.
    assert_eq!(q.push(&s, 3, seat, T0, Some(0), &mut store), Queued::Full);
    assert_eq!(gauge(&s, 0, &mut store).waiting(0), 1);
    assert_eq!(q.remove(&s, 1, &mut store).map(|w| w.id), Some(1));
    assert_eq!(
        gauge(&s, 0, &mut store).waiting(0),
        0,
        "counted out as it leaves"
    );
}

#[test]
fn a_newcomer_does_not_take_a_slot_a_waiter_of_its_class_could_take() {
    let limiter = limiter(&shedding(
        r#"{"name": "api", "limit": {"static": 2}, "queue": {"size": 8, "max_wait_ms": 100}}"#,
    ));
    let shedding = limiter.policy().shedding.clone().unwrap();
    let mut store = MemoryStore::default();
    let (mut a, _, _) = start(&limiter, &mut store, request("critical"), at(T0));
    let (mut b, _, _) = start(&limiter, &mut store, request("critical"), at(T0));
    let mut queue = WaitQueue::default();
    let (_, step, _) = start(&limiter, &mut store, request("high"), at(T0));
    let Step::Queue { seat, .. } = step else {
        panic!("{step:?}")
    };
    assert_eq!(
        queue.push(&shedding, 7, seat, T0, None, &mut store),
        Queued::Waiting
    );
    // A slot frees before the waiter's worker ticks: a newcomer of the same class queues
    // behind the waiter, and so does a less important one; a more important one does not wait.
    a.finish(&limiter, &mut store);
    let (_, step, _) = start(&limiter, &mut store, request("high"), at(T0 + MS));
    assert!(matches!(step, Step::Queue { .. }), "{step:?}");
    let (_, step, _) = start(&limiter, &mut store, request("low"), at(T0 + MS));
    assert!(
        matches!(step, Step::Queue { .. } | Step::Respond(_)),
        "{step:?}"
    );
    let (_, step, _) = start(&limiter, &mut store, request("critical"), at(T0 + MS));
    assert_eq!(step, Step::Continue);
    // The waiter is seated at its tick: it is counted out and in flight.
    let (mut c, _, _) = start(&limiter, &mut store, request("critical"), at(T0 + MS));
    c.finish(&limiter, &mut store);
    let seated = queue.admit(&shedding, None, &mut store);
    assert!(
        seated.is_empty(),
        "critical took the slot: 3 in flight of 2"
    );
    let g = gauge(&shedding, 0, &mut store);
    assert_eq!(g.waiting(seat.class), 1);
    b.finish(&limiter, &mut store);
    let seated = queue.admit(&shedding, None, &mut store);
    assert_eq!(seated.iter().map(|w| w.id).collect::<Vec<_>>(), vec![7]);
    let g = gauge(&shedding, 0, &mut store);
    assert_eq!((g.in_flight, g.waiting(seat.class)), (2, 0));
}

fn limiter_with_drop(drop: &str) -> Limiter {
    limiter(&format!(
        r#"{{"shedding": {{"bulkheads": [{{"name": "a", "limit": {{"static": 1}},
            "queue": {{"size": 1, "max_wait_ms": 10, "drop": "{drop}"}}}}]}}}}"#
    ))
}

#[test]
fn a_queued_request_that_is_rate_limited_never_waits() {
    let limiter = limiter(
        r#"{"rules": [{"name": "r", "key": ["const:all"], "limits": [{"requests": 1, "per": "minute"}]}],
            "shedding": {"bulkheads": [{"name": "a", "limit": {"static": 1},
                "queue": {"size": 8, "max_wait_ms": 100}}]}}"#,
    );
    let mut store = MemoryStore::default();
    let (_held, step, _) = start(&limiter, &mut store, PlainRequest::get("/x"), at(T0));
    assert_eq!(step, Step::Continue);
    let (_, step, _) = start(&limiter, &mut store, PlainRequest::get("/x"), at(T0));
    assert_eq!(reply(&step).status, 429);
}

/// An upstream with `workers` slots and a fixed service time, offered `rate` requests per
/// second through sluice's adaptive limit, simulated on a virtual clock: every admitted
/// request's latency is its wait behind the workers plus the service time.
#[test]
fn the_adaptive_limit_keeps_the_upstream_near_its_capacity_under_three_times_its_load() {
    let limiter = limiter(&shedding(
        r#"{"name": "api", "limit": {"adaptive": {"min": 2, "max": 200, "initial": 50,
            "tolerance": 1.5, "window_ms": 100}}}"#,
    ));
    let shedding = limiter.policy().shedding.clone().unwrap();
    let mut store = MemoryStore::default();
    let (workers, service_us) = (8usize, 25 * MS);
    let capacity = workers as f64 / (service_us as f64 / 1e6); // 320/s
    let rate = 3.0 * capacity;
    let step_us = (1e6 / rate) as u64;
    let mut samples = vec![Samples::default()];
    // Each worker is free from this time on; in flight: (exchange, completion time).
    let mut free_at = vec![T0; workers];
    let mut flying: Vec<(Exchange, u64)> = Vec::new();
    let (mut now, mut next_tick) = (T0, T0);
    let (mut served, mut latencies) = (0u64, Vec::new());
    let end = T0 + 30_000 * MS;
    while now < end {
        // Completions up to now.
        flying.retain_mut(|(ex, done)| {
            if *done <= now {
                ex.responded(200, *done);
                for e in ex.finish(&limiter, &mut store) {
                    if let Effect::Finished {
                        latency_us,
                        status,
                        grpc_status,
                        ..
                    } = e
                    {
                        samples[0].answered(latency_us, status, grpc_status);
                        if now > T0 + 10_000 * MS {
                            latencies.push(latency_us);
                            served += 1;
                        }
                    }
                }
                false
            } else {
                true
            }
        });
        if now >= next_tick {
            shed::tick(&shedding, &mut samples, now, 0.5, &mut store);
            next_tick += 10 * MS;
        }
        let (ex, step, _) = start(&limiter, &mut store, request("high"), at(now));
        if step == Step::Continue {
            let w = (0..workers).min_by_key(|&w| free_at[w]).unwrap();
            let begin = free_at[w].max(now);
            free_at[w] = begin + service_us;
            flying.push((ex, begin + service_us));
        }
        now += step_us;
    }
    let goodput = served as f64 / 20.0;
    latencies.sort_unstable();
    let p99 = latencies[latencies.len() * 99 / 100];
    assert!(
        goodput >= 0.9 * capacity,
        "goodput {goodput:.0}/s of {capacity:.0}/s"
    );
    assert!(p99 <= 2 * service_us, "p99 {p99} us");
    let limit = shed::admission::adaptive_limit(&shedding, 0, &mut store);
    assert!((8..=14).contains(&limit), "limit {limit}");
}

#[test]
fn configuration_errors_name_their_field() {
    let cases = [
        (r#"{"shedding": {"bulkheads": []}}"#, "shedding.bulkheads"),
        (
            r#"{"shedding": {"mode": "loud", "bulkheads": [{"name": "a", "limit": {"static": 1}}]}}"#,
            "shedding.mode",
        ),
        (
            r#"{"shedding": {"bulkheads": [{"name": "a", "limit": {"static": 0}}]}}"#,
            "shedding.bulkheads[0].limit.static",
        ),
        (
            r#"{"shedding": {"bulkheads": [{"name": "a", "limit": {"adaptive": {"min": 5, "max": 2}}}]}}"#,
            "shedding.bulkheads[0].limit.adaptive.max",
        ),
        (
            r#"{"shedding": {"bulkheads": [{"name": "a", "limit": {"static": 1}, "queue": {"size": 1, "max_wait_ms": 5, "drop": "random"}}]}}"#,
            "shedding.bulkheads[0].queue.drop",
        ),
        (
            r#"{"shedding": {"classes": {"gold": 1.5}, "bulkheads": [{"name": "a", "limit": {"static": 1}}]}}"#,
            "shedding.classes.gold",
        ),
        (
            r#"{"shedding": {"default_class": "gold", "bulkheads": [{"name": "a", "limit": {"static": 1}}]}}"#,
            "shedding.default_class",
        ),
        (
            r#"{"shedding": {"levels": {"elevated": 0.9, "high": 0.8, "critical": 0.95}, "bulkheads": [{"name": "a", "limit": {"static": 1}}]}}"#,
            "shedding.levels.high",
        ),
        (
            r#"{"shedding": {"bulkheads": [{"name": "a", "limit": {"static": 1}}, {"name": "a", "limit": {"static": 1}}]}}"#,
            "shedding.bulkheads[1].name",
        ),
        (
            r#"{"shedding": {"class_header": "x y", "bulkheads": [{"name": "a", "limit": {"static": 1}}]}}"#,
            "shedding.class_header",
        ),
        (
            r#"{"shedding": {"bulkheads": [{"name": "a", "limit": {"static": 1}, "match": {"path_prefix": "api"}}]}}"#,
            "shedding.bulkheads[0].match.path_prefix",
        ),
        (
            r#"{"shedding": {"bulkheads": [{"name": "a", "limit": {"static": 1}, "success_rate": {"threshold": 0}}]}}"#,
            "shedding.bulkheads[0].success_rate.threshold",
        ),
        (
            r#"{"shedding": {"bulkheads": [{"name": "a", "limit": {"static": 1}, "surprise": 1}]}}"#,
            "shedding.bulkheads[0]",
        ),
        (
            r#"{"shedding": {"fleet_margin": 1.5, "bulkheads": [{"name": "a", "limit": {"static": 1}}]}}"#,
            "shedding.fleet_margin",
        ),
        (
            r#"{"shedding": {"fleet_margin": -0.1, "bulkheads": [{"name": "a", "limit": {"static": 1}}]}}"#,
            "shedding.fleet_margin",
        ),
        (
            r#"{"shedding": {"fleet_margin": 1e999, "bulkheads": [{"name": "a", "limit": {"static": 1}}]}}"#,
            "shedding.fleet_margin",
        ),
        (
            r#"{"shedding": {"fleet_margin": "NaN", "bulkheads": [{"name": "a", "limit": {"static": 1}}]}}"#,
            "shedding.fleet_margin",
        ),
    ];
    for (json, field) in cases {
        let error = sluice_core::parse(json.as_bytes()).unwrap_err();
        assert!(error.field.starts_with(field), "{json}: {error}");
    }
    assert!(
        sluice_core::parse(br#"{}"#).is_err(),
        "neither rules nor shedding"
    );
}

#[test]
fn a_sync_round_carries_the_load_even_with_no_key_to_report() {
    let limiter = limiter(
        r#"{"service": {"cluster": "svc"}, "shedding": {"bulkheads": [{"name": "a", "limit": {"static": 4}}]}}"#,
    );
    assert!(limiter.policy().needs_service());
    let mut store = MemoryStore::default();
    let (_held, _, _) = start(&limiter, &mut store, PlainRequest::get("/x"), at(T0));
    let mut waiting = sluice_core::sync::outbox::Pending::default();
    let batch =
        sluice_core::sync::round::compose(&limiter, &mut waiting, "p", 100, &mut store).unwrap();
    assert!(batch.request.entries.is_empty());
    let load = batch.request.load.unwrap();
    assert_eq!(load.utilization, 0.25);
    let _ = store.get("x");
}

/// A waiter is seated by the fleet level it believes, as a newcomer is admitted: a lie of 1.0
/// does not keep an idle proxy's waiters out of free slots.
#[test]
fn a_waiter_is_seated_despite_a_fleet_level_it_does_not_believe() {
    let limiter = limiter(&shedding(
        r#"{"name": "api", "limit": {"static": 2}, "queue": {"size": 8, "max_wait_ms": 100}}"#,
    ));
    let shedding = limiter.policy().shedding.clone().unwrap();
    let mut store = MemoryStore::default();
    let (mut a, _, _) = start(&limiter, &mut store, request("critical"), at(T0));
    let (_b, _, _) = start(&limiter, &mut store, request("critical"), at(T0));
    let mut queue = WaitQueue::default();
    let (_, step, _) = start(&limiter, &mut store, request("high"), at(T0));
    let Step::Queue { seat, .. } = step else {
        panic!("{step:?}")
    };
    assert_eq!(
        queue.push(&shedding, 7, seat, T0, None, &mut store),
        Queued::Waiting
    );
    a.finish(&limiter, &mut store);
    // 1 of 2 in flight, never ticked (its smoothed utilization 0): it believes 0.3 of the 1.0
    let seated = queue.admit(&shedding, Some(1.0), &mut store);
    assert_eq!(seated.iter().map(|w| w.id).collect::<Vec<_>>(), vec![7]);
    assert_eq!(in_flight(&limiter, &mut store), 2);
}

#[test]
fn a_full_queue_sheds_the_newcomer_in_core_and_gives_back_its_spend() {
    let limiter = limiter(
        r#"{"rules": [{"name": "r", "key": ["const:all"], "limits": [{"requests": 3, "per": "hour"}]}],
            "shedding": {"bulkheads": [{"name": "a", "limit": {"static": 1},
                "queue": {"size": 1, "max_wait_ms": 100, "drop": "newest"}}]}}"#,
    );
    let mut store = MemoryStore::default();
    let (_held, step, _) = start(&limiter, &mut store, PlainRequest::get("/x"), at(T0));
    assert_eq!(step, Step::Continue);
    let (mut refused, step, _) = start(&limiter, &mut store, PlainRequest::get("/x"), at(T0));
    let Step::Queue { seat, level, .. } = step else {
        panic!("{step:?}");
    };
    let (shed_seat, reply) = refused
        .queue_full(&limiter, level, 0.5, &mut store)
        .expect("a waiting request is shed");
    assert_eq!(shed_seat, seat);
    assert_eq!(reply.status, 503);
    assert!(
        reply.body.contains(r#""reason":"queue_full""#),
        "{}",
        reply.body
    );
    assert_eq!(refused.waiting(), None);
    // Its token came back: the rule still admits two more after the one held.
    for _ in 0..2 {
        let (_, step, _) = start(&limiter, &mut store, PlainRequest::get("/y"), at(T0));
        assert!(matches!(step, Step::Queue { .. }), "{step:?}");
    }
    // Not waiting: nothing to shed.
    assert!(refused
        .queue_full(&limiter, level, 0.5, &mut store)
        .is_none());
}

/// A store whose first read of `key` answers `stale` instead: another worker's tick read the gauge
/// before this one's window ended and published a new limit.
struct StaleRead {
    inner: MemoryStore,
    key: String,
    stale: Option<Vec<u8>>,
}

impl Store for StaleRead {
    fn get(&mut self, key: &str) -> Result<Option<(Vec<u8>, u32)>, sluice_core::StoreError> {
        if key == self.key {
            if let Some(stale) = self.stale.take() {
                let version = self.inner.get(key)?.map_or(0, |(_, v)| v);
                return Ok(Some((stale, version)));
            }
        }
        self.inner.get(key)
    }

    fn set(
        &mut self,
        key: &str,
        value: &[u8],
        version: u32,
    ) -> Result<bool, sluice_core::StoreError> {
        self.inner.set(key, value, version)
    }
}

/// Just after a probe, a worker whose tick read the gauge while it still said the probe's `min` (2) folds
/// its 4 in flight into the new window: measured against the restored limit (20) that is a fifth of it,
/// which moves nothing; against the stale `min` it read as twice the limit, a busy window, and the limit
/// grew by one each time (20 to 21: seen in real Envoy on a busy machine, between two probes of 4 in
/// flight).
#[test]
fn a_stale_gauge_after_a_probe_does_not_move_the_restored_limit() {
    use sluice_core::shed::state::Window;
    let limiter = limiter(&shedding(
        r#"{"name": "api", "limit": {"adaptive": {"min": 2, "max": 40, "initial": 20,
            "window_ms": 100, "probe_interval_ms": 60000}}}"#,
    ));
    let shedding = limiter.policy().shedding.clone().unwrap();
    let spec = &shedding.bulkheads[0];
    let mut inner = MemoryStore::default();
    // The window as the probe's end left it: the limit back at 20, the next probe a minute on.
    let window = Window {
        started_us: T0 as f64,
        control: sluice_core::shed::controller::ControlState {
            limit: 20.0,
            baseline_us: 5_000.0,
            next_probe_us: (T0 + 60_000 * MS) as f64,
            ..Default::default()
        },
        ..Window::default()
    };
    assert!(inner.set(&spec.window_key, &window.encode(), 0).unwrap());
    let gauge = |limit: u32| {
        shed::Gauge {
            in_flight: 4,
            limit,
            ..shed::Gauge::default()
        }
        .encode()
    };
    assert!(inner.set(&spec.gauge_key, &gauge(20), 0).unwrap());
    let mut store = StaleRead {
        inner,
        key: spec.gauge_key.clone(),
        stale: Some(gauge(2)),
    };
    // Answers at 5 ms, enough of them to move the limit if the window counted as busy.
    let mut samples = vec![Samples::default()];
    for _ in 0..10 {
        samples[0].answered(5_000, 200, None);
    }
    shed::tick(&shedding, &mut samples, T0 + 50 * MS, 0.5, &mut store);
    let folded = Window::decode(&store.inner.get(&spec.window_key).unwrap().unwrap().0);
    assert!(
        (folded.peak_use - 0.2).abs() < 1e-9,
        "4 in flight of 20, whatever the gauge said when read: {}",
        folded.peak_use
    );
    let mut samples = vec![Samples::default()];
    shed::tick(&shedding, &mut samples, T0 + 100 * MS, 0.5, &mut store);
    let ended = Window::decode(&store.inner.get(&spec.window_key).unwrap().unwrap().0);
    assert_eq!(
        ended.control.limit, 20.0,
        "a window at a fifth of the limit moves nothing"
    );
}
