//! A rule's `penalty` shared through the service, on a real Redis with a fake clock: the syncs
//! (`lua/sync.lua`, `lua/sync_window.lua`) and the strict checks (`lua/check.lua`) start it only
//! where the service sees the key over its limit itself (by what it leased and counted, without
//! the largest debtor's spend beyond its leases), answer it to every proxy of the key (an empty
//! grant and the time left), and each proxy's penalty bounds it; every hostile value refused,
//! naming its field. Needs `redis-server` (the `redis` feature).
#![cfg(feature = "redis")]

mod common;

use axum::http::StatusCode;
use common::{batch, post, state};
use serde_json::json;
use sluice_counter_service::{check_handler, keys, sync_handler, AppState};
use sluice_protocol::{AlgorithmSpec, CheckRequest, Lease, LimitSpec, SyncEntry, SyncRequest};
use sluice_tests::redis::{Redis, Reply};

const T0: u64 = 1_700_000_000_000_000;
const SECOND: u64 = 1_000_000;
const INTERVAL_MS: u64 = 100;
const TEN_MINUTES_MS: u64 = 600_000;
/// 5 a minute, burst 5: a login limit.
const FIVE: LimitSpec = LimitSpec::token_bucket(5, 60_000, 5);

fn report(key: &str, limits: &[LimitSpec], spent: u64, denied: u64, penalty_ms: u64) -> SyncEntry {
    SyncEntry {
        key: key.into(),
        limits: limits.to_vec(),
        spent,
        denied,
        round: 0,
        penalty_ms,
    }
}

fn one(proxy: &str, entry: SyncEntry) -> SyncRequest {
    batch(proxy, INTERVAL_MS, vec![entry])
}

async fn sync_at(state: &AppState, request: &SyncRequest, now: u64) -> Lease {
    sync_handler::apply(state, request, now).await.unwrap()[0].clone()
}

async fn check_at(
    state: &AppState,
    limits: &[LimitSpec],
    penalty_ms: u64,
    now: u64,
) -> (bool, u64) {
    let request = CheckRequest {
        key: "login\u{1f}alice".into(),
        limits: limits.to_vec(),
        cost: 1,
        penalty_ms,
        proxy: None,
    };
    let answer = check_handler::decide(state, &request, None, now)
        .await
        .unwrap();
    (answer.allowed, answer.retry_after_ms)
}

const ALICE: &str = "login\u{1f}alice";
const BOB: &str = "login\u{1f}bob";
const CAROL: &str = "login\u{1f}carol";

/// Whether Redis holds a penalty for `key` under `limit`.
fn penalized(redis: &Redis, key: &str, limit: &LimitSpec) -> bool {
    let penalty = format!("{}:penalty", keys::limit_key(key, limit));
    redis.text(&["EXISTS", &penalty]).unwrap() == "1"
}

/// Proxy a spends the key's five and is denied more: the service has nothing left to grant, so
/// the key is over: its penalty starts, and every proxy syncing the key is answered it (an empty
/// grant) until it ends, whatever it reports.
#[tokio::test]
async fn denials_with_nothing_left_start_a_penalty_every_proxy_is_answered() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let first = sync_at(
        &state,
        &one("a", report(ALICE, &[FIVE], 0, 1, TEN_MINUTES_MS)),
        T0,
    )
    .await;
    assert!(first.tokens >= 5 && first.penalty_ms == 0, "{first:?}");
    let over = sync_at(
        &state,
        &one("a", report(ALICE, &[FIVE], 5, 3, TEN_MINUTES_MS)),
        T0 + SECOND,
    )
    .await;
    assert_eq!(
        (over.tokens, over.penalty_ms),
        (0, TEN_MINUTES_MS),
        "{over:?}"
    );
    // Proxy b, which had seen nothing of it, is answered the penalty's time left.
    let b = sync_at(
        &state,
        &one("b", report(ALICE, &[FIVE], 0, 1, TEN_MINUTES_MS)),
        T0 + 121 * SECOND,
    )
    .await;
    assert_eq!((b.tokens, b.penalty_ms), (0, 480_000), "{b:?}");
    // A minute before its end the bucket is long full, still nothing; at its end, a grant.
    let late = sync_at(
        &state,
        &one("b", report(ALICE, &[FIVE], 0, 9, TEN_MINUTES_MS)),
        T0 + 541 * SECOND,
    )
    .await;
    assert_eq!((late.tokens, late.penalty_ms), (0, 60_000), "{late:?}");
    let after = sync_at(
        &state,
        &one("b", report(ALICE, &[FIVE], 0, 1, TEN_MINUTES_MS)),
        T0 + 601 * SECOND,
    )
    .await;
    assert!(after.tokens > 0 && after.penalty_ms == 0, "{after:?}");
    // A strict check of the same limits sees the same penalty (one key per key and limits):
    // b spends that grant and is denied more.
    let again = sync_at(
        &state,
        &one("b", report(ALICE, &[FIVE], after.tokens, 1, TEN_MINUTES_MS)),
        T0 + 602 * SECOND,
    )
    .await;
    assert_eq!(again.penalty_ms, TEN_MINUTES_MS, "{again:?}");
    let strict = check_at(&state, &[FIVE], TEN_MINUTES_MS, T0 + 603 * SECOND).await;
    assert_eq!(strict, (false, 599_000));
}

