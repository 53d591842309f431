//! A sync that was applied but whose answer was lost is resent by the proxy with the same round
//! labels (`SyncEntry::round`): on a real Redis with a fake clock, `lua/sync.lua` and
//! `lua/sync_window.lua` count a proxy's report on a key once, answer the replay a grant, and
//! count an unlabeled report (an older proxy) every time it comes: the double count the labels
//! prevent. Needs `redis-server` (the `redis` feature).
#![cfg(feature = "redis")]

mod common;

use common::{batch, entry, state};
use sluice_counter_service::{keys, sync_handler, AppState};
use sluice_protocol::{AlgorithmSpec, Lease, LimitSpec, SyncEntry, SyncRequest};
use sluice_tests::redis::Redis;

const MS: u64 = 1_000;
/// 2023-11-14 22:14:00 UTC: a minute's start, so an hour's window holds the whole test.
const T0: u64 = 1_700_000_040_000_000;
/// 100 an hour: the refill during a test is well under 0.05 token.
const SLOW: LimitSpec = LimitSpec::token_bucket(100, 3_600_000, 100);
const HOURLY: LimitSpec = LimitSpec::window(AlgorithmSpec::FixedWindow, 1_000, 3_600_000);

const EPOCH: u64 = 0x1234_5678;

fn labeled(limit: LimitSpec, spent: u64, counter: u64) -> SyncRequest {
    batch(
        "a",
        100,
        vec![with_round(limit, spent, (EPOCH << 32) | counter)],
    )
}

fn with_round(limit: LimitSpec, spent: u64, round: u64) -> SyncEntry {
    SyncEntry {
        round,
        ..entry("k", &[limit], spent, 0)
    }
}

async fn sync_at(state: &AppState, request: &SyncRequest, now: u64) -> Vec<Lease> {
    sync_handler::apply(state, request, now).await.unwrap()
}

fn field(redis: &Redis, limit: &LimitSpec, name: &str) -> Option<String> {
    redis
        .query(&["HGET", &keys::limit_key("k", limit), name])
        .unwrap()
        .text()
        .map(str::to_owned)
}

/// Proxy a's lease field on the token bucket's key (see `common::lease`).
fn lease_of_a(redis: &Redis) -> Option<[f64; 7]> {
    common::lease(redis, &keys::limit_key("k", &SLOW), "a")
}

fn tokens(redis: &Redis) -> f64 {
    field(redis, &SLOW, "tokens").unwrap().parse().unwrap()
}

fn count(redis: &Redis) -> u64 {
    field(redis, &HOURLY, "n").unwrap().parse().unwrap()
}

fn replayed(state: &AppState) -> u64 {
    state.metrics.replayed_entries.get()
}

fn near(actual: f64, expected: f64) -> bool {
    (actual - expected).abs() < 0.05
}

#[tokio::test]
async fn a_token_bucket_counts_a_resent_report_once() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let first = sync_at(&state, &labeled(SLOW, 5, 7), T0).await;
    assert!(near(tokens(&redis), 95.0), "{}", tokens(&redis));
    let lease = lease_of_a(&redis).expect("a's lease");
    assert_eq!(
        lease[4..],
        [EPOCH as f64, 7.0, T0 as f64],
        "the last round applied, and when, beside the lease"
    );
    // The answer was lost: the proxy resends the entry as it was, label and all.
    let again = sync_at(&state, &labeled(SLOW, 5, 7), T0 + 100 * MS).await;
    assert!(
        near(tokens(&redis), 95.0),
        "debited once: {}",
        tokens(&redis)
    );
    assert_eq!(replayed(&state), 1);
    assert!(again[0].refused.is_none() && again[0].ttl_ms == first[0].ttl_ms);
    assert!(again[0].tokens > 0, "the replay is answered a lease");
    // The next round's report is new; a report of an older round after it is not.
    sync_at(&state, &labeled(SLOW, 3, 8), T0 + 200 * MS).await;
    assert!(near(tokens(&redis), 92.0), "{}", tokens(&redis));
    sync_at(&state, &labeled(SLOW, 5, 7), T0 + 300 * MS).await;
    assert!(near(tokens(&redis), 92.0), "{}", tokens(&redis));
    assert_eq!(replayed(&state), 2);
    // Another epoch (the proxy's sync state started over): new, whatever its counter.
    let other = batch("a", 100, vec![with_round(SLOW, 2, (EPOCH + 1) << 32)]);
    sync_at(&state, &other, T0 + 400 * MS).await;
    assert!(near(tokens(&redis), 90.0), "{}", tokens(&redis));
    assert_eq!(replayed(&state), 2);
}

