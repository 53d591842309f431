//! What `lua/sync.lua` promises, on a real Redis with a fake clock: leases never promise more
//! than the bucket holds, spend is debited, debt withholds grants, expired leases release, and
//! idle keys expire.

mod common;

use common::{batch, entry, state, TEN_PER_SECOND};
use sluice_core::protocol::{Grant, LimitSpec, SyncRequest};
use sluice_counter_service::{keys, sync, AppState};
use sluice_tests::redis::Redis;

const T0: u64 = 1_700_000_000_000_000;
const MS: u64 = 1_000;
/// 100 ms syncs and the default 3-interval lease: grants live 300 ms.
const INTERVAL_MS: u64 = 100;

async fn sync_at(state: &AppState, request: &SyncRequest, now: u64) -> Vec<Grant> {
    sync::apply(state, request, now).await.unwrap()
}

/// One proxy, one key, `spent` and `denied` since its last sync.
fn one(proxy: &str, key: &str, spent: u64, denied: u64) -> SyncRequest {
    batch(
        proxy,
        INTERVAL_MS,
        vec![entry(key, &[TEN_PER_SECOND], spent, denied)],
    )
}

fn field(redis: &Redis, key: &str, name: &str) -> Option<String> {
    redis
        .query(&["HGET", key, name])
        .unwrap()
        .text()
        .map(str::to_owned)
}

fn tokens(redis: &Redis, key: &str) -> f64 {
    field(redis, &keys::limit_key(key, &TEN_PER_SECOND), "tokens")
        .unwrap()
        .parse()
        .unwrap()
}

#[tokio::test]
async fn one_proxy_gets_at_most_the_burst() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let grants = sync_at(&state, &one("a", "k", 0, 1_000_000), T0).await;
    assert_eq!(
        grants,
        vec![Grant {
            tokens: 10,
            ttl_ms: 300,
            remaining: 10,
            reset_ms: 0
        }],
        "a new key is full; a huge demand gets the whole burst, no more"
    );
}

#[tokio::test]
async fn the_grant_follows_demand() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let limit = LimitSpec {
        requests: 1_000,
        period_ms: 1_000,
        burst: 1_000,
    };
    let request = batch("a", INTERVAL_MS, vec![entry("k", &[limit], 0, 0)]);
    let grants = sync_at(&state, &request, T0).await;
    assert_eq!(grants[0].tokens, 1, "no demand yet: one token");
    // 5 admitted + 0 denied over 100 ms is 50/s: two intervals of it is 10, plus one
    let request = batch("a", INTERVAL_MS, vec![entry("k", &[limit], 5, 0)]);
    let grants = sync_at(&state, &request, T0 + 100 * MS).await;
    assert_eq!(
        grants[0].tokens, 6,
        "EWMA: half of 0/s and half of 50/s is 25/s: 5 + 1"
    );
}

#[tokio::test]
async fn proxies_together_never_hold_more_than_the_bucket() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let key = "shared";
    let redis_key = keys::limit_key(key, &TEN_PER_SECOND);
    let proxies = ["a", "b", "c"];
    let mut held = [0u64; 3];
    let mut expiry = [0u64; 3];
    let mut now = T0;
    for round in 0..60 {
        now += 7 * MS;
        let p = round % 3;
        // the proxy spent all it held (if the lease was still running), and wanted more
        let spent = if expiry[p] > now { held[p] } else { 0 };
        let grants = sync_at(&state, &one(proxies[p], key, spent, 20), now).await;
        held[p] = grants[0].tokens;
        expiry[p] = now + grants[0].ttl_ms * MS;
        let outstanding: u64 = (0..3).filter(|&q| expiry[q] > now).map(|q| held[q]).sum();
        let bucket: f64 = field(&redis, &redis_key, "tokens")
            .unwrap()
            .parse()
            .unwrap();
        assert!(
            outstanding as f64 <= bucket.max(0.0),
            "round {round} at +{} ms: leases {held:?} total {outstanding} > bucket {bucket}",
            (now - T0) / MS
        );
    }
}

