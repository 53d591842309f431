//! A fallback sized to the fleet (`"fallback": {"policy": "fail_open", "share": "fleet", "max_proxies": 1000}`): the
//! rule's limits divided among the proxies the counter service last counted, the count kept in
//! the sync state, and what a proxy admits without the service.

use sluice_core::limiter::Conditions;
use sluice_core::policy::{Fallback, FleetShare};
use sluice_core::protocol::{Hints, LimitSpec, LiveOverrides, Overrides, SyncResponse};
use sluice_core::sync::outbox::Pending;
use sluice_core::sync::proxy::{claim_round, read_state};
use sluice_core::sync::round;
use sluice_core::{Algorithm, Decision, Limit, Limiter, MemoryStore, Period, PlainRequest, Policy};

const SECOND: u64 = 1_000_000;
const T0: u64 = 1_700_000_000 * SECOND;
const SECRET: [u64; 2] = [7, 9];

fn policy(limit: &str, fallback: &str) -> Policy {
    let json = format!(
        r#"{{"service": {{"cluster": "svc", "breaker_failures": 1}},
        "rules": [{{"name": "api", "key": ["const:all"], "consistency": "cached",
                    "limits": [{limit}], "fallback": {fallback}}}]}}"#
    );
    sluice_core::parse(json.as_bytes()).unwrap()
}

const HUNDRED: &str = r#"{"requests": 100, "per": "second"}"#;
const SHARE: &str = r#"{"policy": "fail_open", "share": "fleet", "max_proxies": 1000}"#;

fn down(now_us: u64) -> Conditions {
    Conditions {
        now_us,
        service_up: false,
        service_back_us: 0,
        load: Default::default(),
    }
}

/// How many of `n` requests at `now_us` the limiter admits without the service.
fn admitted(limiter: &Limiter, store: &mut MemoryStore, n: usize, now_us: u64) -> usize {
    (0..n)
        .filter(|_| {
            let e = limiter.decide(&mut PlainRequest::get("/"), down(now_us), store);
            matches!(e.decision, Decision::Allow { .. })
        })
        .count()
}

fn fallback(policy: &Policy) -> Vec<Limit> {
    match &policy.rules[0].fallback {
        Fallback::Open(limits) => limits.clone(),
        Fallback::Closed => panic!("fail_closed"),
    }
}

#[test]
fn a_share_rounds_up_and_never_falls_below_one_request_of_the_rules_cost() {
    let bucket = Limit::new(100, Period::Second, Some(40)).unwrap();
    let share = bucket.share(3, 1);
    assert_eq!((share.requests(), share.burst()), (34, 14));
    assert_eq!(share.period(), Period::Second);
    assert_eq!(share.algorithm(), Algorithm::TokenBucket);
    // a fleet larger than the limit: one request a period, one at once
    let share = bucket.share(1_000, 1);
    assert_eq!((share.requests(), share.burst()), (1, 1));
    // no fleet at all reads as one proxy: the whole limit
    assert_eq!(bucket.share(0, 1), bucket);
    assert_eq!(bucket.share(1, 1), bucket);
    // a request of cost 5 can still pass once a period
    let share = bucket.share(1_000, 5);
    assert_eq!((share.requests(), share.burst()), (1, 5));
    // a window divides its requests, and holds at least one request's cost
    let window = Limit::windowed(1_000, Period::Minute, Algorithm::FixedWindow).unwrap();
    let share = window.share(7, 1);
    assert_eq!((share.requests(), share.burst()), (143, 143));
    assert_eq!(share.algorithm(), Algorithm::FixedWindow);
    assert_eq!(window.share(u32::MAX as u64, 3).requests(), 3);
    // what goes on the wire is the rule's limit, not the share: the service keeps the whole
    assert_ne!(LimitSpec::from(&window), LimitSpec::from(&share));
    // GCRA as the token bucket
    let gcra = bucket.gcra().share(4, 1);
    assert_eq!(
        (gcra.requests(), gcra.burst(), gcra.algorithm()),
        (25, 10, Algorithm::Gcra)
    );
}