/// A round kept by an earlier version of the script (as text in r:a, beside the lease in p:a)
/// still recognizes the batch it labeled; the next sync keeps it in a's one packed field.
#[tokio::test]
async fn a_round_kept_by_an_earlier_version_is_recognized() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    sync_at(&state, &labeled(SLOW, 5, 7), T0).await;
    common::to_earlier_layout(&redis, &keys::limit_key("k", &SLOW), "a", false);
    assert_eq!(
        field(&redis, &SLOW, "r:a").as_deref(),
        Some(format!("{EPOCH} 7 {T0}").as_str())
    );
    sync_at(&state, &labeled(SLOW, 5, 7), T0 + 100 * MS).await;
    assert!(
        near(tokens(&redis), 95.0),
        "debited once: {}",
        tokens(&redis)
    );
    assert_eq!(replayed(&state), 1);
    let lease = lease_of_a(&redis).expect("a's lease, rewritten");
    assert_eq!(lease[4..], [EPOCH as f64, 7.0, T0 as f64]);
    assert_eq!(field(&redis, &SLOW, "r:a"), None);
    assert_eq!(field(&redis, &SLOW, "p:a"), None);
}

#[tokio::test]
async fn without_a_label_a_resent_report_is_counted_twice() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let unlabeled = batch("a", 100, vec![entry("k", &[SLOW], 5, 0)]);
    sync_at(&state, &unlabeled, T0).await;
    sync_at(&state, &unlabeled, T0 + 100 * MS).await;
    assert!(
        near(tokens(&redis), 90.0),
        "debited twice: {}",
        tokens(&redis)
    );
    let lease = lease_of_a(&redis).expect("a's lease");
    assert_eq!(lease[4..], [0.0, 0.0, 0.0], "no round is kept");
    assert_eq!(replayed(&state), 0);
}

#[tokio::test]
async fn a_window_counts_a_resent_report_once() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    sync_at(&state, &labeled(HOURLY, 7, 1), T0).await;
    sync_at(&state, &labeled(HOURLY, 7, 1), T0 + 100 * MS).await;
    assert_eq!(count(&redis), 7, "counted once");
    assert_eq!(replayed(&state), 1);
    sync_at(&state, &labeled(HOURLY, 4, 2), T0 + 200 * MS).await;
    assert_eq!(count(&redis), 11);
    // Without labels, the same report twice is counted twice.
    let unlabeled = batch("b", 100, vec![entry("k", &[HOURLY], 6, 0)]);
    sync_at(&state, &unlabeled, T0 + 300 * MS).await;
    sync_at(&state, &unlabeled, T0 + 400 * MS).await;
    assert_eq!(count(&redis), 23);
    assert!(field(&redis, &HOURLY, "r:a").is_some(), "a's round is kept");
    // Past the report window (300 ms and 60 s) since a's last write, b's sync forgets it.
    sync_at(&state, &unlabeled, T0 + 61_000 * MS).await;
    assert_eq!(field(&redis, &HOURLY, "r:a"), None);
    assert_eq!(count(&redis), 29);
}

#[tokio::test]
async fn a_round_outlives_the_lease_for_the_report_window() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    sync_at(&state, &labeled(SLOW, 5, 7), T0).await;
    // Another proxy syncs after a's lease (300 ms) has been expired for a lease TTL: a's lease
    // no longer counts, its field is kept for its round (a breaker's cool-down is longer than a
    // lease).
    let b = batch("b", 100, vec![entry("k", &[SLOW], 0, 0)]);
    sync_at(&state, &b, T0 + 600 * MS).await;
    let lease = lease_of_a(&redis).expect("a's field is kept");
    assert!(lease[1] <= (T0 + 300 * MS) as f64, "its lease expired");
    assert_eq!(lease[4..6], [EPOCH as f64, 7.0]);
    // a's batch, resent 3 s later, is still recognized.
    sync_at(&state, &labeled(SLOW, 5, 7), T0 + 3_000 * MS).await;
    let left = tokens(&redis);
    assert!(
        left > 95.0 && left < 95.1,
        "95 and 3 s of refill, not 90: {left}"
    );
    assert_eq!(replayed(&state), 1);
    // Past the report window (the 300 ms lease TTL and the 60 s outage allowance) since a's
    // last write, b's sync forgets a's round: a replay as late as that is counted again.
    sync_at(&state, &b, T0 + 3_000 * MS + 60_400 * MS).await;
    assert_eq!(lease_of_a(&redis), None);
}
