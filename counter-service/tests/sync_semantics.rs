//! What `lua/sync.lua` promises, on a real Redis with a fake clock: leases together never promise
//! more than the bucket holds plus 1.5 intervals of refill, spend is debited without losing the
//! refill to the burst cap, debt withholds grants, expired leases release, and idle keys expire.
//!
//! The grant, per limit (the smallest wins, never below 0):
//! `fraction = demand / (demand + others' demand)` (0 without demand),
//! `refill = requests × interval_ms × 1.5 / period_ms`,
//! `available = floor(tokens − others' leases + refill × fraction)`,
//! `share = floor(available × fraction)`, `grant = min(available, max(want, share))`, with
//! `want = ceil(demand × interval_s × 1.25) + 1` (plus, after denials, the refill the burst cap
//! would lose before the next sync). For 10/s, burst 10 and 100 ms syncs, `refill` is 1.5.

mod common;

use common::{batch, entry, state, TEN_PER_SECOND};
use sluice_counter_service::{keys, sync_handler, AppState};
use sluice_protocol::{Lease, LimitSpec, SyncRequest};
use sluice_tests::redis::Redis;

const T0: u64 = 1_700_000_000_000_000;
const MS: u64 = 1_000;
/// 100 ms syncs and the default 3-interval lease: grants live 300 ms.
const INTERVAL_MS: u64 = 100;
/// 1.5 intervals of refill at 10/s: what a lease may borrow beyond the bucket.
const BORROWED: f64 = 10.0 * INTERVAL_MS as f64 * 1.5 / 1_000.0;

async fn sync_at(state: &AppState, request: &SyncRequest, now: u64) -> Vec<Lease> {
    sync_handler::apply(state, request, now).await.unwrap()
}

/// One proxy, one key, `spent` and `denied` since its last sync.
fn one(proxy: &str, key: &str, spent: u64, denied: u64) -> SyncRequest {
    batch(
        proxy,
        INTERVAL_MS,
        vec![entry(key, &[TEN_PER_SECOND], spent, denied)],
    )
}

fn raw_field(redis: &Redis, key: &str, name: &str) -> Option<String> {
    redis
        .query(&["HGET", key, name])
        .unwrap()
        .text()
        .map(str::to_owned)
}

/// A field of a limit's hash. A proxy's lease, g:q (grant), x:q (expiry), d:q (demand) and s:q
/// (last sync), is read from its one packed field l:q when it has one (or from an earlier
/// version's text field p:q, "g x d s").
fn field(redis: &Redis, key: &str, name: &str) -> Option<String> {
    if let Some((kind, proxy)) = name.split_once(':') {
        if let Some(at) = ["g", "x", "d", "s"].iter().position(|k| *k == kind) {
            if let Some(lease) = common::lease(redis, key, proxy) {
                return Some(lease[at].to_string());
            }
            if let Some(lease) = raw_field(redis, key, &format!("p:{proxy}")) {
                return lease.split(' ').nth(at).map(str::to_owned);
            }
        }
    }
    raw_field(redis, key, name)
}

fn number(redis: &Redis, key: &str, name: &str) -> f64 {
    field(redis, key, name).unwrap().parse().unwrap()
}

fn tokens(redis: &Redis, key: &str) -> f64 {
    number(redis, &keys::limit_key(key, &TEN_PER_SECOND), "tokens")
}

#[tokio::test]
async fn one_proxy_gets_at_most_the_burst_and_the_refill_before_its_next_sync() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let grants = sync_at(&state, &one("a", "k", 0, 1_000_000), T0).await;
    assert_eq!(
        grants,
        vec![Lease {
            tokens: 11,
            ttl_ms: 300,
            remaining: 10,
            reset_ms: 0,
            token_ms: Some(100),
            refused: None,
            penalty_ms: 0,
        }],
        "a new key is full; a huge demand gets floor(10 - 0 + 1.5 × 1) = 11, no more; an 11th \
         token is 100 ms away"
    );
    assert_eq!(tokens(&redis, "k"), 10.0, "the lease is not debited");
    let key = keys::limit_key("k", &TEN_PER_SECOND);
    assert_eq!(field(&redis, &key, "g:a").as_deref(), Some("11"));
    assert_eq!(field(&redis, &key, "w:a"), None, "no want is stored");
}

