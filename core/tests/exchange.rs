//! A request's life in core alone: decisions, strict checks and their answers or failures,
//! fallbacks, the breaker and refunds, with an in-memory store and a fake clock.

use sluice_core::policy::RuleId;
use sluice_core::protocol::CheckResponse;
use sluice_core::sync::proxy::read_state;
use sluice_core::{Effect, Exchange, Limiter, MemoryStore, Moment, Outcome, PlainRequest, Step};

const SECOND: u64 = 1_000_000;
const T0: u64 = 1_700_000_000 * SECOND;

fn limiter(json: &str) -> Limiter {
    Limiter::new(sluice_core::parse(json.as_bytes()).unwrap())
}

fn at(now_us: u64) -> Moment {
    Moment::at(now_us)
}

fn alice() -> PlainRequest {
    PlainRequest::get("/api/x").with_header("x-user", "alice")
}

fn start(
    limiter: &Limiter,
    store: &mut MemoryStore,
    moment: Moment,
) -> (Exchange, Step, Vec<Effect>) {
    Exchange::start(limiter, &mut alice(), None, moment, store)
}

fn checks(effects: &[Effect]) -> Vec<usize> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Check { check, .. } => Some(*check),
            _ => None,
        })
        .collect()
}

fn outcomes(effects: &[Effect]) -> Vec<(RuleId, Outcome)> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Outcome { rule, outcome } => Some((*rule, *outcome)),
            _ => None,
        })
        .collect()
}

fn allowed(remaining: u64) -> Option<CheckResponse> {
    Some(CheckResponse {
        allowed: true,
        remaining,
        retry_after_ms: 0,
        reset_ms: 500,
        lease: None,
    })
}

fn denied(retry_after_ms: u64) -> Option<CheckResponse> {
    Some(CheckResponse {
        allowed: false,
        remaining: 0,
        retry_after_ms,
        reset_ms: 10_000,
        lease: None,
    })
}

const LOCAL: &str = r#"{"headers": "draft", "rules": [{"name": "local", "key": ["header:x-user"],
    "limits": [{"requests": 2, "per": "minute"}]}]}"#;

#[test]
fn a_local_rule_answers_429_with_its_headers_and_body() {
    let limiter = limiter(LOCAL);
    let mut store = MemoryStore::default();
    for remaining in [1, 0] {
        let (mut exchange, step, effects) = start(&limiter, &mut store, at(T0));
        assert_eq!(step, Step::Continue);
        assert_eq!(outcomes(&effects), vec![(RuleId::new(0), Outcome::Allowed)]);
        let headers = exchange.response_headers(&limiter);
        assert!(
            headers.contains(&(
                "ratelimit",
                format!("\"local\";r={remaining};t={}", 30 * (2 - remaining))
            )),
            "{headers:?}"
        );
    }
    let (mut exchange, step, effects) = start(&limiter, &mut store, at(T0));
    let Step::Respond(reply) = step else {
        panic!("expected a 429, got {step:?}");
    };
    assert_eq!(reply.status, 429);
    assert!(
        reply.headers.get("retry-after") == Some("30"),
        "{:?}",
        reply.headers
    );
    assert!(reply.body.contains("\"rule\":\"local\""), "{}", reply.body);
    assert_eq!(outcomes(&effects), vec![(RuleId::new(0), Outcome::Denied)]);
    assert!(
        exchange.response_headers(&limiter).is_empty(),
        "a local reply carries its own headers"
    );
}

#[test]
fn the_emergency_bypass_skips_every_rule() {
    let limiter = limiter(LOCAL);
    let mut store = MemoryStore::default();
    let moment = Moment {
        bypass: true,
        ..at(T0)
    };
    for _ in 0..5 {
        let (_, step, effects) = start(&limiter, &mut store, moment);
        assert_eq!(step, Step::Continue);
        assert_eq!(effects, vec![Effect::Bypassed]);
    }
    assert!(store.is_empty(), "nothing counted");
}

const STRICT: &str = r#"{"headers": "draft",
    "service": {"cluster": "svc", "breaker_failures": 2, "breaker_cooldown_ms": 1000},
    "rules": [
      {"name": "local", "key": ["header:x-user"], "consistency": "local",
       "limits": [{"requests": 5, "per": "minute"}]},
      {"name": "exact", "key": ["header:x-user"], "consistency": "strict",
       "limits": [{"requests": 10, "per": "second"}],
       "fallback": {"policy": "fail_open", "limits": [{"requests": 1, "per": "minute"}]}}]}"#;