/// A cached key's check races its sync: the sync leased the rest of the key to proxy a before
/// a's next check reached Redis. The check is denied (the lease is set aside as any proxy's),
/// but the key is not over its limit: no penalty starts, and a is told the lease it holds (its
/// sync's answer may not have reached it yet). The same check from proxy b, which holds no
/// lease, is over: it is told none and starts the penalty.
#[tokio::test]
async fn a_check_denied_by_the_askers_own_lease_starts_no_penalty_and_tells_the_lease() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    assert_eq!(
        check_at(&state, &[FIVE], TEN_MINUTES_MS, T0).await,
        (true, 0)
    );
    let grant = sync_at(
        &state,
        &one("a", report(ALICE, &[FIVE], 0, 1, TEN_MINUTES_MS)),
        T0 + 10_000,
    )
    .await;
    assert_eq!(grant.tokens, 4, "the rest of the bucket: {grant:?}");
    let ask = |proxy: &'static str| {
        let state = state.clone();
        async move {
            let request = CheckRequest {
                key: ALICE.into(),
                limits: vec![FIVE],
                cost: 1,
                penalty_ms: TEN_MINUTES_MS,
                proxy: Some(proxy.into()),
            };
            check_handler::decide(&state, &request, Some(proxy), T0 + 20_000)
                .await
                .unwrap()
        }
    };
    let mine = ask("a").await;
    assert!(!mine.allowed, "{mine:?}");
    let lease = mine.lease.expect("a's own lease");
    assert_eq!(lease.tokens, 4, "{mine:?}");
    assert!(
        lease.ttl_ms > 0 && lease.ttl_ms <= grant.ttl_ms,
        "{mine:?} {grant:?}"
    );
    assert!(!penalized(&redis, ALICE, &FIVE), "a's own lease covers it");
    let theirs = ask("b").await;
    assert_eq!((theirs.allowed, theirs.lease), (false, None), "{theirs:?}");
    assert!(
        penalized(&redis, ALICE, &FIVE),
        "b's check is over the limit"
    );
}

/// Attacker's test: one proxy's credential reporting denials on a key that still has tokens
/// (the service would grant them) starts no penalty: its denials speak for its own lease. And a
/// rule without a penalty is never answered one.
#[tokio::test]
async fn denials_while_the_key_has_tokens_start_nothing() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    for i in 0..5 {
        let grant = sync_at(
            &state,
            &one("evil", report(ALICE, &[FIVE], 0, 1_000, 366 * 86_400_000)),
            T0 + i * SECOND,
        )
        .await;
        assert!(grant.tokens > 0 && grant.penalty_ms == 0, "{grant:?}");
    }
    let honest = sync_at(
        &state,
        &one("b", report(ALICE, &[FIVE], 1, 0, TEN_MINUTES_MS)),
        T0 + 6 * SECOND,
    )
    .await;
    assert_eq!(honest.penalty_ms, 0, "{honest:?}");
    // Over, but without a penalty configured: none.
    let none = sync_at(
        &state,
        &one("c", report("login\u{1f}bob", &[FIVE], 5, 3, 0)),
        T0,
    )
    .await;
    assert_eq!((none.tokens, none.penalty_ms), (0, 0), "{none:?}");
}

