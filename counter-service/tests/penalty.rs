//! A rule's `penalty` shared through the service, on a real Redis with a fake clock: the syncs
//! (`lua/sync.lua`, `lua/sync_window.lua`) and the strict checks (`lua/check.lua`) start it only
//! where the service sees the key over its limit itself, answer it to every proxy of the key
//! (an empty grant and the time left), and each proxy's penalty bounds it; every hostile value
//! refused, naming its field.

mod common;

use axum::http::StatusCode;
use common::{batch, post, state};
use serde_json::json;
use sluice_counter_service::{check_handler, keys, sync_handler, AppState};
use sluice_protocol::{AlgorithmSpec, CheckRequest, Lease, LimitSpec, SyncEntry, SyncRequest};
use sluice_tests::redis::Redis;

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
    };
    let answer = check_handler::decide(state, &request, now).await.unwrap();
    (answer.allowed, answer.retry_after_ms)
}

const ALICE: &str = "login\u{1f}alice";

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
    // A strict check of the same limits sees the same penalty (one key per key and limits).
    sync_at(
        &state,
        &one("a", report(ALICE, &[FIVE], 5, 1, TEN_MINUTES_MS)),
        T0 + 602 * SECOND,
    )
    .await;
    let strict = check_at(&state, &[FIVE], TEN_MINUTES_MS, T0 + 603 * SECOND).await;
    assert_eq!(strict, (false, 599_000));
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

    // On the honest limits, the evil proxy drains the bucket (its spend is cut to what one report
    // may hold) with the longest penalty: an honest proxy honours its own 10 minutes from the
    // start, no more.
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

/// A report whose spend puts the key in debt (the proxies admitted more than it held, from
/// their fallbacks) shows it over: the penalty starts without a denial.
#[tokio::test]
async fn a_spend_past_the_limit_starts_a_penalty() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let debt = sync_at(
        &state,
        &one("a", report(ALICE, &[FIVE], 9, 0, TEN_MINUTES_MS)),
        T0,
    )
    .await;
    assert_eq!(
        (debt.tokens, debt.penalty_ms),
        (0, TEN_MINUTES_MS),
        "{debt:?}"
    );
    let tokens: f64 = redis
        .text(&["HGET", &keys::limit_key(ALICE, &FIVE), "tokens"])
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
