//! Rolling shedding out as a rate limit is rolled out: a mode and a ramp per bulkhead (the
//! shedding's mode their default), a warn bulkhead's log line, each bulkhead's own class
//! thresholds, and live overrides of a bulkhead's mode, ramp, limit and thresholds, each checked
//! as the configuration is (attackers' values refused with the field named).

use serde_json::json;
use sluice_core::overrides::{self, check_bulkhead, BULKHEAD_PREFIX};
use sluice_core::protocol::LiveOverrides;
use sluice_core::shed::admission::gauge;
use sluice_core::shed::policy::{LimitKind, ShedMode};
use sluice_core::{Effect, Exchange, Limiter, MemoryStore, Moment, PlainRequest, Step};

const T0: u64 = 1_700_000_000_000_000;

fn parse(json: &str) -> sluice_core::Policy {
    sluice_core::parse(json.as_bytes()).unwrap()
}

/// Starts a request of `path` (class header `x-class: class`) with the shedding draw `draw`.
fn start(
    limiter: &Limiter,
    store: &mut MemoryStore,
    path: &str,
    class: &str,
    draw: f64,
) -> (Exchange, Step, Vec<Effect>) {
    let mut req = PlainRequest::get(path).with_header("x-class", class);
    let moment = Moment {
        draw,
        ..Moment::at(T0)
    };
    Exchange::start(limiter, &mut req, None, moment, store)
}

fn shed(step: &Step) -> bool {
    matches!(step, Step::Respond(r) if r.status == 503)
}

const TWO: &str = r#"{"shedding": {"mode": "monitor", "class_header": "x-class",
    "bulkheads": [
        {"name": "watched", "match": {"path_prefix": "/w"}, "limit": {"static": 1}},
        {"name": "enforced", "match": {"path_prefix": "/e"}, "limit": {"static": 1}, "mode": "enforce"},
        {"name": "told", "match": {"path_prefix": "/t"}, "limit": {"static": 1}, "mode": "warn"}]}}"#;

#[test]
fn each_bulkhead_has_its_own_mode_and_the_sheddings_is_its_default() {
    let limiter = Limiter::new(parse(TWO));
    let modes: Vec<ShedMode> = limiter
        .policy()
        .shedding
        .as_ref()
        .unwrap()
        .bulkheads
        .iter()
        .map(|b| b.mode)
        .collect();
    assert_eq!(
        modes,
        [ShedMode::Monitor, ShedMode::Enforce, ShedMode::Warn]
    );
    let mut store = MemoryStore::default();
    for path in ["/w", "/e", "/t"] {
        let (_held, step, _) = start(&limiter, &mut store, path, "basic", 0.5);
        assert_eq!(step, Step::Continue, "{path}: the first of one slot");
    }
    // Over the limit: the monitor bulkhead admits and counts, the enforce one sheds, the warn
    // one admits and asks for its log line (bulkhead, class, reason).
    let (_, step, effects) = start(&limiter, &mut store, "/w", "basic", 0.5);
    assert_eq!(step, Step::Continue);
    assert!(effects
        .iter()
        .any(|e| matches!(e, Effect::Shed { would: true, .. })));
    assert!(!effects.iter().any(|e| matches!(e, Effect::WarnShed { .. })));
    let (_, step, _) = start(&limiter, &mut store, "/e", "basic", 0.5);
    assert!(shed(&step), "{step:?}");
    let (_, step, effects) = start(&limiter, &mut store, "/t", "free", 0.5);
    assert_eq!(step, Step::Continue);
    let warned: Vec<_> = effects
        .iter()
        .filter_map(|e| match e {
            Effect::WarnShed { seat, reason } => Some((seat.bulkhead, seat.class, reason.name())),
            _ => None,
        })
        .collect();
    assert_eq!(warned, [(2, 0, "concurrency")], "{effects:?}");
}