/// Attacker's test: a proxy that sends its own limits for a key (here 1 a year, so one request
/// puts it over) and the longest penalty starts a penalty on its own limits' key only; and a
/// proxy with a longer penalty than another's cannot keep the other's key out longer than the
/// other's own penalty.
#[tokio::test]
async fn a_proxy_cannot_lengthen_or_place_a_penalty_on_others_limits() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let yearly = LimitSpec::token_bucket(1, 366 * 86_400_000, 1);
    let year = 366 * 86_400_000;
    // (A penalty starts from what the service leased: the proxy takes the key's one token as a
    // lease, then spends it and is denied more.)
    let lease = sync_at(
        &state,
        &one("evil", report(ALICE, &[yearly], 0, 1, year)),
        T0 - SECOND,
    )
    .await;
    assert_eq!((lease.tokens, lease.penalty_ms), (1, 0), "{lease:?}");
    let own = sync_at(
        &state,
        &one("evil", report(ALICE, &[yearly], 2, 5, year)),
        T0,
    )
    .await;
    assert_eq!(own.penalty_ms, year, "{own:?}");
    let honest = sync_at(
        &state,
        &one("b", report(ALICE, &[FIVE], 1, 0, TEN_MINUTES_MS)),
        T0 + SECOND,
    )
    .await;
    assert!(
        honest.tokens > 0 && honest.penalty_ms == 0,
        "another key: {honest:?}"
    );
    assert!(
        check_at(&state, &[FIVE], TEN_MINUTES_MS, T0 + 2 * SECOND)
            .await
            .0
    );

    // On the honest limits, the evil proxy takes the bucket as a lease, then drains it (its spend
    // is cut to what one report may hold) with the longest penalty: an honest proxy honours its
    // own 10 minutes from the start, no more.
    let lease = sync_at(
        &state,
        &one("evil", report(ALICE, &[FIVE], 0, 100, year)),
        T0 + 2 * SECOND,
    )
    .await;
    assert!(lease.tokens >= 3 && lease.penalty_ms == 0, "{lease:?}");
    let drained = sync_at(
        &state,
        &one("evil", report(ALICE, &[FIVE], 1_000, 1, year)),
        T0 + 3 * SECOND,
    )
    .await;
    assert_eq!(drained.penalty_ms, year, "{drained:?}");
    let at = T0 + 3 * SECOND + 599 * SECOND;
    let b = sync_at(
        &state,
        &one("b", report(ALICE, &[FIVE], 0, 1, TEN_MINUTES_MS)),
        at,
    )
    .await;
    assert_eq!(b.penalty_ms, 1_000, "{b:?}");
    assert_eq!(
        check_at(&state, &[FIVE], TEN_MINUTES_MS, at).await,
        (false, 1_000)
    );
    let free = check_at(&state, &[FIVE], TEN_MINUTES_MS, at + SECOND).await;
    assert_ne!(free.1, year, "never the year: {free:?}");
    assert!(free.1 < TEN_MINUTES_MS, "{free:?}");
}

/// A report whose spend of the lease the service granted puts the key in debt (the lease holds
/// the refill due over 1.5 intervals, and the proxy spent it at once) shows it over: the
/// penalty starts without a denial.
#[tokio::test]
async fn a_spend_of_a_lease_past_the_limit_starts_a_penalty() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let ten = LimitSpec::token_bucket(10, 1_000, 10);
    let lease = sync_at(
        &state,
        &one("a", report(ALICE, &[ten], 0, 100, TEN_MINUTES_MS)),
        T0,
    )
    .await;
    assert_eq!((lease.tokens, lease.penalty_ms), (11, 0), "{lease:?}");
    let debt = sync_at(
        &state,
        &one("a", report(ALICE, &[ten], 11, 0, TEN_MINUTES_MS)),
        T0 + 10_000,
    )
    .await;
    assert_eq!(
        (debt.tokens, debt.penalty_ms),
        (0, TEN_MINUTES_MS),
        "{debt:?}"
    );
    let tokens: f64 = redis
        .text(&["HGET", &keys::limit_key(ALICE, &ten), "tokens"])
        .unwrap()
        .parse()
        .unwrap();
    assert!(tokens < 0.0, "{tokens}");
}