#[tokio::test]
async fn reported_spend_is_debited() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    sync_at(&state, &one("a", "k", 0, 0), T0).await;
    assert_eq!(tokens(&redis, "k"), 10.0);
    let grants = sync_at(&state, &one("a", "k", 4, 0), T0).await;
    assert_eq!(tokens(&redis, "k"), 6.0);
    assert_eq!(grants[0].remaining, 6);
    assert_eq!(grants[0].reset_ms, 400, "4 tokens at 10/s");
}

#[tokio::test]
async fn debt_withholds_grants_until_refilled() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    // the proxy overspent on its fallback while the service was away
    let grants = sync_at(&state, &one("a", "k", 30, 0), T0).await;
    assert_eq!(tokens(&redis, "k"), -20.0);
    assert_eq!(grants[0].tokens, 0);
    assert_eq!(grants[0].remaining, 0);
    assert_eq!(grants[0].reset_ms, 3_000);
    let grants = sync_at(&state, &one("a", "k", 0, 50), T0 + 1_000 * MS).await;
    assert_eq!((grants[0].tokens, tokens(&redis, "k")), (0, -10.0));
    let grants = sync_at(&state, &one("a", "k", 0, 50), T0 + 2_000 * MS).await;
    assert_eq!((grants[0].tokens, tokens(&redis, "k")), (0, 0.0));
    let grants = sync_at(&state, &one("a", "k", 0, 50), T0 + 2_500 * MS).await;
    assert_eq!(
        (grants[0].tokens, tokens(&redis, "k")),
        (5, 5.0),
        "paid back: 5 refilled"
    );
}

#[tokio::test]
async fn expired_grants_release_their_tokens() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let a = sync_at(&state, &one("a", "k", 0, 1_000), T0).await;
    assert_eq!(a[0].tokens, 10);
    let b = sync_at(&state, &one("b", "k", 0, 1_000), T0 + 100 * MS).await;
    assert_eq!(b[0].tokens, 0, "a's lease holds every token");
    let b = sync_at(&state, &one("b", "k", 0, 1_000), T0 + 301 * MS).await;
    assert_eq!(
        b[0].tokens, 10,
        "a's lease expired after 300 ms: b gets the bucket"
    );
}

#[tokio::test]
async fn silent_proxies_are_forgotten_and_idle_keys_expire() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let key = keys::limit_key("k", &TEN_PER_SECOND);
    sync_at(&state, &one("a", "k", 0, 0), T0).await;
    assert!(field(&redis, &key, "g:a").is_some());
    let ttl: i64 = redis.text(&["PTTL", &key]).unwrap().parse().unwrap();
    assert!(
        (1..=1_300).contains(&ttl),
        "full bucket: lease 300 ms + 1000 ms, got {ttl}"
    );
    // a's lease ended at +300 ms; a grant TTL later it is stale
    sync_at(&state, &one("b", "k", 0, 0), T0 + 600 * MS).await;
    for name in ["g:a", "x:a", "w:a", "d:a", "s:a"] {
        assert_eq!(field(&redis, &key, name), None, "{name} dropped");
    }
    assert!(field(&redis, &key, "g:b").is_some());
}

#[tokio::test]
async fn every_limit_of_an_entry_binds_the_grant() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let per_minute = LimitSpec {
        requests: 3,
        period_ms: 60_000,
        burst: 3,
    };
    let request = batch(
        "a",
        INTERVAL_MS,
        vec![
            entry("first", &[TEN_PER_SECOND, per_minute], 0, 1_000),
            entry("second", &[TEN_PER_SECOND], 0, 1_000),
        ],
    );
    let grants = sync_at(&state, &request, T0).await;
    assert_eq!(grants[0].tokens, 3, "the tighter limit decides");
    assert_eq!(grants[1].tokens, 10, "answers keep the request order");
    let key = keys::limit_key("first", &per_minute);
    assert_eq!(field(&redis, &key, "g:a").as_deref(), Some("3"));
}