#[tokio::test]
async fn the_grant_follows_demand() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let limit = LimitSpec::token_bucket(1_000, 1_000, 1_000);
    let key = keys::limit_key("k", &limit);
    let at = |spent, denied| batch("a", INTERVAL_MS, vec![entry("k", &[limit], spent, denied)]);
    let grants = sync_at(&state, &at(0, 0), T0).await;
    assert_eq!(
        grants[0].tokens, 1,
        "no demand yet: fraction 0, share 0, want ceil(0) + 1 = 1"
    );
    assert_eq!(number(&redis, &key, "d:a"), 0.0);
    // 5 admitted over 100 ms is 50/s: demand max(50, 0.5 × 0 + 0.5 × 50) = 50, rising at once.
    // Alone, its fraction is 1: the share is everything free plus 1.5 intervals of refill,
    // floor(1000 - 0 + 1000 × 0.1 × 1.5 × 1) = 1150 (the 100 refilled were capped at 1000 + 5).
    let grants = sync_at(&state, &at(5, 0), T0 + 100 * MS).await;
    assert_eq!(number(&redis, &key, "d:a"), 50.0);
    assert_eq!(grants[0].tokens, 1_150);
    assert_eq!(number(&redis, &key, "tokens"), 1_000.0);
    // 30 over 100 ms is 300/s: demand max(300, 25 + 150) = 300
    sync_at(&state, &at(30, 0), T0 + 200 * MS).await;
    assert_eq!(number(&redis, &key, "d:a"), 300.0);
    // nothing over 200 ms: demand max(0, 150 + 0) = 150, falling slowly
    sync_at(&state, &at(0, 0), T0 + 400 * MS).await;
    assert_eq!(number(&redis, &key, "d:a"), 150.0);
}

#[tokio::test]
async fn a_small_demand_next_to_a_large_one_gets_its_want() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let limit = LimitSpec::token_bucket(1_000, 1_000, 1_000);
    let at = |proxy, spent, denied| {
        batch(
            proxy,
            INTERVAL_MS,
            vec![entry("k", &[limit], spent, denied)],
        )
    };
    // b spent the whole new bucket on its fallback: 1000 over 100 ms is 10000/s. A new key is
    // taken to have started one interval ago, full: min(1000 + 1000, 1000 + 100) - 1000 = 100.
    // available = floor(100 - 0 + 150 × 1) = 250 < want ceil(10000 × 0.125) + 1 = 1251
    let b = sync_at(&state, &at("b", 1_000, 0), T0).await;
    assert_eq!(
        b[0].tokens, 250,
        "what is left plus the refill due before b's next sync"
    );
    // 200 ms later: 200 refilled (cap 1000 + 0 + b's unreported min(250, 10000 × 0.2) = 1250).
    // a, 5 denied over 100 ms = 50/s, has fraction 50 / 10050: available = floor(300 - 250 +
    // 150 × 0.004975) = 50, share floor(50 × 0.004975) = 0, want ceil(50 × 0.125) + 1 = 8.
    let a = sync_at(&state, &at("a", 0, 5), T0 + 200 * MS).await;
    assert_eq!(a[0].tokens, 8, "its want, more than its share of 0");
    let key = keys::limit_key("k", &limit);
    assert_eq!(number(&redis, &key, "tokens"), 300.0);
    // 50 ms later a's demand jumps to 20000/s (1000 denied over 50 ms: demand is measured over
    // the time since its last sync). Tokens: min(1000 + 0 + b's unreported min(250, 10000 ×
    // 0.25), 300 + 50) = 350. want ceil(20000 × 0.125) + 1 = 2501 (the surplus floor(350 + 100
    // - 1000) < 0 adds nothing); fraction 20000 / 30000, available = floor(350 - 250 + 150 ×
    // 2/3) = 200, share 133.
    let a = sync_at(&state, &at("a", 0, 1_000), T0 + 250 * MS).await;
    assert_eq!(a[0].tokens, 200, "never more than the bucket holds for it");
}