/// A cached window: the same, through `lua/sync_window.lua`.
#[tokio::test]
async fn a_window_starts_and_answers_its_penalty() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let hourly = LimitSpec::window(AlgorithmSpec::FixedWindow, 3, 3_600_000);
    let lease = sync_at(
        &state,
        &one("a", report(ALICE, &[hourly], 0, 5, TEN_MINUTES_MS)),
        T0 - SECOND,
    )
    .await;
    assert_eq!((lease.tokens, lease.penalty_ms), (3, 0), "{lease:?}");
    let over = sync_at(
        &state,
        &one("a", report(ALICE, &[hourly], 3, 2, TEN_MINUTES_MS)),
        T0,
    )
    .await;
    assert_eq!(
        (over.tokens, over.penalty_ms),
        (0, TEN_MINUTES_MS),
        "{over:?}"
    );
    let b = sync_at(
        &state,
        &one("b", report(ALICE, &[hourly], 0, 1, TEN_MINUTES_MS)),
        T0 + 60 * SECOND,
    )
    .await;
    assert_eq!((b.tokens, b.penalty_ms), (0, 540_000), "{b:?}");
    let room = sync_at(
        &state,
        &one("c", report(ALICE, &[hourly], 1, 0, TEN_MINUTES_MS)),
        T0 + 30 * SECOND + 2 * 3_600 * SECOND,
    )
    .await;
    assert_eq!(
        room.penalty_ms, 0,
        "a new window, the penalty over: {room:?}"
    );
}

/// Attacker's test: a penalty out of bounds (under a second, over 366 days, negative, not a
/// number) is refused naming its field: the entry alone in a sync, the request in a check.
#[tokio::test]
async fn a_penalty_out_of_bounds_is_refused_naming_it() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    for bad in [1, 999, 366 * 86_400_000 + 1, u64::MAX] {
        let grant = sync_at(&state, &one("a", report(ALICE, &[FIVE], 1, 0, bad)), T0).await;
        let reason = grant.refused.unwrap_or_default();
        assert!(reason.contains("entries[0].penalty_ms"), "{bad}: {reason}");
        let request = CheckRequest {
            key: ALICE.into(),
            limits: vec![FIVE],
            cost: 1,
            penalty_ms: bad,
            proxy: None,
        };
        let answer = post(&state, "/v1/check", &json!(request)).await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{answer:?}");
        assert!(
            answer.body["message"]
                .as_str()
                .unwrap()
                .contains("penalty_ms"),
            "{answer:?}"
        );
    }
    for bad in [json!(-1), json!(1.5), json!("10m"), json!(1e30)] {
        let body = json!({"key": ALICE, "limits": [FIVE], "cost": 1, "penalty_ms": bad});
        let answer = post(&state, "/v1/check", &body).await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{bad}: {answer:?}");
    }
    // Nothing was written for them.
    assert!(!penalized(&redis, ALICE, &FIVE));
    // The bounds themselves are taken.
    for good in [1_000, 366 * 86_400_000] {
        let grant = sync_at(&state, &one("a", report(ALICE, &[FIVE], 1, 0, good)), T0).await;
        assert!(grant.refused.is_none(), "{good}: {grant:?}");
    }
}