#[test]
fn before_any_count_the_fallback_is_the_assumed_share_or_the_whole_limit() {
    let lone = policy(HUNDRED, SHARE);
    assert_eq!(
        lone.rules[0].share,
        Some(FleetShare {
            assume_proxies: 1,
            max_proxies: 1000,
            proxies: 1
        })
    );
    assert_eq!(
        fallback(&lone)[0].requests(),
        100,
        "a lone proxy: the whole limit"
    );
    assert!(lone.fleet_share());

    let four = policy(
        HUNDRED,
        r#"{"policy": "fail_open", "share": "fleet", "assume_proxies": 4, "max_proxies": 1000}"#,
    );
    assert_eq!(fallback(&four)[0].requests(), 25);
    let limiter = Limiter::new(four);
    let mut store = MemoryStore::default();
    assert_eq!(admitted(&limiter, &mut store, 200, T0), 25);

    // without a share nothing is asked of the service
    let plain = policy(HUNDRED, r#"{"policy": "fail_open"}"#);
    assert!(!plain.fleet_share());
    assert_eq!(plain.rules[0].share, None);
}

#[test]
fn the_fallback_follows_the_count_heard_and_keeps_the_keys_counts() {
    let base = policy(
        HUNDRED,
        r#"{"policy": "fail_open", "share": "fleet", "assume_proxies": 4, "max_proxies": 1000}"#,
    );
    let mut store = MemoryStore::default();
    let limiter = Limiter::with_secret(base.clone(), SECRET);
    assert_eq!(admitted(&limiter, &mut store, 10, T0), 10);

    // two proxies counted: a burst of 50; the key keeps the 15 tokens it had left (its table
    // is kept), and refills to the new burst
    let mut two = base.clone();
    two.size_to_fleet(2);
    assert_eq!(fallback(&two)[0].requests(), 50);
    assert_eq!(two.rules[0].share.unwrap().proxies, 2);
    let limiter = Limiter::with_overrides(two.clone(), &base, SECRET);
    assert_eq!(admitted(&limiter, &mut store, 100, T0), 15);
    assert_eq!(admitted(&limiter, &mut store, 100, T0 + 2 * SECOND), 50);

    // eight: a full bucket of 50 is cut to the new burst of 13
    let limiter = Limiter::with_overrides(two, &base, SECRET);
    let mut full = MemoryStore::default();
    assert_eq!(admitted(&limiter, &mut full, 1, T0), 1);
    let mut eight = base.clone();
    eight.size_to_fleet(8);
    let limiter = Limiter::with_overrides(eight, &base, SECRET);
    assert_eq!(admitted(&limiter, &mut full, 100, T0 + 2 * SECOND), 13);

    // three: ceil(100 / 3)
    let mut three = base.clone();
    three.size_to_fleet(3);
    assert_eq!(fallback(&three)[0].requests(), 34);
    let limiter = Limiter::with_overrides(three, &base, SECRET);
    let mut fresh = MemoryStore::default();
    assert_eq!(admitted(&limiter, &mut fresh, 100, T0), 34);

    // no count (0) is the assumed one again
    let mut none = base.clone();
    none.size_to_fleet(0);
    assert_eq!(fallback(&none), fallback(&base));
}

/// The service counts up to `--fleet-max-proxies-per-credential` ids of each credential (256 by
/// default), so one proxy credential can have it count that many made-up proxies. A count above
/// the rule's `max_proxies` is not believed: the fallback is never below the limit divided by
/// `max_proxies`, whatever the service answers, and up to it the count is followed.
#[test]
fn a_count_above_max_proxies_is_not_believed() {
    let base = policy(
        HUNDRED,
        r#"{"policy": "fail_open", "share": "fleet", "assume_proxies": 2, "max_proxies": 4}"#,
    );
    assert_eq!(base.rules[0].share.unwrap().max_proxies, 4);
    for heard in [5, 2 + 256, u32::MAX] {
        let mut told = base.clone();
        told.size_to_fleet(heard);
        assert_eq!(told.rules[0].share.unwrap().proxies, 4, "{heard}");
        assert_eq!(fallback(&told)[0].requests(), 25, "{heard}");
        let limiter = Limiter::with_overrides(told, &base, SECRET);
        let mut store = MemoryStore::default();
        assert_eq!(admitted(&limiter, &mut store, 200, T0), 25, "{heard}");
    }
    for (heard, share) in [(1, 100), (3, 34), (4, 25)] {
        let mut told = base.clone();
        told.size_to_fleet(heard);
        assert_eq!(fallback(&told)[0].requests(), share, "{heard}");
    }
}

#[test]
fn a_live_override_of_a_shared_rule_is_divided_as_the_configured_limits_were() {
    let mut base = policy(HUNDRED, SHARE);
    base.size_to_fleet(4);
    let live = LiveOverrides {
        version: 1,
        limits: [(
            "api".to_string(),
            vec![serde_json::json!({"requests": 1000, "per": "second"})],
        )]
        .into(),
        ..Default::default()
    };
    let (applied, problems) = sluice_core::overrides::apply(&base, &live);
    assert!(problems.is_empty(), "{problems:?}");
    assert_eq!(applied.rules[0].limits[0].requests(), 1_000);
    assert_eq!(fallback(&applied)[0].requests(), 250);

    // a sliding_log cannot be resized: the override is refused, naming the field
    let strict = sluice_core::parse(
        br#"{"service": {"cluster": "svc"}, "rules": [{"name": "api", "key": ["const:all"],
        "consistency": "strict", "limits": [{"requests": 100, "per": "second"}],
        "fallback": {"policy": "fail_open", "share": "fleet", "max_proxies": 1000}}]}"#,
    )
    .unwrap();
    let log = LiveOverrides {
        version: 1,
        limits: [(
            "api".to_string(),
            vec![serde_json::json!({"requests": 10, "per": "second", "algorithm": "sliding_log"})],
        )]
        .into(),
        ..Default::default()
    };
    let (applied, problems) = sluice_core::overrides::apply(&strict, &log);
    assert_eq!(
        applied.rules[0].limits, strict.rules[0].limits,
        "left as configured"
    );
    assert_eq!(problems.len(), 1);
    assert!(
        problems[0].starts_with("limits.api[0].algorithm: a sliding_log keeps one timestamp"),
        "{problems:?}"
    );
}