#[tokio::test]
async fn proxies_together_never_hold_more_than_the_bucket_and_the_refill_they_borrow() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let key = "shared";
    let redis_key = keys::limit_key(key, &TEN_PER_SECOND);
    let proxies = ["a", "b", "c"];
    let mut held = [0u64; 3];
    let mut expiry = [0u64; 3];
    let mut now = T0;
    let mut borrowed = false;
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
        // Each grant is at most floor(tokens - others + 1.5 × fraction), fraction ≤ 1: the
        // leases together exceed the bucket by at most the 1.5 intervals of refill.
        assert!(
            outstanding as f64 <= bucket.max(0.0) + BORROWED,
            "round {round} at +{} ms: leases {held:?} total {outstanding} > bucket {bucket} + \
             {BORROWED}",
            (now - T0) / MS
        );
        borrowed |= outstanding as f64 > bucket.max(0.0);
    }
    assert!(borrowed, "the proxies never borrowed the refill due");
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
    // 100 ms: min(10 + 4, 6 + 1) - 4 = 3
    sync_at(&state, &one("a", "k", 4, 0), T0 + 100 * MS).await;
    assert_eq!(tokens(&redis, "k"), 3.0);
    // 1 s: min(10 + 4, 3 + 10) - 4 = 9
    sync_at(&state, &one("a", "k", 4, 0), T0 + 1_100 * MS).await;
    assert_eq!(tokens(&redis, "k"), 9.0);
    // 1 s: the refill is capped at 10 + 2 (the burst plus the spend not yet reported), not at 10:
    // min(10 + 2, 9 + 10) - 2 = 10, then capped at the burst. A cap at the burst before the
    // debit would leave 8: 2 tokens of refill lost.
    let grants = sync_at(&state, &one("a", "k", 2, 0), T0 + 2_100 * MS).await;
    assert_eq!(tokens(&redis, "k"), 10.0);
    assert_eq!((grants[0].remaining, grants[0].reset_ms), (10, 0));
}

#[tokio::test]
async fn the_others_unreported_spend_keeps_the_refill() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    // b: 10 denied over 100 ms is 100/s; alone, it holds floor(10 + 1.5) = 11
    let b = sync_at(&state, &one("b", "k", 0, 10), T0).await;
    assert_eq!(b[0].tokens, 11);
    // 50 ms later b has spent an estimated min(11, 100/s × 0.05 s) = 5: the refill of 0.5 is
    // capped at 10 + 0 + 5, not 10, and the bucket holds 10.5, above the burst.
    // a, without demand, gets floor(10.5 - 11 + 0) < 0, so nothing.
    let a = sync_at(&state, &one("a", "k", 0, 0), T0 + 50 * MS).await;
    assert_eq!(a[0].tokens, 0);
    assert_eq!(tokens(&redis, "k"), 10.5);
    // b reports 5: min(10 + 5 + 0, 10.5 + 0.5) - 5 = 6, what the exact bucket holds (10 - 5 +
    // 1); a cap at the burst before the debit would have lost the refill and left 5.
    sync_at(&state, &one("b", "k", 5, 0), T0 + 100 * MS).await;
    assert_eq!(tokens(&redis, "k"), 6.0);
}

#[tokio::test]
async fn debt_withholds_grants_until_refilled() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    // the key exists, full, at T0; then the proxy reports that it overspent on its fallback
    // while the service was away
    sync_at(&state, &one("a", "k", 0, 0), T0).await;
    let grants = sync_at(&state, &one("a", "k", 30, 0), T0).await;
    assert_eq!(tokens(&redis, "k"), -20.0);
    assert_eq!(grants[0].tokens, 0, "floor(-20 + 1.5) < 0");
    assert_eq!(grants[0].remaining, 0);
    assert_eq!(grants[0].reset_ms, 3_000);
    let grants = sync_at(&state, &one("a", "k", 0, 50), T0 + 1_000 * MS).await;
    assert_eq!(
        (grants[0].tokens, tokens(&redis, "k")),
        (0, -10.0),
        "floor(-10 + 1.5) < 0"
    );
    // The grant borrows the 1.5 tokens due before the next sync, so the debt is covered once
    // it is down to 0.5: at +1940 ms floor(-0.6 + 1.5) = 0, at +1950 ms floor(-0.5 + 1.5) = 1.
    // (-10 + 9.4 is not exact in floating point: compare the tokens to within 1e-9)
    let close = |expected: f64| (tokens(&redis, "k") - expected).abs() < 1e-9;
    let grants = sync_at(&state, &one("a", "k", 0, 50), T0 + 1_940 * MS).await;
    assert_eq!(grants[0].tokens, 0);
    assert!(close(-0.6), "{}", tokens(&redis, "k"));
    let grants = sync_at(&state, &one("a", "k", 0, 50), T0 + 1_950 * MS).await;
    assert_eq!(grants[0].tokens, 1);
    assert!(close(-0.5), "{}", tokens(&redis, "k"));
    let grants = sync_at(&state, &one("a", "k", 0, 50), T0 + 2_500 * MS).await;
    assert_eq!(
        grants[0].tokens, 6,
        "paid back: 5 refilled, floor(5 + 1.5) = 6"
    );
    assert!(close(5.0), "{}", tokens(&redis, "k"));
}