#[test]
fn a_strict_rule_waits_for_its_check_and_its_answer_sets_the_headers() {
    let limiter = limiter(STRICT);
    let mut store = MemoryStore::default();
    let (mut exchange, step, effects) = start(&limiter, &mut store, at(T0));
    assert_eq!(step, Step::Wait);
    let Some(Effect::Check { check, request, .. }) =
        effects.iter().find(|e| matches!(e, Effect::Check { .. }))
    else {
        panic!("no check in {effects:?}");
    };
    assert_eq!(request.key, "exact\u{1f}alice");
    assert_eq!(request.limits[0].requests, 10);
    assert_eq!(request.cost, 1);
    let (step, effects) = exchange.answered(&limiter, *check, allowed(2), at(T0), &mut store);
    assert_eq!(step, Some(Step::Continue));
    assert_eq!(outcomes(&effects), vec![(RuleId::new(1), Outcome::Allowed)]);
    let headers = exchange.response_headers(&limiter);
    assert!(
        headers.contains(&("ratelimit", "\"exact\";r=2;t=1".to_string())),
        "the tightest answer sets the headers: {headers:?}"
    );
    let (step, _) = exchange.answered(&limiter, *check, allowed(2), at(T0), &mut store);
    assert_eq!(step, None, "an answer comes once");
}

#[test]
fn a_strict_denial_refunds_what_the_local_rule_spent() {
    let limiter = limiter(STRICT);
    let mut store = MemoryStore::default();
    for _ in 0..3 {
        let (mut exchange, step, effects) = start(&limiter, &mut store, at(T0));
        assert_eq!(step, Step::Wait);
        let (step, effects) = exchange.answered(
            &limiter,
            checks(&effects)[0],
            denied(1_500),
            at(T0),
            &mut store,
        );
        let Some(Step::Respond(reply)) = step else {
            panic!("expected a 429, got {step:?}");
        };
        assert_eq!(reply.headers.get("retry-after"), Some("2"));
        assert!(reply.body.contains("\"rule\":\"exact\""), "{}", reply.body);
        assert_eq!(outcomes(&effects), vec![(RuleId::new(1), Outcome::Denied)]);
    }
    // The local rule (5 a minute) was given back every token: five more pass it.
    for i in 0..5 {
        let (mut exchange, _, effects) = start(&limiter, &mut store, at(T0));
        assert_eq!(
            outcomes(&effects),
            vec![(RuleId::new(0), Outcome::Allowed)],
            "request {i}"
        );
        let (step, _) = exchange.answered(
            &limiter,
            checks(&effects)[0],
            allowed(9),
            at(T0),
            &mut store,
        );
        assert_eq!(step, Some(Step::Continue));
    }
}

#[test]
fn failed_checks_fall_back_and_open_the_breaker() {
    let limiter = limiter(STRICT);
    let mut store = MemoryStore::default();
    // First failure: the fallback (1 a minute) admits.
    let (mut exchange, _, effects) = start(&limiter, &mut store, at(T0));
    let (step, effects) =
        exchange.answered(&limiter, checks(&effects)[0], None, at(T0), &mut store);
    assert_eq!(step, Some(Step::Continue));
    assert!(effects.contains(&Effect::CheckFailed));
    assert_eq!(read_state(&mut store).breaker.failures, 1);
    // Second failure: the fallback is spent, and the breaker opens.
    let (mut exchange, _, effects) = start(&limiter, &mut store, at(T0 + 1));
    let (step, _) = exchange.answered(&limiter, checks(&effects)[0], None, at(T0 + 1), &mut store);
    assert!(
        matches!(step, Some(Step::Respond(ref r)) if r.status == 429),
        "{step:?}"
    );
    let state = read_state(&mut store);
    assert_eq!(state.breaker.failures, 2);
    assert!(
        !state.breaker.service_up(2, T0 + 1),
        "open after two failures"
    );
    assert_eq!(
        state.breaker.open_until_us,
        T0 + 1 + SECOND,
        "cool-down × jitter 1.0"
    );
    // While it is open the host says so: no check goes out, the fallback decides at once.
    let down = Moment {
        service_up: false,
        ..at(T0 + 2)
    };
    let (_, step, effects) = start(&limiter, &mut store, down);
    assert!(checks(&effects).is_empty(), "{effects:?}");
    assert!(matches!(step, Step::Respond(ref r) if r.status == 429));
}