/// Attacker's test: a strict check whose cost is more than the smallest burst of its limits
/// (no request of a rule could cost it: the configuration refuses such a rule) is refused 400
/// naming `cost`, and so denies nothing and starts no penalty: the key is still admitted by a
/// check of a sluice proxy's cost. A cost of the smallest burst itself is taken.
#[tokio::test]
async fn a_check_costing_more_than_any_burst_is_refused_and_starts_no_penalty() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let hourly = LimitSpec::token_bucket(100, 3_600_000, 50);
    for (limits, cost) in [
        (vec![FIVE], 1u64 << 31),
        (vec![FIVE], 6),
        (vec![hourly, FIVE], 6),
        (vec![FIVE, hourly], 1u64 << 31),
    ] {
        let body = json!({"key": ALICE, "limits": limits, "cost": cost,
                          "penalty_ms": TEN_MINUTES_MS});
        let answer = post(&state, "/v1/check", &body).await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{cost}: {answer:?}");
        let message = answer.body["message"].as_str().unwrap_or_default();
        assert!(message.starts_with("cost: "), "{cost}: {answer:?}");
        assert!(message.contains("no request could pass"), "{answer:?}");
    }
    assert!(!penalized(&redis, ALICE, &FIVE));
    assert_eq!(
        check_at(&state, &[FIVE], TEN_MINUTES_MS, T0).await,
        (true, 0)
    );
    // The whole burst at once is a cost a rule may have.
    let body = json!({"key": "login\u{1f}bob", "limits": [FIVE], "cost": 5,
                      "penalty_ms": TEN_MINUTES_MS});
    let answer = post(&state, "/v1/check", &body).await;
    assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
    assert_eq!(answer.body["allowed"], true, "{answer:?}");
    // What a credential can still do, as the key's own clients could (docs/security.md): spend
    // the key past its limit, its next check denied and its penalty started.
    let body = json!({"key": "login\u{1f}bob", "limits": [FIVE], "penalty_ms": TEN_MINUTES_MS});
    let answer = post(&state, "/v1/check", &body).await;
    assert_eq!(answer.body["allowed"], false, "{answer:?}");
    assert_eq!(answer.body["retry_after_ms"], TEN_MINUTES_MS, "{answer:?}");
}

/// The part of `key`'s hash under `limit` that holds debtors' unleased debts (`u:` fields).
fn debts(redis: &Redis, key: &str, limit: &LimitSpec) -> Vec<String> {
    let Reply::Array(fields) = redis
        .query(&["HKEYS", &keys::limit_key(key, limit)])
        .unwrap()
    else {
        panic!("HKEYS answers an array");
    };
    let mut debts: Vec<String> = fields
        .iter()
        .filter_map(Reply::text)
        .filter(|field| field.starts_with("u:"))
        .map(str::to_owned)
        .collect();
    debts.sort();
    debts
}

fn tokens(redis: &Redis, key: &str, limit: &LimitSpec) -> f64 {
    redis
        .text(&["HGET", &keys::limit_key(key, limit), "tokens"])
        .unwrap()
        .parse()
        .unwrap()
}

/// Attacker's test: a proxy credential reports spend it was never leased on a key it never
/// synced (a whole bucket and more, with denials, as a fallback that admitted everything would):
/// it is counted (the key's bucket in debt, denied to everyone until it refills) but starts no
/// penalty, however often and however much it reports; an honest proxy then denied on the key
/// (nothing to grant) starts none either, nor a strict check, which is denied by the count.
#[tokio::test]
async fn spend_never_leased_starts_no_penalty_by_itself() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let first = sync_at(
        &state,
        &one("evil", report(ALICE, &[FIVE], 9, 5, TEN_MINUTES_MS)),
        T0,
    )
    .await;
    assert_eq!((first.tokens, first.penalty_ms), (0, 0), "{first:?}");
    assert!(tokens(&redis, ALICE, &FIVE) < 0.0);
    for i in 1..=5 {
        let again = sync_at(
            &state,
            &one("evil", report(ALICE, &[FIVE], 1_000, 1_000, TEN_MINUTES_MS)),
            T0 + i * 100_000,
        )
        .await;
        assert_eq!((again.tokens, again.penalty_ms), (0, 0), "{i}: {again:?}");
    }
    let honest = sync_at(
        &state,
        &one("b", report(ALICE, &[FIVE], 0, 3, TEN_MINUTES_MS)),
        T0 + SECOND,
    )
    .await;
    assert_eq!((honest.tokens, honest.penalty_ms), (0, 0), "{honest:?}");
    let (allowed, retry_after_ms) = check_at(&state, &[FIVE], TEN_MINUTES_MS, T0 + SECOND).await;
    assert!(
        !allowed && retry_after_ms < TEN_MINUTES_MS,
        "{retry_after_ms}"
    );
    assert!(!penalized(&redis, ALICE, &FIVE));
    assert_eq!(debts(&redis, ALICE, &FIVE), ["u:evil"]);
}