#[tokio::test]
async fn expired_grants_release_their_tokens() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let a = sync_at(&state, &one("a", "k", 0, 1_000), T0).await;
    assert_eq!(a[0].tokens, 11);
    // 100 ms: 1 refilled (a's unreported min(11, 10000 × 0.1) lifts the cap), tokens 11; b has
    // half the two proxies' demand: floor(11 - 11 + 1.5 × 0.5) = 0
    let b = sync_at(&state, &one("b", "k", 0, 1_000), T0 + 100 * MS).await;
    assert_eq!(b[0].tokens, 0, "a's lease holds every token");
    assert_eq!(tokens(&redis, "k"), 11.0);
    // a's lease expired at +300 ms: no unreported spend, the bucket is capped back at 10, and b
    // alone gets floor(10 - 0 + 1.5) = 11
    let b = sync_at(&state, &one("b", "k", 0, 1_000), T0 + 301 * MS).await;
    assert_eq!(
        b[0].tokens, 11,
        "a's lease expired after 300 ms: b gets the bucket"
    );
    assert_eq!(tokens(&redis, "k"), 10.0);
}

#[tokio::test]
async fn silent_proxies_are_forgotten_and_idle_keys_expire() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let key = keys::limit_key("k", &TEN_PER_SECOND);
    sync_at(&state, &one("a", "k", 0, 0), T0).await;
    for name in ["g:a", "x:a", "d:a", "s:a"] {
        assert!(field(&redis, &key, name).is_some(), "{name} written");
    }
    assert!(
        common::lease(&redis, &key, "a").is_some(),
        "one field per proxy"
    );
    assert_eq!(raw_field(&redis, &key, "p:a"), None);
    assert_eq!(raw_field(&redis, &key, "g:a"), None);
    // a field of an older version of the script, which wrote the proxy's want
    redis.query(&["HSET", &key, "w:a", "3"]).unwrap();
    let ttl: i64 = redis.text(&["PTTL", &key]).unwrap().parse().unwrap();
    assert!(
        (1..=1_300).contains(&ttl),
        "full bucket: lease 300 ms + 1000 ms, got {ttl}"
    );
    // a's lease ended at +300 ms; a grant TTL later it is stale
    sync_at(&state, &one("b", "k", 0, 0), T0 + 600 * MS).await;
    for name in ["l:a", "g:a", "x:a", "w:a", "d:a", "s:a"] {
        assert_eq!(field(&redis, &key, name), None, "{name} dropped");
    }
    assert!(field(&redis, &key, "g:b").is_some());
}

#[tokio::test]
async fn every_limit_of_an_entry_binds_the_grant() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let per_minute = LimitSpec::token_bucket(3, 60_000, 3);
    let request = batch(
        "a",
        INTERVAL_MS,
        vec![
            entry("first", &[TEN_PER_SECOND, per_minute], 0, 1_000),
            entry("second", &[TEN_PER_SECOND], 0, 1_000),
        ],
    );
    let grants = sync_at(&state, &request, T0).await;
    // 10/s: floor(10 + 1.5) = 11; 3/min: floor(3 + 3 × 100 × 1.5 / 60000) = 3
    assert_eq!(grants[0].tokens, 3, "the tighter limit decides");
    assert_eq!(grants[1].tokens, 11, "answers keep the request order");
    let key = keys::limit_key("first", &per_minute);
    assert_eq!(field(&redis, &key, "g:a").as_deref(), Some("3"));
}

