//! Per-key concurrency in core: a key's requests in flight bounded, the slot given back however
//! the stream ends, a lost release bounded by `max_hold`, and what the configuration refuses.

use sluice_core::{Exchange, Limiter, MemoryStore, Moment, PlainRequest, Step};

const SECOND: u64 = 1_000_000;
const T0: u64 = 1_700_000_000 * SECOND;

fn limiter(json: &str) -> Limiter {
    Limiter::new(sluice_core::parse(json.as_bytes()).unwrap())
}

fn user(name: &str) -> PlainRequest {
    PlainRequest::get("/api/x").with_header("x-user", name)
}

fn start(limiter: &Limiter, store: &mut MemoryStore, who: &str, now_us: u64) -> (Exchange, Step) {
    let (exchange, step, _) =
        Exchange::start(limiter, &mut user(who), None, Moment::at(now_us), store);
    (exchange, step)
}

const TWO: &str = r#"{"headers": "both", "rules": [{"name": "inflight", "key": ["header:x-user"],
    "limits": [{"concurrent": 2, "max_hold": "30s"}]}]}"#;

#[test]
fn a_key_holds_at_most_its_slots_and_each_end_gives_one_back() {
    let limiter = limiter(TWO);
    let mut store = MemoryStore::default();
    let (mut a, step) = start(&limiter, &mut store, "alice", T0);
    assert_eq!(step, Step::Continue);
    let headers = a.response_headers(&limiter);
    assert!(
        headers.contains(&("x-ratelimit-remaining", "1".to_string())),
        "{headers:?}"
    );
    let (mut b, step) = start(&limiter, &mut store, "alice", T0 + 1);
    assert_eq!(step, Step::Continue);
    let (_, step) = start(&limiter, &mut store, "alice", T0 + 2);
    let Step::Respond(reply) = step else {
        panic!("expected a 429, got {step:?}");
    };
    assert_eq!(reply.status, 429);
    assert_eq!(reply.headers.get("retry-after"), Some("1"));
    assert_eq!(reply.headers.get("x-ratelimit-remaining"), Some("0"));
    assert_eq!(
        reply.headers.get("ratelimit-policy"),
        Some("\"inflight\";q=2;qu=\"concurrent-requests\"")
    );
    assert!(
        reply
            .body
            .contains("too many requests in flight: at most 2 at once for rule inflight"),
        "{}",
        reply.body
    );
    // Another key has its own slots.
    assert_eq!(start(&limiter, &mut store, "bob", T0 + 3).1, Step::Continue);
    // One stream ends: one more of alice's is admitted, and then no more.
    a.finish(&limiter, &mut store);
    a.finish(&limiter, &mut store);
    let (_c, step) = start(&limiter, &mut store, "alice", T0 + 4);
    assert_eq!(step, Step::Continue, "a's slot came back");
    assert!(
        matches!(
            start(&limiter, &mut store, "alice", T0 + 5).1,
            Step::Respond(_)
        ),
        "finishing twice gives back one slot"
    );
    b.finish(&limiter, &mut store);
    assert_eq!(
        start(&limiter, &mut store, "alice", T0 + 6).1,
        Step::Continue
    );
}

#[test]
fn a_lost_release_holds_a_slot_until_max_hold_only() {
    let limiter = limiter(TWO);
    let mut store = MemoryStore::default();
    // Two streams whose ends are never seen (their worker crashed).
    let lost: Vec<_> = (0..2)
        .map(|i| start(&limiter, &mut store, "alice", T0 + i).0)
        .collect();
    assert!(matches!(
        start(&limiter, &mut store, "alice", T0 + 29 * SECOND).1,
        Step::Respond(_)
    ));
    let later = T0 + 31 * SECOND;
    let (_fresh, step) = start(&limiter, &mut store, "alice", later);
    assert_eq!(step, Step::Continue, "30 s later their slots lapsed");
    // Their late releases give back nothing of the new requests' slots.
    for mut exchange in lost {
        exchange.finish(&limiter, &mut store);
    }
    assert_eq!(
        start(&limiter, &mut store, "alice", later + 1).1,
        Step::Continue
    );
    assert!(matches!(
        start(&limiter, &mut store, "alice", later + 2).1,
        Step::Respond(_)
    ));
}

