//! A guaranteed share per class, as Netflix's partitioned limiter: a class under its share of a
//! bulkhead's limit is never shed for `concurrency` or `priority`, even with the bulkhead full;
//! past it, it is shed as any class. Its requests are counted by class in the shared gauge,
//! given back however they end.

use sluice_core::shed::admission::gauge;
use sluice_core::{Effect, Exchange, Limiter, MemoryStore, Moment, PlainRequest, Step};

const T0: u64 = 1_700_000_000_000_000;

fn limiter(guaranteed: &str) -> Limiter {
    let json = format!(
        r#"{{"shedding": {{"class_header": "x-class", "classes": {{"basic": 1.0}}, {guaranteed}
            "bulkheads": [{{"name": "api", "limit": {{"static": 10}}}}]}}}}"#
    );
    Limiter::new(sluice_core::parse(json.as_bytes()).unwrap())
}

fn start(limiter: &Limiter, store: &mut MemoryStore, class: &str) -> (Exchange, Step) {
    let mut req = PlainRequest::get("/x").with_header("x-class", class);
    let (ex, step, _): (Exchange, Step, Vec<Effect>) =
        Exchange::start(limiter, &mut req, None, Moment::at(T0), store);
    (ex, step)
}

fn reason(step: &Step) -> Option<String> {
    match step {
        Step::Respond(r) if r.status == 503 => r
            .headers
            .iter()
            .find(|(n, _)| *n == "x-sluice-shed")
            .map(|(_, v)| v.to_string()),
        _ => None,
    }
}

#[test]
fn a_class_under_its_guaranteed_share_takes_a_slot_from_a_full_bulkhead() {
    // premium (0.9) is guaranteed 20% of the 10 slots: 2.
    let limiter = limiter(r#""guaranteed": {"premium": 0.2},"#);
    let s = limiter.policy().shedding.clone().unwrap();
    let mut store = MemoryStore::default();
    let mut held: Vec<Exchange> = (0..10)
        .map(|_| start(&limiter, &mut store, "basic").0)
        .collect();
    assert_eq!(gauge(&s, 0, &mut store).in_flight, 10);
    let (_, step) = start(&limiter, &mut store, "basic");
    assert_eq!(reason(&step).as_deref(), Some("concurrency"));
    for i in 0..2 {
        let (ex, step) = start(&limiter, &mut store, "premium");
        assert_eq!(
            step,
            Step::Continue,
            "premium {i}: within its 2 guaranteed slots"
        );
        held.push(ex);
    }
    let (_, step) = start(&limiter, &mut store, "premium");
    assert_eq!(
        reason(&step).as_deref(),
        Some("concurrency"),
        "past its share"
    );
    let g = gauge(&s, 0, &mut store);
    assert_eq!(
        (g.in_flight, g.class_in_flight(2)),
        (12, 2),
        "over the limit by the guarantee at most"
    );
    // Its slots come back however the streams end; then it has its share again.
    for mut ex in held.drain(10..) {
        ex.finish(&limiter, &mut store);
    }
    assert_eq!(gauge(&s, 0, &mut store).class_in_flight(2), 0);
    let (_, step) = start(&limiter, &mut store, "premium");
    assert_eq!(step, Step::Continue);
}

#[test]
fn without_a_guarantee_the_full_bulkhead_sheds_the_class_and_counts_no_class() {
    let limiter = limiter("");
    let s = limiter.policy().shedding.clone().unwrap();
    let mut store = MemoryStore::default();
    let _held: Vec<Exchange> = (0..10)
        .map(|_| start(&limiter, &mut store, "basic").0)
        .collect();
    let (_, step) = start(&limiter, &mut store, "premium");
    assert_eq!(reason(&step).as_deref(), Some("concurrency"));
    let g = gauge(&s, 0, &mut store);
    assert!(
        g.class_in_flight.is_empty(),
        "the gauge keeps its old layout: {g:?}"
    );
}

#[test]
fn a_guarantee_also_lifts_the_classes_own_threshold() {
    // free is shed from 70% (7 of 10); guaranteed 50% (5) it takes 5 even at 9 in flight.
    let limiter = limiter(r#""guaranteed": {"free": 0.5},"#);
    let mut store = MemoryStore::default();
    let _held: Vec<Exchange> = (0..9)
        .map(|_| start(&limiter, &mut store, "basic").0)
        .collect();
    let admitted = (0..6)
        .map(|_| start(&limiter, &mut store, "free"))
        .filter(|(_, step)| *step == Step::Continue)
        .count();
    assert_eq!(admitted, 5);
}

/// Whoever writes the configuration: shares past the whole limit, of unknown classes, out of range.
#[test]
fn guaranteed_errors_name_their_field() {
    let cases = [
        (
            r#""guaranteed": {"premium": 0.7, "free": 0.4},"#,
            "shedding.guaranteed: the shares add up to 1.1",
        ),
        (
            r#""guaranteed": {"gold": 0.2},"#,
            "shedding.guaranteed.gold: \"gold\" is not a class",
        ),
        (
            r#""guaranteed": {"free": 0},"#,
            "shedding.guaranteed.free: must be between 0.01 and 1, got 0",
        ),
        (
            r#""guaranteed": {"free": -1},"#,
            "shedding.guaranteed.free: must be between 0.01 and 1",
        ),
        (
            r#""guaranteed": {"free": 1e308},"#,
            "shedding.guaranteed.free: must be between 0.01 and 1",
        ),
        (
            r#""guaranteed": {"free": "all"},"#,
            "shedding.guaranteed.free: invalid type",
        ),
    ];
    for (guaranteed, expected) in cases {
        let json = format!(
            r#"{{"shedding": {{{guaranteed} "bulkheads": [{{"name": "a", "limit": {{"static": 1}}}}]}}}}"#
        );
        let error = sluice_core::parse(json.as_bytes()).unwrap_err().to_string();
        assert!(error.starts_with(expected), "{guaranteed}: {error}");
    }
    let three = r#"{"shedding": {"guaranteed": {"free": 0.7, "basic": 0.2, "premium": 0.1},
        "bulkheads": [{"name": "a", "limit": {"static": 1}}]}}"#;
    assert!(
        sluice_core::parse(three.as_bytes()).is_ok(),
        "they add up to 1"
    );
}