/// The README's `per-key` example, `[1000/minute, 100000/day]`, with the minute bucket empty and
/// the day bucket half used: the global state is full again in 12 hours (`reset_ms`), but holds a
/// token in both limits again in 60 ms (`token_ms`), the wait of a request denied meanwhile. With
/// tokens `remaining`, `token_ms` is the wait for the one after them.
/// Before `token_ms`, a proxy sized that wait from `reset_ms` and the first limit: 43,140 s.
#[tokio::test]
async fn the_grant_says_when_every_limit_holds_a_token_again() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let per_minute = LimitSpec::token_bucket(1_000, 60_000, 1_000);
    let per_day = LimitSpec::token_bucket(100_000, 86_400_000, 100_000);
    let request = batch(
        "a",
        INTERVAL_MS,
        vec![entry("k", &[per_minute, per_day], 0, 5)],
    );
    sync_at(&state, &request, T0).await;
    let set = |spec: &LimitSpec, tokens: &str| {
        let key = keys::limit_key("k", spec);
        let ts = T0.to_string();
        redis
            .query(&["HSET", &key, "tokens", tokens, "ts", &ts])
            .unwrap();
    };
    set(&per_minute, "0");
    set(&per_day, "50000");
    let grants = sync_at(&state, &request, T0).await;
    assert_eq!(
        grants[0].tokens, 2,
        "floor(0 + 2.5 tokens of refill before the next sync)"
    );
    assert_eq!(grants[0].remaining, 0);
    assert_eq!(
        grants[0].reset_ms, 43_200_000,
        "50,000 tokens at 100,000 a day"
    );
    assert_eq!(grants[0].token_ms, Some(60), "one token at 1,000 a minute");
    // in debt on the day: its token comes after the minute's
    set(&per_minute, "500");
    set(&per_day, "-2");
    let grants = sync_at(&state, &request, T0).await;
    assert_eq!(
        grants[0].token_ms,
        Some(3 * 864),
        "three tokens at 100,000 a day"
    );
    // a token in every limit: once it is spent, the day's second one is 864 ms away
    set(&per_day, "1");
    let grants = sync_at(&state, &request, T0).await;
    assert_eq!(grants[0].remaining, 1);
    assert_eq!(grants[0].token_ms, Some(864));
    // plenty: the minute's 101st token is a minute away (the day's 499 ms before it)
    set(&per_minute, "100");
    set(&per_day, "500");
    let grants = sync_at(&state, &request, T0).await;
    assert_eq!(grants[0].remaining, 100);
    assert_eq!(grants[0].token_ms, Some(60));
}

#[tokio::test]
async fn a_report_cannot_push_the_debt_past_one_reports_worth() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let key = keys::limit_key("k", &TEN_PER_SECOND);
    // One report covers at most the lease (300 ms) plus a minute: 10 + 10 × 60.3 = 613 tokens.
    // A new key starts full an interval ago: min(10 + 613, 10 + 1) - 613 = -602.
    let huge = 1 << 53;
    let grants = sync_at(&state, &one("a", "k", huge, huge), T0).await;
    assert_eq!(grants[0].tokens, 0);
    assert_eq!(tokens(&redis, "k"), -602.0);
    // the demand is what 613 spent and 613 denied over one interval make: 12260/s
    assert_eq!(number(&redis, &key, "d:a"), 12_260.0);
    // again: -602 - 613 stops at the floor, -613
    sync_at(&state, &one("a", "k", huge, huge), T0).await;
    assert_eq!(tokens(&redis, "k"), -613.0);
    let ttl: i64 = redis.text(&["PTTL", &key]).unwrap().parse().unwrap();
    assert!(
        (1..=(623 * 100 + 300 + 1_000)).contains(&ttl),
        "the refill from the floor (62.3 s), the lease and a second: {ttl}"
    );
    // the debt is repaid by the refill: 62.3 s later the bucket is full, and leases resume
    let grants = sync_at(&state, &one("a", "k", 0, 10), T0 + 62_300 * MS).await;
    assert_eq!(tokens(&redis, "k"), 10.0);
    assert_eq!(grants[0].tokens, 11);
}

