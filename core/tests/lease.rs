//! Cached consistency on one proxy: fallbacks before the first grant, grants as leases, the
//! snapshot the sync sends, and what happens when the lease lapses or the service is down.

use sluice_core::limiter::Conditions;
use sluice_core::policy::RuleId;
use sluice_core::protocol::Lease;
use sluice_core::sync::proxy::{apply_lease, snapshot, take, Taken};
use sluice_core::{Decision, Limiter, MemoryStore, PlainRequest};

const MS: u64 = 1_000;
const T0: u64 = 1_700_000_000_000_000;

fn limiter(fallback: &str) -> Limiter {
    let json = format!(
        r#"{{"service": {{"cluster": "svc", "token": "t"}},
        "rules": [{{"name": "shared", "key": ["const:all"],
                    "limits": [{{"requests": 100, "per": "second"}}]{fallback}}}]}}"#
    );
    Limiter::new(sluice_core::parse(json.as_bytes()).unwrap())
}

fn up(now_us: u64) -> Conditions {
    Conditions {
        now_us,
        service_up: true,
        service_back_us: 0,
        load: Default::default(),
    }
}

fn down(now_us: u64) -> Conditions {
    Conditions {
        now_us,
        service_up: false,
        service_back_us: 0,
        load: Default::default(),
    }
}

fn admitted(limiter: &Limiter, store: &mut MemoryStore, n: usize, c: Conditions) -> usize {
    (0..n)
        .filter(|_| {
            let e = limiter.decide(&mut PlainRequest::get("/"), c, store);
            matches!(e.decision, Decision::Allow { .. })
        })
        .count()
}

fn grant(tokens: u64) -> Lease {
    Lease {
        tokens,
        ttl_ms: 300,
        remaining: 0,
        reset_ms: 0,
        token_ms: None,
        refused: None,
        penalty_ms: 0,
    }
}

const KEY: &str = "shared\u{1f}all";

#[test]
fn before_the_first_grant_the_fallback_decides_and_the_key_is_announced_once() {
    let limiter = limiter(
        r#", "fallback": {"policy": "fail_open", "limits": [{"requests": 10, "per": "second"}]}"#,
    );
    let mut store = MemoryStore::default();
    let first = limiter.decide(&mut PlainRequest::get("/"), up(T0), &mut store);
    assert_eq!(
        first.newly_unsynced,
        vec![(RuleId::new(0), KEY.to_string())]
    );
    let second = limiter.decide(&mut PlainRequest::get("/"), up(T0), &mut store);
    assert!(second.newly_unsynced.is_empty(), "announced once per sync");
    assert_eq!(
        admitted(&limiter, &mut store, 20, up(T0)),
        8,
        "fallback burst of 10"
    );

    let entry = snapshot(&limiter, RuleId::new(0), KEY, &mut store).unwrap();
    assert_eq!((entry.spent, entry.denied), (10, 12));
    assert_eq!(entry.limits[0].requests, 100);
    assert!(
        snapshot(&limiter, RuleId::new(0), KEY, &mut store).is_none(),
        "counts were taken"
    );
    let after = limiter.decide(&mut PlainRequest::get("/"), up(T0), &mut store);
    assert_eq!(
        after.newly_unsynced.len(),
        1,
        "announced again after the snapshot"
    );
}

#[test]
fn a_grant_is_spent_exactly_and_in_flight_spend_is_deducted() {
    let limiter = limiter("");
    let mut store = MemoryStore::default();
    admitted(&limiter, &mut store, 3, up(T0));
    snapshot(&limiter, RuleId::new(0), KEY, &mut store).unwrap();
    // Two more requests while the sync is on its way: the service did not see them.
    admitted(&limiter, &mut store, 2, up(T0 + MS));
    apply_lease(
        &limiter,
        RuleId::new(0),
        KEY,
        &grant(10),
        T0 + 2 * MS,
        &mut store,
    )
    .unwrap();
    let n = admitted(&limiter, &mut store, 20, up(T0 + 3 * MS));
    assert_eq!(n, 8, "10 granted, 2 already spent in flight");
    let entry = snapshot(&limiter, RuleId::new(0), KEY, &mut store).unwrap();
    assert_eq!(
        (entry.spent, entry.denied),
        (10, 12),
        "in-flight spend is reported next"
    );
}

#[test]
fn a_lapsed_lease_falls_back_to_what_is_left_locally() {
    let limiter = limiter(
        r#", "fallback": {"policy": "fail_open", "limits": [{"requests": 10, "per": "minute"}]}"#,
    );
    let mut store = MemoryStore::default();
    admitted(&limiter, &mut store, 1, up(T0));
    snapshot(&limiter, RuleId::new(0), KEY, &mut store).unwrap();
    apply_lease(&limiter, RuleId::new(0), KEY, &grant(50), T0, &mut store).unwrap();
    assert_eq!(admitted(&limiter, &mut store, 60, up(T0 + MS)), 50);
    // The lease (300 ms) lapses; the local fallback bucket was drained by the grant spend.
    assert_eq!(admitted(&limiter, &mut store, 5, up(T0 + 400 * MS)), 0);
}