/// A request a later rule denies gives its slot back at once (the local reply), before its
/// stream's end; the denial's refund and the stream's end give back one slot, not two.
#[test]
fn a_request_another_rule_denies_gives_its_slot_back() {
    let json = r#"{"rules": [
        {"name": "inflight", "key": ["header:x-user"], "limits": [{"concurrent": 1}]},
        {"name": "rate", "key": ["header:x-user"], "limits": [{"requests": 1, "per": "hour"}]}]}"#;
    let limiter = limiter(json);
    let mut store = MemoryStore::default();
    let (mut first, step) = start(&limiter, &mut store, "alice", T0);
    assert_eq!(step, Step::Continue);
    first.finish(&limiter, &mut store);
    for i in 1..5 {
        let (mut denied, step) = start(&limiter, &mut store, "alice", T0 + i);
        let Step::Respond(reply) = step else {
            panic!("request {i}: expected the rate rule's 429, got {step:?}");
        };
        assert!(reply.body.contains("\"rule\":\"rate\""), "{}", reply.body);
        denied.finish(&limiter, &mut store);
    }
    // Had a denial kept its slot, the concurrency rule would deny now with its own body.
    let (_, step) = start(&limiter, &mut store, "alice", T0 + 10);
    let Step::Respond(reply) = step else {
        panic!("expected a 429, got {step:?}");
    };
    assert!(reply.body.contains("\"rule\":\"rate\""), "{}", reply.body);
}

/// Monitor mode admits what it would deny and counts it: no slot is taken beyond the limit,
/// and the ends of those requests free nothing of others.
#[test]
fn a_monitored_concurrent_rule_admits_and_keeps_its_count_honest() {
    let json = r#"{"rules": [{"name": "inflight", "mode": "monitor", "key": ["header:x-user"],
        "limits": [{"concurrent": 1}]}]}"#;
    let limiter = limiter(json);
    let mut store = MemoryStore::default();
    let (mut held, _) = start(&limiter, &mut store, "alice", T0);
    let (mut over, step) = start(&limiter, &mut store, "alice", T0 + 1);
    assert_eq!(step, Step::Continue, "monitor admits");
    over.finish(&limiter, &mut store);
    let (_, _, effects) = Exchange::start(
        &limiter,
        &mut user("alice"),
        None,
        Moment::at(T0 + 2),
        &mut store,
    );
    assert!(
        effects.iter().any(|e| matches!(
            e,
            sluice_core::Effect::Outcome {
                outcome: sluice_core::Outcome::ShadowDenied,
                ..
            }
        )),
        "the held slot is still held: {effects:?}"
    );
    held.finish(&limiter, &mut store);
}