#[tokio::test]
async fn the_service_clamps_the_interval_that_sizes_and_times_a_lease() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    // an hour asked, a minute used: at most floor(10 + 10 × 60 × 1.5) = 910, for 3 minutes
    let request = batch(
        "a",
        3_600_000,
        vec![entry("k", &[TEN_PER_SECOND], 0, 1_000_000_000)],
    );
    let grants = sync_at(&state, &request, T0).await;
    assert_eq!((grants[0].tokens, grants[0].ttl_ms), (910, 180_000));
    let key = keys::limit_key("k", &TEN_PER_SECOND);
    let expiry: f64 = number(&redis, &key, "x:a");
    assert_eq!(expiry, (T0 + 180_000 * MS) as f64);
    // 0 ms asked, 10 ms used: floor(10 + 10 × 0.01 × 1.5) = 10, for 30 ms
    let request = batch("b", 0, vec![entry("other", &[TEN_PER_SECOND], 0, 1_000)]);
    let grants = sync_at(&state, &request, T0).await;
    assert_eq!((grants[0].tokens, grants[0].ttl_ms), (10, 30));
}

/// A key written by an earlier version (a proxy's lease as text in p:, or in four fields, g:, x:,
/// d:, s:), as a running fleet or a replica not yet upgraded leaves it in Redis, answers as the
/// same key in the current layout: its lease is set aside for the others, its own next sync
/// reads its demand from it and rewrites it as l:.
#[tokio::test]
async fn a_key_of_an_earlier_layout_answers_the_same() {
    for four_fields in [false, true] {
        let redis = Redis::start().unwrap();
        let state = state(&redis.url());
        let older = keys::limit_key("old", &TEN_PER_SECOND);
        for key in ["old", "new"] {
            let a = sync_at(&state, &one("a", key, 2, 30), T0).await;
            assert_eq!(
                a[0].tokens, 10,
                "{key}: what is left after a's 2, and the refill"
            );
        }
        common::to_earlier_layout(&redis, &older, "a", four_fields);
        assert_eq!(field(&redis, &older, "g:a").as_deref(), Some("10"));
        assert_eq!(common::lease(&redis, &older, "a"), None);
        let mut answers = Vec::new();
        for key in ["old", "new"] {
            let b = sync_at(&state, &one("b", key, 0, 20), T0 + 50 * MS).await;
            let a = sync_at(&state, &one("a", key, 5, 10), T0 + 100 * MS).await;
            let b2 = sync_at(&state, &one("b", key, 1, 20), T0 + 150 * MS).await;
            answers.push((b, a, b2, tokens(&redis, key)));
        }
        assert_eq!(answers[0].0, answers[1].0, "b sets a's earlier lease aside");
        assert_eq!(
            answers[0].1, answers[1].1,
            "a's demand read from its earlier fields"
        );
        assert_eq!(answers[0].2, answers[1].2);
        assert_eq!(answers[0].3, answers[1].3, "the same bucket");
        assert!(
            answers[0].0[0].tokens < 10,
            "a's lease holds most of the bucket"
        );
        for name in ["p:a", "r:a", "g:a", "x:a", "d:a", "s:a"] {
            assert_eq!(raw_field(&redis, &older, name), None, "{name} replaced");
        }
        assert!(common::lease(&redis, &older, "a").is_some());
    }
}

/// A proxy whose syncs reached replicas of both versions during an upgrade has its lease in both
/// l: and p:; its next sync reads its demand from the later of the two and keeps only l:.
#[tokio::test]
async fn a_lease_in_both_layouts_is_read_from_the_later() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let key = keys::limit_key("k", &TEN_PER_SECOND);
    sync_at(&state, &one("a", "k", 2, 30), T0).await;
    let first = common::lease(&redis, &key, "a").expect("a's lease");
    assert_eq!(first[2], 320.0, "32 over the first interval");
    // a replica of the earlier version answered a's sync 50 ms later, with a demand of 40/s
    let later = format!("3 {} 40 {}", T0 + 350 * MS, T0 + 50 * MS);
    redis.query(&["HSET", &key, "p:a", &later]).unwrap();
    sync_at(&state, &one("a", "k", 0, 0), T0 + 100 * MS).await;
    let lease = common::lease(&redis, &key, "a").expect("a's lease");
    assert_eq!(lease[2], 20.0, "half the later demand (40/s), not of 320/s");
    assert_eq!(raw_field(&redis, &key, "p:a"), None);
}