#[test]
fn a_failed_check_leaves_the_sync_round_alone() {
    let limiter = limiter(STRICT);
    let mut store = MemoryStore::default();
    let claimed = sluice_core::sync::proxy::claim_round(&mut store, T0, 100, 250_000, 2).unwrap();
    let (mut exchange, _, effects) = start(&limiter, &mut store, at(T0));
    exchange.answered(&limiter, checks(&effects)[0], None, at(T0), &mut store);
    assert_eq!(
        read_state(&mut store).busy_until_us,
        claimed.busy_until_us,
        "the round in flight still owns the sync"
    );
}

#[test]
fn fail_closed_answers_503_when_the_check_fails() {
    let limiter = limiter(
        r#"{"service": {"cluster": "svc"}, "rules": [{"name": "exact", "key": ["header:x-user"],
        "consistency": "strict", "limits": [{"requests": 10, "per": "second"}],
        "fallback": {"policy": "fail_closed"}}]}"#,
    );
    let mut store = MemoryStore::default();
    let (mut exchange, _, effects) = start(&limiter, &mut store, at(T0));
    let (step, _) = exchange.answered(&limiter, checks(&effects)[0], None, at(T0), &mut store);
    // Not a rate limit: the limiter could not decide.
    assert!(
        matches!(step, Some(Step::Respond(ref r)) if r.status == 503 && r.body.contains("limiter_unavailable")),
        "{step:?}"
    );
}

#[test]
fn every_strict_answer_is_awaited_and_a_shadow_denial_only_counts() {
    let limiter = limiter(
        r#"{"service": {"cluster": "svc"}, "rules": [
        {"name": "a", "key": ["header:x-user"], "consistency": "strict", "mode": "shadow",
         "limits": [{"requests": 10, "per": "second"}]},
        {"name": "b", "key": ["header:x-user"], "consistency": "strict",
         "limits": [{"requests": 10, "per": "second"}]}]}"#,
    );
    let mut store = MemoryStore::default();
    let (mut exchange, step, effects) = start(&limiter, &mut store, at(T0));
    assert_eq!(step, Step::Wait);
    let ids = checks(&effects);
    assert_eq!(ids.len(), 2);
    let (step, effects) = exchange.answered(&limiter, ids[0], denied(100), at(T0), &mut store);
    assert_eq!(step, None, "one answer of two");
    assert_eq!(
        outcomes(&effects),
        vec![(RuleId::new(0), Outcome::ShadowDenied)]
    );
    let (step, _) = exchange.answered(&limiter, ids[1], allowed(5), at(T0), &mut store);
    assert_eq!(step, Some(Step::Continue), "a shadow rule never denies");
}

/// A store whose rule records cannot be written (the host refuses every write outside the
/// sync state).
#[derive(Default)]
struct Refusing(MemoryStore);

impl sluice_core::Store for Refusing {
    fn get(&mut self, key: &str) -> Result<Option<(Vec<u8>, u32)>, sluice_core::StoreError> {
        self.0.get(key)
    }
    fn set(
        &mut self,
        key: &str,
        value: &[u8],
        version: u32,
    ) -> Result<bool, sluice_core::StoreError> {
        if key.contains("sync") {
            return self.0.set(key, value, version);
        }
        Err(sluice_core::StoreError::Unavailable)
    }
}

#[test]
fn a_request_let_through_uncounted_and_one_refused_by_a_failed_closed_rule_are_told_apart() {
    // The rule's state cannot be updated: the request goes on, uncounted.
    let local = limiter(
        r#"{"rules": [{"name": "local", "key": ["header:x-user"],
        "limits": [{"requests": 10, "per": "second"}]}]}"#,
    );
    let mut refusing = Refusing::default();
    let (_, step, effects) = Exchange::start(&local, &mut alice(), None, at(T0), &mut refusing);
    assert_eq!(step, Step::Continue);
    assert_eq!(
        outcomes(&effects),
        vec![(RuleId::new(0), Outcome::Uncounted)]
    );
    // A strict rule that fails closed, its check failed: refused.
    let closed = limiter(
        r#"{"service": {"cluster": "svc"}, "rules": [{"name": "exact", "key": ["header:x-user"],
        "consistency": "strict", "limits": [{"requests": 10, "per": "second"}],
        "fallback": {"policy": "fail_closed"}}]}"#,
    );
    let mut store = MemoryStore::default();
    let (mut exchange, _, effects) = start(&closed, &mut store, at(T0));
    let (step, effects) = exchange.answered(&closed, checks(&effects)[0], None, at(T0), &mut store);
    assert!(
        matches!(step, Some(Step::Respond(ref r)) if r.status == 503),
        "{step:?}"
    );
    assert_eq!(
        outcomes(&effects),
        vec![(RuleId::new(0), Outcome::FailedClosed)]
    );
}