#[test]
fn an_enforce_bulkheads_ramp_sheds_its_share_of_would_be_sheds() {
    for (ramp, low, high) in [(0, 0, 0), (30, 220, 380), (100, 1000, 1000)] {
        let limiter = Limiter::new(parse(&format!(
            r#"{{"shedding": {{"bulkheads": [{{"name": "a", "limit": {{"static": 1}}, "ramp_percent": {ramp}}}]}}}}"#
        )));
        let mut store = MemoryStore::default();
        let (_held, step, _) = start(&limiter, &mut store, "/x", "basic", 0.5);
        assert_eq!(step, Step::Continue);
        let mut shed_count = 0;
        let mut let_through = 0;
        for i in 0..1000 {
            let draw = i as f64 / 1000.0;
            let (mut ex, step, effects) = start(&limiter, &mut store, "/x", "basic", draw);
            if shed(&step) {
                shed_count += 1;
            } else {
                assert!(
                    effects
                        .iter()
                        .any(|e| matches!(e, Effect::Shed { would: true, .. })),
                    "outside the ramp: admitted and counted as would-shed"
                );
                let_through += 1;
                ex.finish(&limiter, &mut store);
            }
        }
        assert!(
            (low..=high).contains(&shed_count),
            "ramp {ramp}%: {shed_count} of 1000 would-be sheds shed"
        );
        assert_eq!(shed_count + let_through, 1000);
    }
}

#[test]
fn a_bulkhead_sets_its_own_class_thresholds_over_the_sheddings() {
    let limiter = Limiter::new(parse(
        r#"{"shedding": {"class_header": "x-class", "bulkheads": [
            {"name": "strict", "match": {"path_prefix": "/s"}, "limit": {"static": 10}, "classes": {"free": 0.2}},
            {"name": "loose", "match": {"path_prefix": "/l"}, "limit": {"static": 10}}]}}"#,
    ));
    let mut store = MemoryStore::default();
    let mut held = Vec::new();
    for path in ["/s", "/s", "/l", "/l"] {
        held.push(start(&limiter, &mut store, path, "critical", 0.5).0);
    }
    // 2 of 10 in flight in each: `free` is at its 0.2 in `strict`, far under its 0.7 in `loose`.
    let (_, step, _) = start(&limiter, &mut store, "/s", "free", 0.5);
    assert!(shed(&step), "{step:?}");
    let (_, step, _) = start(&limiter, &mut store, "/l", "free", 0.5);
    assert_eq!(step, Step::Continue);
}