/// An honest proxy's report after a fallback: it spent its lease and, once the lease lapsed
/// with the service out of reach, 4 more from its fallback. All 9 are debited (the count is
/// honest: the key is in debt), the 4 beyond the lease are its debt, and its report alone starts
/// no penalty; its clients denied next start none while that debt weighs. Once the bucket is full
/// again the debt is gone, and the key over through a lease starts it. A second proxy whose own
/// fallback went over the same key meanwhile (the key's clients over through two proxies) does
/// start it.
#[tokio::test]
async fn an_honest_report_beyond_its_lease_is_debited_and_starts_no_penalty_alone() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    for key in [ALICE, BOB] {
        let lease = sync_at(
            &state,
            &one("a", report(key, &[FIVE], 0, 1, TEN_MINUTES_MS)),
            T0,
        )
        .await;
        assert_eq!((lease.tokens, lease.penalty_ms), (5, 0), "{lease:?}");
        let after = sync_at(
            &state,
            &one("a", report(key, &[FIVE], 9, 0, TEN_MINUTES_MS)),
            T0 + 30 * SECOND,
        )
        .await;
        assert_eq!((after.tokens, after.penalty_ms), (0, 0), "{after:?}");
        // 5 + 2.5 refilled - 9
        let left = tokens(&redis, key, &FIVE);
        assert!((left + 1.5).abs() < 1e-6, "{left}");
        assert_eq!(debts(&redis, key, &FIVE), ["u:a"]);
    }
    let denied = sync_at(
        &state,
        &one("a", report(ALICE, &[FIVE], 0, 4, TEN_MINUTES_MS)),
        T0 + 31 * SECOND,
    )
    .await;
    assert_eq!((denied.tokens, denied.penalty_ms), (0, 0), "{denied:?}");
    assert!(!penalized(&redis, ALICE, &FIVE));
    // Full again two minutes later: the debt is gone; a lease spent and denials start it.
    let lease = sync_at(
        &state,
        &one("a", report(ALICE, &[FIVE], 0, 1, TEN_MINUTES_MS)),
        T0 + 150 * SECOND,
    )
    .await;
    assert_eq!((lease.tokens, lease.penalty_ms), (5, 0), "{lease:?}");
    assert!(debts(&redis, ALICE, &FIVE).is_empty());
    let over = sync_at(
        &state,
        &one("a", report(ALICE, &[FIVE], 5, 3, TEN_MINUTES_MS)),
        T0 + 151 * SECOND,
    )
    .await;
    assert_eq!(
        (over.tokens, over.penalty_ms),
        (0, TEN_MINUTES_MS),
        "{over:?}"
    );

    // Bob: proxy b, never leased the key, admitted 3 from its fallback and denied 2.
    let b = sync_at(
        &state,
        &one("b", report(BOB, &[FIVE], 3, 2, TEN_MINUTES_MS)),
        T0 + 31 * SECOND,
    )
    .await;
    assert_eq!((b.tokens, b.penalty_ms), (0, TEN_MINUTES_MS), "{b:?}");
}