fn answer(fleet_proxies: Option<u64>) -> SyncResponse {
    SyncResponse {
        grants: Vec::new(),
        hints: Hints {
            next_sync_ms: 100,
            overrides: Overrides {
                fleet_proxies,
                ..Default::default()
            },
        },
    }
}

#[test]
fn the_sync_asks_for_the_count_keeps_it_and_keeps_the_last_one_when_none_comes() {
    let limiter = Limiter::new(policy(HUNDRED, SHARE));
    let mut store = MemoryStore::default();
    let mut waiting = Pending::default();
    claim_round(&mut store, T0, 100, 250_000, 1).unwrap();
    let batch = round::compose(&limiter, &mut waiting, "p-1", 100, &mut store).unwrap();
    assert!(batch.request.fleet_share, "a share rule asks to be counted");
    assert_eq!(read_state(&mut store).fleet_proxies, 0, "none heard yet");

    round::settle(&limiter, &batch, &answer(Some(3)), T0, &mut store).unwrap();
    assert_eq!(read_state(&mut store).fleet_proxies, 3);
    // an answer without a count (the service could not count) keeps the last one
    round::settle(&limiter, &batch, &answer(None), T0, &mut store).unwrap();
    assert_eq!(read_state(&mut store).fleet_proxies, 3);
    // the worst a service can answer: 0 reads as this proxy alone, a huge count as the most,
    // believed up to max_proxies (a_count_above_max_proxies_is_not_believed)
    round::settle(&limiter, &batch, &answer(Some(0)), T0, &mut store).unwrap();
    assert_eq!(read_state(&mut store).fleet_proxies, 1);
    round::settle(&limiter, &batch, &answer(Some(u64::MAX)), T0, &mut store).unwrap();
    assert_eq!(read_state(&mut store).fleet_proxies, u32::MAX);
    let mut floor = limiter.policy().clone();
    floor.size_to_fleet(u32::MAX);
    let floor = fallback(&floor)[0];
    assert_eq!((floor.requests(), floor.burst()), (1, 1));

    // a proxy without a share rule is not counted
    let plain = Limiter::new(policy(HUNDRED, r#"{"policy": "fail_open"}"#));
    let batch = round::compose(&plain, &mut waiting, "p-1", 100, &mut store).unwrap();
    assert!(!batch.request.fleet_share);
    let json = serde_json::to_string(&batch.request).unwrap();
    assert!(!json.contains("fleet_share"), "{json}");
}