/// A cached rule of 20 a minute that fails closed, charged what responses report.
const CACHED_CLOSED: &str = r#"{"service": {"cluster": "svc", "breaker_failures": 3},
    "rules": [{"name": "shared", "key": ["header:x-user"], "consistency": "cached",
       "cost_header": "x-cost",
       "limits": [{"requests": 20, "per": "minute"}], "fallback": {"policy": "fail_closed"}}]}"#;

fn lease(tokens: u64) -> sluice_core::protocol::Lease {
    sluice_core::protocol::Lease {
        tokens,
        ttl_ms: 300,
        remaining: 15,
        reset_ms: 15_000,
        token_ms: Some(0),
        refused: None,
        penalty_ms: 0,
    }
}

/// A fail-closed cached rule without a lease (a new key, or one idle for three sync intervals
/// until its lease lapsed) while the service is up is not refused "the rate limit service
/// cannot be reached": the service decides the request, one check as for a strict rule, and the
/// key is announced (and the round brought forward) so the next sync brings it a lease. Only a
/// check that fails, or the service down, answers the 503.
#[test]
fn a_fail_closed_cached_key_without_a_lease_asks_the_service_instead_of_a_503() {
    let limiter = limiter(CACHED_CLOSED);
    let rule = RuleId::new(0);
    let key = "shared\u{1f}alice".to_string();
    let mut store = MemoryStore::default();
    // A new key: checked, announced, the round hurried; nothing answered yet.
    let (mut exchange, step, effects) = start(&limiter, &mut store, at(T0));
    assert_eq!(step, Step::Wait, "{effects:?}");
    let Some(Effect::Check { check, request, .. }) =
        effects.iter().find(|e| matches!(e, Effect::Check { .. }))
    else {
        panic!("no check in {effects:?}");
    };
    assert_eq!(
        (
            request.key.as_str(),
            request.limits[0].requests,
            request.cost
        ),
        (key.as_str(), 20, 1)
    );
    // Not announced while its check is out: a sync that carried the key now could lease its
    // tokens to this proxy before the check reaches Redis, and the check would deny the request
    // for want of the room that lease holds.
    assert!(
        !effects
            .iter()
            .any(|e| matches!(e, Effect::Announce { .. } | Effect::Hurry)),
        "{effects:?}"
    );
    let taken = sluice_core::sync::proxy::take(&limiter, rule, &key, T0, 100_000, &mut store);
    assert!(
        !matches!(taken, sluice_core::sync::proxy::Taken::Entry(_)),
        "a sync composed while the check is out leaves the key alone: {taken:?}"
    );
    assert!(outcomes(&effects).is_empty(), "decided by the answer");
    // Admitted: on upstream with the service's headers; the key is announced now, the round
    // hurried, so the next sync brings a lease. The cost the response reports is charged to the
    // key, for the sync (the check counted the request itself).
    let (step, effects) = exchange.answered(&limiter, *check, allowed(12), at(T0), &mut store);
    assert_eq!(step, Some(Step::Continue));
    assert!(effects.contains(&Effect::Announce {
        rule,
        key: key.clone()
    }));
    assert!(effects.contains(&Effect::Hurry), "{effects:?}");
    assert_eq!(outcomes(&effects), vec![(rule, Outcome::Allowed)]);
    assert_eq!(exchange.cost_headers(&limiter), vec!["x-cost"]);
    exchange.response_cost(&limiter, "x-cost", "4", T0, &mut store);
    let taken = sluice_core::sync::proxy::take(&limiter, rule, &key, T0, 100_000, &mut store);
    let sluice_core::sync::proxy::Taken::Entry(entry) = taken else {
        panic!("{taken:?}")
    };
    assert_eq!(
        (entry.spent, entry.denied),
        (4, 1),
        "what was charged; the request the check counted is demand the lease did not cover"
    );

    // Denied by the service: its 429 and wait, not a 503.
    let (mut exchange, _, effects) = start(&limiter, &mut store, at(T0));
    let (step, _) = exchange.answered(
        &limiter,
        checks(&effects)[0],
        denied(1_500),
        at(T0),
        &mut store,
    );
    let Some(Step::Respond(reply)) = step else {
        panic!("{step:?}")
    };
    assert_eq!(
        (reply.status, reply.headers.get("retry-after")),
        (429, Some("2"))
    );

    // With a lease it decides here, with no check; once the lease lapses (idle for its 300 ms),
    // it asks again.
    sluice_core::sync::proxy::apply_lease(&limiter, rule, &key, &lease(5), T0, &mut store).unwrap();
    let (_, step, effects) = start(&limiter, &mut store, at(T0 + 1_000));
    assert_eq!(step, Step::Continue);
    assert!(checks(&effects).is_empty(), "{effects:?}");
    let idle = T0 + 2 * SECOND;
    let (mut exchange, step, effects) = start(&limiter, &mut store, at(idle));
    assert_eq!(step, Step::Wait, "after idle: {effects:?}");
    // The check fails (the service went away meanwhile): now the 503, and the breaker counts it.
    let (step, effects) =
        exchange.answered(&limiter, checks(&effects)[0], None, at(idle), &mut store);
    assert!(
        matches!(step, Some(Step::Respond(ref r)) if r.status == 503 && r.body.contains("limiter_unavailable")),
        "{step:?}"
    );
    assert!(effects.contains(&Effect::CheckFailed));
    assert_eq!(read_state(&mut store).breaker.failures, 1);
    // The service down (the breaker open): the 503 at once, no check.
    let down = Moment {
        service_up: false,
        ..at(idle)
    };
    let (_, step, effects) = start(&limiter, &mut store, down);
    assert!(checks(&effects).is_empty(), "{effects:?}");
    assert!(
        matches!(step, Step::Respond(ref r) if r.status == 503),
        "{step:?}"
    );
}