/// Attacker's test, strict checks: a credential's report of spend it was never leased (under no
/// penalty, so the sync starts none either way) puts the key in debt; a strict check then denied
/// is denied (the count) but starts no penalty. Once the bucket is full again, checks that spend
/// it and one denied (the service's own count) start it.
#[tokio::test]
async fn a_strict_check_starts_a_penalty_from_what_the_service_counted() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    sync_at(&state, &one("evil", report(ALICE, &[FIVE], 9, 5, 0)), T0).await;
    let (allowed, retry_after_ms) = check_at(&state, &[FIVE], TEN_MINUTES_MS, T0 + SECOND).await;
    assert!(
        !allowed && retry_after_ms < TEN_MINUTES_MS,
        "{retry_after_ms}"
    );
    assert!(!penalized(&redis, ALICE, &FIVE));
    let full = T0 + 200 * SECOND;
    for i in 0..5 {
        assert_eq!(
            check_at(&state, &[FIVE], TEN_MINUTES_MS, full + i).await,
            (true, 0),
            "{i}"
        );
    }
    assert!(debts(&redis, ALICE, &FIVE).is_empty());
    assert_eq!(
        check_at(&state, &[FIVE], TEN_MINUTES_MS, full + 5).await,
        (false, TEN_MINUTES_MS)
    );
    assert!(penalized(&redis, ALICE, &FIVE));
}

/// Attacker's test, fixed and sliding windows (`lua/sync_window.lua`, `lua/window.lua`): a count
/// reported beyond any lease is counted (the window full, every grant empty) but starts no
/// penalty by itself, nor does an honest proxy's denial or a strict check denied by that count.
#[tokio::test]
async fn a_window_count_never_leased_starts_no_penalty_by_itself() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    for (key, algorithm) in [
        (ALICE, AlgorithmSpec::FixedWindow),
        (BOB, AlgorithmSpec::SlidingWindow),
    ] {
        let hourly = LimitSpec::window(algorithm, 3, 3_600_000);
        let evil = sync_at(
            &state,
            &one("evil", report(key, &[hourly], 5, 2, TEN_MINUTES_MS)),
            T0,
        )
        .await;
        assert_eq!((evil.tokens, evil.penalty_ms), (0, 0), "{evil:?}");
        let honest = sync_at(
            &state,
            &one("b", report(key, &[hourly], 0, 2, TEN_MINUTES_MS)),
            T0 + SECOND,
        )
        .await;
        assert_eq!((honest.tokens, honest.penalty_ms), (0, 0), "{honest:?}");
        let request = CheckRequest {
            key: key.into(),
            limits: vec![hourly],
            cost: 1,
            penalty_ms: TEN_MINUTES_MS,
            proxy: None,
        };
        let answer = check_handler::decide(&state, &request, None, T0 + 2 * SECOND)
            .await
            .unwrap();
        assert!(!answer.allowed, "{answer:?}");
        assert!(!penalized(&redis, key, &hourly), "{algorithm:?}");
        assert_eq!(debts(&redis, key, &hourly), ["u:evil"]);
    }
}

/// Attacker's test: the debts a key keeps are bounded whatever the proxy ids a credential
/// reports under: 16 debtors and one field for all the others (`u:*`); and they leave with the
/// bucket once it is full again.
#[tokio::test]
async fn a_key_keeps_at_most_seventeen_debts_and_none_once_full() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    for i in 0..100 {
        sync_at(
            &state,
            &one(
                &format!("p{i}"),
                report(ALICE, &[FIVE], 1_000, 0, TEN_MINUTES_MS),
            ),
            T0 + i * 1_000,
        )
        .await;
    }
    let kept = debts(&redis, ALICE, &FIVE);
    assert_eq!(kept.len(), 17, "{kept:?}");
    assert!(kept.iter().any(|field| field == "u:*"), "{kept:?}");
    // Full again (its debt is at most a bucket and the refill of a report window: 10 tokens, two
    // minutes at 5 a minute).
    let later = sync_at(
        &state,
        &one("b", report(ALICE, &[FIVE], 0, 1, TEN_MINUTES_MS)),
        T0 + 300 * SECOND,
    )
    .await;
    assert!(later.tokens > 0, "{later:?}");
    assert!(debts(&redis, ALICE, &FIVE).is_empty());
}