/// What a configuration may not ask of a concurrent limit is refused, naming the field.
#[test]
fn unsupported_combinations_are_refused_with_the_field_named() {
    let service = r#""service": {"cluster": "sluice"}"#;
    let cases = [
        (
            format!(
                r#"{{{service}, "rules": [{{"name": "r", "key": ["client_ip"], "consistency": "cached", "limits": [{{"concurrent": 5}}]}}]}}"#
            ),
            "rules[0].consistency",
        ),
        (
            format!(
                r#"{{{service}, "rules": [{{"name": "r", "key": ["client_ip"], "consistency": "strict", "limits": [{{"concurrent": 5}}]}}]}}"#
            ),
            "rules[0].consistency",
        ),
        (
            format!(
                r#"{{{service}, "rules": [{{"name": "r", "key": ["client_ip"], "limits": [{{"requests": 5, "per": "second"}}], "fallback": {{"policy": "fail_open", "limits": [{{"concurrent": 5}}]}}}}]}}"#
            ),
            "rules[0].fallback.limits",
        ),
        (
            r#"{"rules": [{"name": "r", "key": ["client_ip"], "limits": [{"concurrent": 5, "per": "second"}]}]}"#.to_string(),
            "rules[0].limits[0].per",
        ),
        (
            r#"{"rules": [{"name": "r", "key": ["client_ip"], "count_when": {"statuses": [401]}, "limits": [{"concurrent": 5}]}]}"#.to_string(),
            "rules[0].count_when",
        ),
        (
            r#"{"rules": [{"name": "r", "key": ["client_ip"], "penalty": "1m", "limits": [{"concurrent": 5}]}]}"#.to_string(),
            "rules[0].penalty",
        ),
        (
            r#"{"rules": [{"name": "r", "key": ["client_ip"], "limits": [{"concurrent": 5, "requests": 5}]}]}"#.to_string(),
            "rules[0].limits[0].requests",
        ),
        (
            r#"{"rules": [{"name": "r", "key": ["client_ip"], "limits": [{"concurrent": 5, "burst": 5}]}]}"#.to_string(),
            "rules[0].limits[0].burst",
        ),
        (
            r#"{"rules": [{"name": "r", "key": ["client_ip"], "limits": [{"concurrent": 5, "algorithm": "gcra"}]}]}"#.to_string(),
            "rules[0].limits[0].algorithm",
        ),
        (
            r#"{"rules": [{"name": "r", "key": ["client_ip"], "limits": [{"requests": 5, "per": "second", "algorithm": "concurrency"}]}]}"#.to_string(),
            "rules[0].limits[0].requests",
        ),
        (
            r#"{"rules": [{"name": "r", "key": ["client_ip"], "limits": [{"algorithm": "concurrency"}]}]}"#.to_string(),
            "rules[0].limits[0].concurrent",
        ),
        (
            r#"{"rules": [{"name": "r", "key": ["client_ip"], "limits": [{"requests": 5, "per": "second", "max_hold": "1m"}]}]}"#.to_string(),
            "rules[0].limits[0].max_hold",
        ),
        (
            r#"{"rules": [{"name": "r", "key": ["client_ip"], "limits": [{"concurrent": 5}, {"concurrent": 9}]}]}"#.to_string(),
            "rules[0].limits[1]",
        ),
        (
            r#"{"rules": [{"name": "r", "key": ["client_ip"], "limits": [{"concurrent": 5}, {"requests": 5, "per": "second"}]}]}"#.to_string(),
            "rules[0].limits[1].algorithm",
        ),
        (
            r#"{"rules": [{"name": "r", "key": ["client_ip"], "cost": 2, "limits": [{"concurrent": 5}]}]}"#.to_string(),
            "rules[0].cost",
        ),
        (
            r#"{"rules": [{"name": "r", "key": ["client_ip"], "cost_header": "x-cost", "limits": [{"concurrent": 5}]}]}"#.to_string(),
            "rules[0].cost_header",
        ),
        (
            r#"{"rules": [{"name": "r", "key": ["client_ip"], "limits": [{"per": "second"}]}]}"#.to_string(),
            "rules[0].limits[0].requests",
        ),
        (
            r#"{"rules": [{"name": "r", "key": ["client_ip"], "limits": [{"requests": 3}]}]}"#.to_string(),
            "rules[0].limits[0].per",
        ),
    ];
    for (json, field) in cases {
        let error = sluice_core::parse(json.as_bytes()).expect_err(&json);
        assert_eq!(error.field, field, "{json}: {error}");
    }
}