#[test]
fn mode_ramp_and_classes_errors_name_their_field() {
    let bulkhead = |extra: &str| {
        format!(
            r#"{{"shedding": {{"bulkheads": [{{"name": "a", "limit": {{"static": 1}}{extra}}}]}}}}"#
        )
    };
    let cases = [
        (bulkhead(r#", "mode": "loud""#), "shedding.bulkheads[0].mode: expected one of monitor, warn, enforce"),
        (bulkhead(r#", "ramp_percent": 101"#), "shedding.bulkheads[0].ramp_percent: must be between 0 and 100"),
        (bulkhead(r#", "ramp_percent": 1000"#), "shedding.bulkheads[0].ramp_percent: invalid value"),
        (bulkhead(r#", "ramp_percent": -1"#), "shedding.bulkheads[0].ramp_percent: invalid value"),
        (
            bulkhead(r#", "mode": "monitor", "ramp_percent": 50"#),
            "shedding.bulkheads[0].ramp_percent: ramps an enforce bulkhead",
        ),
        (
            r#"{"shedding": {"mode": "warn", "bulkheads": [{"name": "a", "limit": {"static": 1}, "ramp_percent": 50}]}}"#.to_string(),
            "shedding.bulkheads[0].ramp_percent: ramps an enforce bulkhead",
        ),
        (bulkhead(r#", "classes": {"gold": 0.5}"#), "shedding.bulkheads[0].classes.gold: \"gold\" is not a class"),
        (bulkhead(r#", "classes": {"free": 0}"#), "shedding.bulkheads[0].classes.free: must be between 0.01 and 1"),
        (bulkhead(r#", "classes": {"free": -3}"#), "shedding.bulkheads[0].classes.free: must be between 0.01 and 1"),
        (bulkhead(r#", "classes": {"free": 1e300}"#), "shedding.bulkheads[0].classes.free: must be between 0.01 and 1"),
    ];
    for (json, expected) in cases {
        let error = sluice_core::parse(json.as_bytes()).unwrap_err().to_string();
        assert!(error.starts_with(expected), "{json}: {error}");
    }
    // A bulkhead of an enforce shedding may ramp; `critical` may be made sheddable in one.
    let ok = parse(&bulkhead(
        r#", "ramp_percent": 0, "classes": {"critical": 0.99}"#,
    ));
    let b = &ok.shedding.as_ref().unwrap().bulkheads[0];
    assert_eq!((b.ramp_percent, b.threshold(4)), (0, Some(0.99)));
}

fn live(target: &str, value: serde_json::Value) -> LiveOverrides {
    LiveOverrides {
        version: 1,
        limits: [(format!("{BULKHEAD_PREFIX}{target}"), vec![value])].into(),
        ..Default::default()
    }
}

#[test]
fn a_bulkhead_override_changes_its_mode_ramp_limit_and_thresholds() {
    let policy = parse(TWO);
    let set = live(
        "enforced",
        json!({"mode": "enforce", "ramp_percent": 25, "limit": {"static": 7}, "classes": {"free": 0.5}}),
    );
    let (p, problems) = overrides::apply(&policy, &set);
    assert!(problems.is_empty(), "{problems:?}");
    let b = &p.shedding.as_ref().unwrap().bulkheads[1];
    assert_eq!((b.mode, b.ramp_percent), (ShedMode::Enforce, 25));
    assert_eq!(b.limit, LimitKind::Static(7));
    assert_eq!(b.threshold(0), Some(0.5));
    assert_eq!(b.threshold(1), Some(0.8), "the others are kept");
    // The other bulkheads, and the rules, are as configured.
    assert_eq!(
        p.shedding.as_ref().unwrap().bulkheads[0],
        policy.shedding.as_ref().unwrap().bulkheads[0]
    );
    // A mode alone is the whole mode; and what it does not give is kept.
    let (p, problems) = overrides::apply(&policy, &live("watched", json!({"mode": "enforce"})));
    assert!(problems.is_empty(), "{problems:?}");
    let b = &p.shedding.as_ref().unwrap().bulkheads[0];
    assert_eq!(
        (b.mode, b.ramp_percent, b.limit),
        (ShedMode::Enforce, 100, LimitKind::Static(1))
    );

    // In force at once: the monitor bulkhead, overridden to enforce, sheds.
    let limiter = Limiter::new(p);
    let mut store = MemoryStore::default();
    let (_held, _, _) = start(&limiter, &mut store, "/w", "basic", 0.5);
    let (_, step, _) = start(&limiter, &mut store, "/w", "basic", 0.5);
    assert!(shed(&step), "{step:?}");
    assert_eq!(
        gauge(limiter.policy().shedding.as_ref().unwrap(), 0, &mut store).in_flight,
        1
    );
}

/// The attacker holds an admin token (or the service's Redis) and writes the worst values. Each
/// is refused naming its field, with the configuration's own message, and the bulkhead is left as
/// configured.
#[test]
fn a_bulkhead_override_passes_every_check_of_the_configuration() {
    let policy = parse(TWO);
    let cases = [
        ("enforced", json!({"limit": {"static": 0}}), "bulkheads.enforced.limit.static: must be between 1 and 1000000, got 0"),
        ("enforced", json!({"limit": {"static": 4294967296u64}}), "bulkheads.enforced.limit.static: invalid value"),
        ("enforced", json!({"limit": {"static": -1}}), "bulkheads.enforced.limit.static: invalid value"),
        ("enforced", json!({"limit": {"adaptive": {"min": 5, "max": 2}}}), "bulkheads.enforced.limit.adaptive.max: must be between 5 and 1000000, got 2"),
        ("enforced", json!({"limit": {"adaptive": {"min": 1, "max": 9, "probe_interval_ms": 5}}}), "bulkheads.enforced.limit.adaptive.probe_interval_ms"),
        ("enforced", json!({"classes": {"free": -0.5}}), "bulkheads.enforced.classes.free: must be between 0.01 and 1, got -0.5"),
        ("enforced", json!({"classes": {"free": 1e308}}), "bulkheads.enforced.classes.free: must be between 0.01 and 1"),
        ("enforced", json!({"classes": {"free": "high"}}), "bulkheads.enforced.classes.free: invalid type"),
        ("enforced", json!({"classes": {"intruder": 0.5}}), "bulkheads.enforced.classes.intruder: \"intruder\" is not a class of shedding.classes"),
        ("enforced", json!({"mode": "off"}), "bulkheads.enforced.mode: expected one of monitor, warn, enforce, got \"off\""),
        ("enforced", json!({"ramp_percent": 101}), "bulkheads.enforced.ramp_percent: must be between 0 and 100, got 101"),
        ("enforced", json!({"ramp_percent": 256}), "bulkheads.enforced.ramp_percent: invalid value"),
        ("watched", json!({"ramp_percent": 50}), "bulkheads.watched.ramp_percent: ramps an enforce bulkhead"),
        ("enforced", json!({"mode": "warn", "ramp_percent": 50}), "bulkheads.enforced.ramp_percent: ramps an enforce bulkhead"),
        ("enforced", json!({"queue": {"size": 10000000, "max_wait_ms": 1}}), "bulkheads.enforced.queue: unknown field `queue`, expected one of `mode`, `ramp_percent`, `limit`, `classes`"),
        ("enforced", json!({}), "bulkheads.enforced: give at least one of mode, ramp_percent, limit, classes"),
        ("enforced", json!([1, 2]), "bulkheads.enforced[0]: invalid type"),
        ("nowhere", json!({"mode": "monitor"}), "bulkheads.nowhere: no bulkhead named \"nowhere\"; the bulkheads are watched, enforced, told"),
    ];
    for (target, value, expected) in cases {
        let (p, problems) = overrides::apply(&policy, &live(target, value.clone()));
        assert_eq!(p, policy, "{value}: left as configured");
        assert_eq!(problems.len(), 1, "{value}: {problems:?}");
        assert!(problems[0].starts_with(expected), "{value}: {problems:?}");
    }
    // Two objects for one bulkhead: which would win is not said, so neither does.
    let two = LiveOverrides {
        version: 1,
        limits: [(
            "bulkhead:enforced".to_string(),
            vec![json!({"mode": "monitor"}), json!({"mode": "warn"})],
        )]
        .into(),
        ..Default::default()
    };
    let (p, problems) = overrides::apply(&policy, &two);
    assert_eq!((p, problems.len()), (policy.clone(), 1));
    // The service's own check, given the proxies' configuration, says the same with its fields.
    let error = check_bulkhead(
        &policy,
        "enforced",
        &json!({"limit": {"static": 0}}),
        "bulkhead",
        "",
    )
    .unwrap_err()
    .to_string();
    assert_eq!(error, "limit.static: must be between 1 and 1000000, got 0");
    // A configuration without shedding has no bulkhead to override.
    let rules = parse(
        r#"{"rules": [{"name": "r", "key": ["client_ip"], "limits": [{"requests": 1, "per": "second"}]}]}"#,
    );
    let error =
        check_bulkhead(&rules, "api", &json!({"mode": "monitor"}), "bulkhead", "").unwrap_err();
    assert_eq!(error.field, "bulkhead");
    // The configuration refuses the same values with the same messages.
    let configured = sluice_core::parse(
        br#"{"shedding": {"bulkheads": [{"name": "a", "limit": {"static": 0}}]}}"#,
    )
    .unwrap_err()
    .to_string();
    assert_eq!(
        configured,
        "shedding.bulkheads[0].limit.static: must be between 1 and 1000000, got 0"
    );
}

/// Attacker's test (an admin token, or the service's Redis): an override making every class of
/// a bulkhead with a shedding curve never shed (null), which the configuration refuses (the
/// curve would shed nothing), is refused naming `classes`, with the configuration's message, and
/// the bulkhead is left as configured; one class still shed is taken.
#[test]
fn a_bulkhead_override_cannot_leave_its_curve_nothing_to_shed() {
    let policy = parse(
        r#"{"shedding": {"mode": "enforce", "class_header": "x-class",
        "bulkheads": [{"name": "api", "limit": {"static": 10},
                       "curve": [{"at": 0.7, "shed": 0.1}]}]}}"#,
    );
    let names: Vec<String> = policy
        .shedding
        .as_ref()
        .unwrap()
        .classes
        .iter()
        .map(|c| c.name.clone())
        .collect();
    let every: serde_json::Map<String, serde_json::Value> = names
        .iter()
        .map(|name| (name.clone(), serde_json::Value::Null))
        .collect();
    let (p, problems) = overrides::apply(&policy, &live("api", json!({"classes": every})));
    assert_eq!(p, policy, "left as configured");
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(
        problems[0].starts_with(
            "bulkheads.api.classes: every class of this bulkhead is never shed (null): the curve would shed nothing"
        ),
        "{problems:?}"
    );
    // The service's own check says the same.
    let error =
        check_bulkhead(&policy, "api", &json!({"classes": every}), "bulkhead", "").unwrap_err();
    assert_eq!(error.field, "classes", "{error}");
    // With one class left to shed, the override is taken.
    let mut one_left = every.clone();
    one_left.insert(names[names.len() - 1].clone(), json!(0.5));
    let (p, problems) = overrides::apply(&policy, &live("api", json!({"classes": one_left})));
    assert!(problems.is_empty(), "{problems:?}");
    assert_ne!(p, policy);
}