/// The bound for an honest proxy: a key's first request is decided by the proxy's fallback (no
/// lease yet), so its first report is beyond any lease. Its clients then spend the lease it is
/// granted and are denied: the penalty waits until the refill has repaid that first request
/// (12 s at 5 a minute), then a lease spent and a denial start it.
#[tokio::test]
async fn a_fallbacks_spend_holds_the_penalty_back_until_the_refill_repays_it() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let lease = sync_at(
        &state,
        &one("a", report(CAROL, &[FIVE], 1, 0, TEN_MINUTES_MS)),
        T0,
    )
    .await;
    assert_eq!((lease.tokens, lease.penalty_ms), (4, 0), "{lease:?}");
    let spent = sync_at(
        &state,
        &one("a", report(CAROL, &[FIVE], 4, 3, TEN_MINUTES_MS)),
        T0 + SECOND,
    )
    .await;
    assert_eq!((spent.tokens, spent.penalty_ms), (0, 0), "{spent:?}");
    assert_eq!(debts(&redis, CAROL, &FIVE), ["u:a"]);
    // 12 s on, the refill has repaid it, and made a token: leased, spent, denied.
    let repaid = sync_at(
        &state,
        &one("a", report(CAROL, &[FIVE], 0, 5, TEN_MINUTES_MS)),
        T0 + 13 * SECOND,
    )
    .await;
    assert_eq!((repaid.tokens, repaid.penalty_ms), (1, 0), "{repaid:?}");
    assert!(debts(&redis, CAROL, &FIVE).is_empty());
    let over = sync_at(
        &state,
        &one("a", report(CAROL, &[FIVE], 1, 2, TEN_MINUTES_MS)),
        T0 + 13 * SECOND + 100_000,
    )
    .await;
    assert_eq!(
        (over.tokens, over.penalty_ms),
        (0, TEN_MINUTES_MS),
        "{over:?}"
    );
}

/// A state whose proxies hold the credentials of `tokens` (`name token` lines).
fn state_with_tokens(redis: &Redis, tokens: &str) -> AppState {
    let file = std::env::temp_dir().join(format!(
        "sluice-{}-penalty-tokens-{}",
        std::process::id(),
        tokens.len()
    ));
    std::fs::write(&file, tokens).unwrap();
    let settings =
        common::settings_without_token(&redis.url(), &["--tokens-file", file.to_str().unwrap()]);
    let state = AppState::new(settings).unwrap();
    std::fs::remove_file(&file).unwrap();
    state
}

/// One sync through the router under `token`, as proxy `proxy`: its answer's grant.
async fn sync_as(
    state: &AppState,
    token: &str,
    proxy: &str,
    entry: SyncEntry,
) -> serde_json::Value {
    let body = json!(one(proxy, entry));
    let answer = common::call(
        state,
        "POST",
        "/v1/sync",
        Some(token),
        axum::body::Body::from(body.to_string()),
    )
    .await;
    assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
    answer.body["grants"][0].clone()
}

/// Attacker's test, on Redis's clock through the router: with `--tokens-file`, a credential's
/// debt is its own whatever proxy ids it reports under: two ids' reports of a whole bucket
/// beyond any lease, with denials, are one debtor's and start no penalty. Two credentials whose
/// proxies' fallbacks each admitted a whole bucket and denied more (the key's clients over
/// through two proxies) do start it.
#[tokio::test]
async fn one_credential_is_one_debtor_whatever_its_proxy_ids() {
    let redis = Redis::start().unwrap();
    let state = state_with_tokens(&redis, "evil evil-token\nhonest honest-token\n");
    let yearly = LimitSpec::token_bucket(5, 366 * 86_400_000, 5);
    for proxy in ["p1", "p2"] {
        let grant = sync_as(
            &state,
            "evil-token",
            proxy,
            report(ALICE, &[yearly], 5, 5, TEN_MINUTES_MS),
        )
        .await;
        assert_eq!(
            grant["penalty_ms"],
            serde_json::Value::Null,
            "{proxy}: {grant}"
        );
    }
    assert!(!penalized(&redis, ALICE, &yearly));
    assert_eq!(debts(&redis, ALICE, &yearly), ["u:evil"]);

    for (token, proxy) in [("evil-token", "p1"), ("honest-token", "p1")] {
        sync_as(
            &state,
            token,
            proxy,
            report(BOB, &[yearly], 5, 5, TEN_MINUTES_MS),
        )
        .await;
    }
    assert!(penalized(&redis, BOB, &yearly));
    assert_eq!(debts(&redis, BOB, &yearly), ["u:evil", "u:honest"]);
}