#[test]
fn with_the_service_down_fail_open_uses_the_fallback_and_fail_closed_denies() {
    let open = limiter(
        r#", "fallback": {"policy": "fail_open", "limits": [{"requests": 5, "per": "minute"}]}"#,
    );
    let mut store = MemoryStore::default();
    admitted(&open, &mut store, 1, up(T0));
    apply_lease(&open, RuleId::new(0), KEY, &grant(50), T0, &mut store).unwrap();
    assert_eq!(
        admitted(&open, &mut store, 20, down(T0 + MS)),
        4,
        "grant ignored, fallback 5 less 1 spent"
    );

    let closed = limiter(r#", "fallback": {"policy": "fail_closed"}"#);
    let mut store = MemoryStore::default();
    assert_eq!(admitted(&closed, &mut store, 3, down(T0)), 0);
    // No lease yet, the service up: not refused, left to the service (one check, in the
    // exchange); the round is brought forward once the check answers, not before.
    let asked = closed.decide(&mut PlainRequest::get("/"), up(T0), &mut store);
    assert_eq!(asked.asked, vec![(RuleId::new(0), KEY.to_string())]);
    assert!(!asked.lease_exhausted, "no round while the check is out");
    apply_lease(&closed, RuleId::new(0), KEY, &grant(2), T0, &mut store).unwrap();
    assert_eq!(admitted(&closed, &mut store, 3, up(T0 + MS)), 2);
}

/// A fail-closed cached key the service decided (no lease) reports the request as demand its
/// lease did not cover (`denied`: the check counted it), once the check answered, so its next
/// sync entry sizes a lease for it; then its requests are decided here, and reported as spent.
#[test]
fn an_asked_key_gets_a_lease_at_the_next_sync() {
    let closed = limiter(r#", "fallback": {"policy": "fail_closed"}"#);
    let rule = RuleId::new(0);
    let mut store = MemoryStore::default();
    let key = (rule, KEY.to_string());
    for announced in [true, false] {
        let asked = closed.decide(&mut PlainRequest::get("/"), up(T0), &mut store);
        assert_eq!(asked.asked, vec![key.clone()]);
        assert!(
            asked.newly_unsynced.is_empty(),
            "not while its check is out"
        );
        // The check answered: the demand counted, the key announced once.
        assert_eq!(closed.demand(rule, KEY, T0, &mut store), announced);
    }
    let taken = take(&closed, rule, KEY, T0 + 50 * MS, 100_000, &mut store);
    let Taken::Entry(entry) = taken else {
        panic!("{taken:?}")
    };
    assert_eq!((entry.key.as_str(), entry.spent, entry.denied), (KEY, 0, 2));
    apply_lease(&closed, rule, KEY, &grant(2), T0 + 60 * MS, &mut store).unwrap();
    let decided = closed.decide(&mut PlainRequest::get("/"), up(T0 + 70 * MS), &mut store);
    assert!(decided.asked.is_empty(), "{decided:?}");
    assert!(matches!(decided.decision, Decision::Allow { .. }));
    let taken = take(&closed, rule, KEY, T0 + 80 * MS, 100_000, &mut store);
    let Taken::Entry(entry) = taken else {
        panic!("{taken:?}")
    };
    assert_eq!((entry.spent, entry.denied), (1, 0));
}

#[test]
fn a_spent_lease_on_an_empty_global_bucket_says_when_the_bucket_holds_a_token_again() {
    let limiter = limiter("");
    let mut store = MemoryStore::default();
    // 100 a second (a token every 10 ms): the service says the bucket is empty and 1.5 s from
    // full, so 50 tokens in debt; one token is back in 1.5 s - 99 × 10 ms = 510 ms.
    let in_debt = Lease {
        tokens: 2,
        ttl_ms: 300,
        remaining: 0,
        reset_ms: 1_500,
        token_ms: None,
        refused: None,
        penalty_ms: 0,
    };
    apply_lease(&limiter, RuleId::new(0), KEY, &in_debt, T0, &mut store).unwrap();
    assert_eq!(admitted(&limiter, &mut store, 2, up(T0 + MS)), 2);
    let denied = limiter.decide(&mut PlainRequest::get("/"), up(T0 + MS), &mut store);
    let Decision::Deny { retry_after_us, .. } = denied.decision else {
        panic!("{denied:?}")
    };
    assert_eq!(
        retry_after_us,
        510 * MS - MS,
        "from the global state, not one token's 10 ms"
    );
    // With tokens left globally (others' unspent leases), a token's time: the next sync may
    // bring a lease.
    let mut store = MemoryStore::default();
    let plenty = Lease {
        remaining: 40,
        reset_ms: 600,
        token_ms: None,
        ..in_debt
    };
    apply_lease(&limiter, RuleId::new(0), KEY, &plenty, T0, &mut store).unwrap();
    assert_eq!(admitted(&limiter, &mut store, 2, up(T0 + MS)), 2);
    let denied = limiter.decide(&mut PlainRequest::get("/"), up(T0 + MS), &mut store);
    let Decision::Deny { retry_after_us, .. } = denied.decision else {
        panic!("{denied:?}")
    };
    assert_eq!(retry_after_us, 10 * MS);
}