/// The attacker's view of the new fields: whoever writes the configuration (or a live override
/// of a rule's limits) sets `concurrent` and `max_hold`. Zero, huge, negative, fractional or
/// wrongly typed values are refused naming the field; the largest accepted take bounded memory.
#[test]
fn hostile_concurrent_and_max_hold_values_are_refused() {
    let rule = |limit: &str| {
        format!(r#"{{"rules": [{{"name": "r", "key": ["client_ip"], "limits": [{limit}]}}]}}"#)
    };
    for (limit, field) in [
        (r#"{"concurrent": 0}"#, "concurrent"),
        (r#"{"concurrent": 1001}"#, "concurrent"),
        (r#"{"concurrent": 18446744073709551615}"#, "concurrent"),
        (r#"{"concurrent": -1}"#, "concurrent"),
        (r#"{"concurrent": 1.5}"#, "concurrent"),
        (r#"{"concurrent": "10"}"#, "concurrent"),
        (r#"{"concurrent": 5, "max_hold": 0}"#, "max_hold"),
        (r#"{"concurrent": 5, "max_hold": 86401}"#, "max_hold"),
        (r#"{"concurrent": 5, "max_hold": "2d"}"#, "max_hold"),
        (r#"{"concurrent": 5, "max_hold": "week"}"#, "max_hold"),
        (r#"{"concurrent": 5, "max_hold": -5}"#, "max_hold"),
        (r#"{"concurrent": 5, "max_hold": "10x"}"#, "max_hold"),
        (r#"{"concurrent": 5, "max_hold": null}"#, "max_hold"),
        (r#"{"concurrent": 5, "max_hold": [1]}"#, "max_hold"),
    ] {
        let json = rule(limit);
        let error = sluice_core::parse(json.as_bytes()).expect_err(limit);
        assert_eq!(
            error.field,
            format!("rules[0].limits[0].{field}"),
            "{limit}: {error}"
        );
    }
    // Slots take 8 bytes per key each: a rule's memory bound holds (64 MiB: 128 slots for
    // the default 65,536 keys), named on `concurrent`.
    let error = sluice_core::parse(rule(r#"{"concurrent": 1000}"#).as_bytes()).unwrap_err();
    assert_eq!(error.field, "rules[0].limits[0].concurrent", "{error}");
    assert!(error.problem.contains("its slots keep 1000"), "{error}");
    // The largest accepted: 1000 slots of 8 bytes for 8,192 keys, a day's hold.
    let json = format!(
        r#"{{"max_keys": 8192, "rules": [{{"name": "r", "key": ["client_ip"], "limits": [{}]}}]}}"#,
        r#"{"concurrent": 1000, "max_hold": 86400}"#
    );
    let policy = sluice_core::parse(json.as_bytes()).unwrap();
    assert_eq!(policy.rules[0].limits[0].requests(), 1000);
    assert_eq!(policy.rules[0].limits[0].period().seconds(), 86_400);
    // Left out: ten minutes.
    let policy = sluice_core::parse(rule(r#"{"concurrent": 3}"#).as_bytes()).unwrap();
    assert_eq!(policy.rules[0].limits[0].period().seconds(), 600);
}

/// Many workers share the slots through the store: requests started and ended in any order
/// over one store never hold more than the limit, and every end is counted once.
#[test]
fn interleaved_starts_and_ends_never_exceed_the_slots() {
    let limiter = limiter(TWO);
    let mut store = MemoryStore::default();
    let mut open: Vec<Exchange> = Vec::new();
    let mut admitted_total = 0;
    // A fixed pseudo-random sequence: start when the draw is even, else end the oldest.
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for i in 0..2_000u64 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let now = T0 + i;
        if !x.is_multiple_of(3) || open.is_empty() {
            let (exchange, step) = start(&limiter, &mut store, "alice", now);
            match step {
                Step::Continue => {
                    admitted_total += 1;
                    open.push(exchange);
                }
                Step::Respond(_) => assert_eq!(open.len(), 2, "denied only when full"),
                other => panic!("{other:?}"),
            }
            assert!(open.len() <= 2);
        } else {
            let at = (x as usize / 3) % open.len();
            let mut ended = open.swap_remove(at);
            ended.finish(&limiter, &mut store);
        }
    }
    assert!(admitted_total > 100, "{admitted_total}");
}

/// A live limit override (an operator through the counter service's admin API) may set a local
/// rule's concurrency as the configuration does, and is refused, naming the field, where the
/// configuration would refuse it: a cached rule, a rate mixed in, a hostile figure.
#[test]
fn a_live_override_of_concurrency_is_checked_as_the_configuration() {
    use serde_json::json;
    use sluice_core::overrides::check_limits;
    let policy = sluice_core::parse(
        br#"{"service": {"cluster": "s"}, "rules": [
          {"name": "inflight", "key": ["client_ip"], "consistency": "local", "limits": [{"concurrent": 5}]},
          {"name": "shared", "key": ["client_ip"], "limits": [{"requests": 5, "per": "second"}]}]}"#,
    )
    .unwrap();
    let rules = check_limits(
        &policy,
        "inflight",
        &[json!({"concurrent": 20, "max_hold": "1m"})],
        "target",
        "limits",
    )
    .unwrap();
    assert_eq!(rules[0].1.limits[0].requests(), 20);
    for (target, limits, field) in [
        (
            "shared",
            vec![json!({"concurrent": 5})],
            "limits[0].concurrent",
        ),
        (
            "inflight",
            vec![json!({"concurrent": 0})],
            "limits[0].concurrent",
        ),
        (
            "inflight",
            vec![json!({"concurrent": 5, "max_hold": "1000d"})],
            "limits[0].max_hold",
        ),
        (
            "inflight",
            vec![
                json!({"concurrent": 5}),
                json!({"requests": 1, "per": "second"}),
            ],
            "limits[1].algorithm",
        ),
    ] {
        let error = check_limits(&policy, target, &limits, "target", "limits").unwrap_err();
        assert_eq!(error.field, field, "{target} {limits:?}: {error}");
    }
}