/// A key of a fail-closed cached rule whose counts wait for a sync (the service was away and its
/// lease lapsed meanwhile) keeps them through a check that fails: the sync still reports them.
/// The request the failed check could not decide is answered 503 and adds no demand.
#[test]
fn a_failed_check_of_a_cached_key_keeps_its_unsynced_counts() {
    let limiter = limiter(CACHED_CLOSED);
    let rule = RuleId::new(0);
    let key = "shared\u{1f}alice".to_string();
    let mut store = MemoryStore::default();
    sluice_core::sync::proxy::apply_lease(&limiter, rule, &key, &lease(5), T0, &mut store).unwrap();
    for _ in 0..3 {
        let (_, step, _) = start(&limiter, &mut store, at(T0 + 1_000));
        assert_eq!(step, Step::Continue);
    }
    let later = T0 + SECOND;
    let (mut exchange, _, effects) = start(&limiter, &mut store, at(later));
    exchange.answered(&limiter, checks(&effects)[0], None, at(later), &mut store);
    let taken = sluice_core::sync::proxy::take(&limiter, rule, &key, later, 100_000, &mut store);
    let sluice_core::sync::proxy::Taken::Entry(entry) = taken else {
        panic!("{taken:?}")
    };
    assert_eq!((entry.spent, entry.denied), (3, 0));
}

/// The check of a key without a lease and the sync it brings forward race: the sync may grant
/// the key a lease while the check is out, and the check then sets that lease aside as another
/// proxy's and denies for want of room the proxy itself holds. The lease admits the request
/// instead, spent from it (reported as spent, given back if another rule denies); a denial while
/// the lease has nothing left stands.
#[test]
fn a_lease_granted_while_the_check_was_out_admits_what_the_check_set_aside() {
    let limiter = limiter(CACHED_CLOSED);
    let rule = RuleId::new(0);
    let key = "shared\u{1f}alice".to_string();
    let mut store = MemoryStore::default();
    let (mut exchange, step, effects) = start(&limiter, &mut store, at(T0));
    assert_eq!(step, Step::Wait);
    let check = checks(&effects)[0];
    sluice_core::sync::proxy::take(&limiter, rule, &key, T0, 100_000, &mut store);
    sluice_core::sync::proxy::apply_lease(&limiter, rule, &key, &lease(1), T0, &mut store).unwrap();
    let (step, effects) = exchange.answered(&limiter, check, denied(600_000), at(T0), &mut store);
    assert_eq!(step, Some(Step::Continue), "{effects:?}");
    assert_eq!(outcomes(&effects), vec![(rule, Outcome::Allowed)]);
    assert!(
        effects.contains(&Effect::Announce {
            rule,
            key: key.clone()
        }),
        "its spend is announced for the sync: {effects:?}"
    );
    let taken = sluice_core::sync::proxy::take(&limiter, rule, &key, T0, 100_000, &mut store);
    let sluice_core::sync::proxy::Taken::Entry(entry) = taken else {
        panic!("{taken:?}")
    };
    assert_eq!((entry.spent, entry.denied), (1, 0), "spent from the lease");
    // The lease is spent: a denial of a check out meanwhile stands.
    sluice_core::sync::proxy::apply_lease(&limiter, rule, &key, &lease(0), T0, &mut store).unwrap();
    let later = T0 + SECOND;
    let (mut exchange, _, effects) = start(&limiter, &mut store, at(later));
    sluice_core::sync::proxy::apply_lease(&limiter, rule, &key, &lease(0), later, &mut store)
        .unwrap();
    let (step, _) = exchange.answered(
        &limiter,
        checks(&effects)[0],
        denied(600_000),
        at(later),
        &mut store,
    );
    assert!(
        matches!(step, Some(Step::Respond(ref r)) if r.status == 429),
        "{step:?}"
    );
}

/// The same race, with the check's answer first: the service had leased the key's rest to this
/// proxy before the check reached Redis, and the sync's answer with that lease is still on its
/// way. The denial tells the lease; the request is spent from it, and the sync's answer, when
/// it comes, installs the same grant less that spend: the grant is spent once. A check whose
/// request does not cover the lease (told none) still denies, and a strict rule's check never
/// names the proxy.
#[test]
fn a_lease_told_by_the_checks_denial_admits_once_and_the_syncs_answer_keeps_the_count() {
    let limiter = limiter(CACHED_CLOSED);
    let rule = RuleId::new(0);
    let key = "shared\u{1f}alice".to_string();
    let mut store = MemoryStore::default();
    let (mut exchange, step, effects) = start(&limiter, &mut store, at(T0));
    assert_eq!(step, Step::Wait);
    let asks = effects
        .iter()
        .any(|e| matches!(e, Effect::Check { asks: true, .. }));
    assert!(asks, "a cached key's check asks: {effects:?}");
    // The round carrying the key is composed (its counts taken) before the check's answer.
    sluice_core::sync::proxy::take(&limiter, rule, &key, T0, 100_000, &mut store);
    let told = Some(CheckResponse {
        lease: Some(sluice_core::protocol::CheckLease {
            tokens: 2,
            ttl_ms: 300,
        }),
        ..denied(600_000).unwrap()
    });
    let check = checks(&effects)[0];
    let (step, effects) = exchange.answered(&limiter, check, told, at(T0), &mut store);
    assert_eq!(step, Some(Step::Continue), "{effects:?}");
    assert_eq!(outcomes(&effects), vec![(rule, Outcome::Allowed)]);
    // The sync's answer: the same grant of 2, one of it spent already.
    sluice_core::sync::proxy::apply_lease(&limiter, rule, &key, &lease(2), T0, &mut store).unwrap();
    let mut admitted = 0;
    for i in 0..3 {
        let now = T0 + 1_000 * (i + 1);
        let (_, step, _) = start(&limiter, &mut store, at(now));
        if step == Step::Continue {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 1, "one of the grant's two was left");
    let taken = sluice_core::sync::proxy::take(&limiter, rule, &key, T0, 100_000, &mut store);
    let sluice_core::sync::proxy::Taken::Entry(entry) = taken else {
        panic!("{taken:?}")
    };
    assert_eq!(entry.spent, 2, "both reported spent from the lease");
    // Told no lease: the denial stands.
    let later = T0 + 10 * SECOND;
    let (mut exchange, _, effects) = start(&limiter, &mut store, at(later));
    let (step, _) = exchange.answered(
        &limiter,
        checks(&effects)[0],
        denied(600_000),
        at(later),
        &mut store,
    );
    assert!(
        matches!(step, Some(Step::Respond(ref r)) if r.status == 429),
        "{step:?}"
    );
    let strict = self::limiter(STRICT);
    let (_, _, effects) = start(&strict, &mut MemoryStore::default(), at(T0));
    let asks: Vec<bool> = effects
        .iter()
        .filter_map(|e| match e {
            Effect::Check { asks, .. } => Some(*asks),
            _ => None,
        })
        .collect();
    assert_eq!(asks, vec![false], "{effects:?}");
}
