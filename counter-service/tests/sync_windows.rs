//! What `lua/sync_window.lua` promises for cached windows, on a real Redis with a fake clock: a
//! lease is a share of what is left in the window once the other proxies' leases are set aside,
//! and ends with the window; a report that arrives after its window ended is attributed to the
//! old window as far as the proxy's old lease covers it; the next window starts fresh; strict
//! checks of the same limit see the same count and the leases; and a fleet whose proxies spend
//! every lease admits at most `requests` plus what their fallbacks admitted outside a lease in
//! one window.

mod common;

use std::collections::HashMap;

use common::{batch, entry, state};
use sluice_counter_service::{check_handler, keys, sync_handler, AppState};
use sluice_protocol::{AlgorithmSpec, CheckRequest, Lease, LimitSpec, SyncRequest};
use sluice_tests::redis::Redis;

const MS: u64 = 1_000;
/// 2023-11-14 22:14:00 UTC: a minute's start.
const W0: u64 = 1_700_000_040_000_000;
const MINUTE: u64 = 60_000 * MS;
const FIXED: LimitSpec = LimitSpec::window(AlgorithmSpec::FixedWindow, 100, 60_000);
const SLIDING: LimitSpec = LimitSpec::window(AlgorithmSpec::SlidingWindow, 100, 60_000);

async fn sync_at(state: &AppState, request: &SyncRequest, now: u64) -> Vec<Lease> {
    sync_handler::apply(state, request, now).await.unwrap()
}

fn one(proxy: &str, limits: &[LimitSpec], spent: u64, denied: u64) -> SyncRequest {
    batch(proxy, 100, vec![entry("k", limits, spent, denied)])
}

fn field(redis: &Redis, key: &str, name: &str) -> Option<String> {
    redis
        .query(&["HGET", key, name])
        .unwrap()
        .text()
        .map(str::to_owned)
}

/// A grant; `token_ms`, when one request more than `remaining` fits (a fixed window: its end).
fn grant(tokens: u64, ttl_ms: u64, remaining: u64, reset_ms: u64, token_ms: u64) -> Lease {
    Lease {
        tokens,
        ttl_ms,
        remaining,
        reset_ms,
        token_ms: Some(token_ms),
        refused: None,
        penalty_ms: 0,
    }
}

#[tokio::test]
async fn a_lease_ends_with_its_window_and_a_late_report_is_not_charged_to_the_next() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let key = keys::limit_key("k", &FIXED);
    let w1 = W0 + MINUTE;
    // 100 ms before the window ends, a wants far more than 100: it gets the whole window, for
    // 100 ms (not the 300 ms of a lease TTL). Nothing is counted yet, so 100 remain (the lease is
    // not subtracted: the proxy subtracts what it spends), and the window resets at its end.
    let a = sync_at(&state, &one("a", &[FIXED], 0, 100), w1 - 100 * MS).await;
    assert_eq!(a, vec![grant(100, 100, 100, 100, 100)]);
    let expiry: f64 = field(&redis, &key, "x:a").unwrap().parse().unwrap();
    assert_eq!(expiry, w1 as f64, "the lease ends with the window");
    // b, 50 ms before the end: a's lease holds everything left
    let b = sync_at(&state, &one("b", &[FIXED], 0, 10), w1 - 50 * MS).await;
    assert_eq!(b, vec![grant(0, 50, 100, 50, 50)]);

    // 50 ms into the next window a reports 107: its old lease covered at most 100 of them
    // (spent before the boundary, in the old window, which is over), so the new window counts 7
    // (what its fallback admitted after the boundary). Demand: 107 over 150 ms is 713/s, and
    // max(713, 0.5 × 1000 + 0.5 × 713) = 857: a wants ceil(857 × 0.125) + 1 = 109, and gets
    // what is left, 100 - 7 = 93 (b's lease ended with the old window), for a whole TTL.
    let a = sync_at(&state, &one("a", &[FIXED], 107, 0), w1 + 50 * MS).await;
    assert_eq!(a, vec![grant(93, 300, 93, 59_950, 59_950)]);
    assert_eq!(field(&redis, &key, "n").as_deref(), Some("7"));
    let start: f64 = field(&redis, &key, "w").unwrap().parse().unwrap();
    assert_eq!(start, w1 as f64);
    let pttl: u64 = redis.text(&["PTTL", &key]).unwrap().parse().unwrap();
    assert!(
        pttl <= 59_950 + 1_000,
        "until the window ends, and a second: {pttl}"
    );

    // A strict check of the same limit sees the same count, and a's lease: 7 + 93, no room.
    let check = CheckRequest {
        key: "k".into(),
        limits: vec![FIXED],
        cost: 1,
        penalty_ms: 0,
        proxy: None,
    };
    let answer = check_handler::decide(&state, &check, None, w1 + 60 * MS)
        .await
        .unwrap();
    assert!(!answer.allowed, "{answer:?}");
    assert_eq!((answer.remaining, answer.retry_after_ms), (0, 59_940));
    // b gets nothing while a holds the rest of the window
    let b = sync_at(&state, &one("b", &[FIXED], 0, 5), w1 + 100 * MS).await;
    assert_eq!(b[0].tokens, 0);

    // a spends its 93 (the window is used up: 100), and asks again: nothing, until the end
    let a = sync_at(&state, &one("a", &[FIXED], 93, 20), w1 + 150 * MS).await;
    assert_eq!(a, vec![grant(0, 300, 0, 59_850, 59_850)]);
    // after a's lease expires, the strict check waits for the window's end too
    let answer = check_handler::decide(&state, &check, None, w1 + 30_000 * MS)
        .await
        .unwrap();
    assert_eq!(
        (answer.allowed, answer.retry_after_ms, answer.reset_ms),
        (false, 30_000, 30_000)
    );

    // The next window starts fresh: a, which spent nothing since, gets a lease again.
    let w2 = w1 + MINUTE;
    let a = sync_at(&state, &one("a", &[FIXED], 0, 3), w2 + 10 * MS).await;
    assert!(a[0].tokens > 0 && a[0].remaining == 100, "{a:?}");
    assert_eq!(field(&redis, &key, "n").as_deref(), Some("0"));
}

#[tokio::test]
async fn a_lease_ends_with_the_first_window_of_its_entry_to_end() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let per_second = LimitSpec::window(AlgorithmSpec::FixedWindow, 10, 1_000);
    let limits = [FIXED, per_second];
    // 10 a second binds the lease, and its second ends 200 ms later; 100 remain in the minute
    // but 10 in the second: the reply speaks for the tighter one.
    let a = sync_at(&state, &one("a", &limits, 0, 1_000), W0 + 800 * MS).await;
    assert_eq!(a, vec![grant(10, 200, 10, 200, 200)]);
    let a = sync_at(&state, &one("a", &limits, 0, 1_000), W0 + 1_500 * MS).await;
    assert_eq!(a[0].ttl_ms, 300);
    // a sliding window ends its leases at its window's end too
    let s = sync_at(&state, &one("s", &[SLIDING], 0, 1), W0 + 59_990 * MS).await;
    assert_eq!(s[0].ttl_ms, 10);
    // and a lease that would last less than a millisecond is no lease
    let s = sync_at(&state, &one("s", &[SLIDING], 0, 1), W0 + MINUTE - 500).await;
    assert_eq!((s[0].tokens, s[0].ttl_ms), (0, 0));
}

/// A proxy of the simulation below: requests arrive every `every_ms`; it syncs once a second,
/// `offset_ms` into each second, and decides as the filter does: from its lease while the lease
/// runs (denying once it is spent), from its fallback (`FALLBACK` a window) once it lapsed.
struct Proxy {
    name: &'static str,
    every_ms: u64,
    offset_ms: u64,
    lease: u64,
    granted: u64,
    until: u64,
    spent: u64,
    denied: u64,
    fallback_used: HashMap<u64, u64>,
}

const FALLBACK: u64 = 5;

impl Proxy {
    fn new(name: &'static str, every_ms: u64, offset_ms: u64) -> Proxy {
        Proxy {
            name,
            every_ms,
            offset_ms,
            lease: 0,
            granted: 0,
            until: 0,
            spent: 0,
            denied: 0,
            fallback_used: HashMap::new(),
        }
    }
}

/// What the fleet admitted in each window: in all, and outside a lease (fallbacks).
#[derive(Clone, Debug, Default)]
struct Admitted {
    all: HashMap<u64, u64>,
    outside_leases: HashMap<u64, u64>,
}

/// Two proxies at 4/s and 10/s (14/s against 100 a minute), syncing every second, for two
/// minutes. Checks at every sync that the count and the unexpired leases together leave room
/// for the grant, and that no lease outlives its window; `check` sees every admission (of the
/// run that is judged: the windows expire on Redis's own clock, and a run that falls a second
/// behind it on a busy machine is run again, at most three times, `RedisPace`).
async fn simulate(
    limit: LimitSpec,
    mut check: impl FnMut(u64, &Admitted),
) -> (Admitted, Vec<(u64, Vec<u64>)>) {
    for attempt in 1..=3 {
        let mut admissions = Vec::new();
        if let Some(run) = simulate_once(limit, &mut admissions, attempt == 3).await {
            for (now, admitted) in &admissions {
                check(*now, admitted);
            }
            return run;
        }
        eprintln!("run {attempt} fell behind Redis's clock: again");
    }
    unreachable!("the third run is judged")
}

/// One run of [`simulate`]; `None` if it fell behind Redis's clock (unless it is `judged`
/// anyway); each admission with the fleet's counts after it goes into `admissions`.
async fn simulate_once(
    limit: LimitSpec,
    admissions: &mut Vec<(u64, Admitted)>,
    judged: bool,
) -> Option<(Admitted, Vec<(u64, Vec<u64>)>)> {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let key = keys::limit_key("k", &limit);
    let mut proxies = [Proxy::new("a", 250, 300), Proxy::new("b", 100, 700)];
    let mut admitted = Admitted::default();
    let mut first_grants: Vec<(u64, Vec<u64>)> = Vec::new();
    let mut pace = common::RedisPace::new();
    for tick in 0..12_000u64 {
        let now = W0 + tick * 10 * MS;
        let window = (now - W0) / MINUTE;
        let window_end = W0 + (window + 1) * MINUTE;
        for p in 0..proxies.len() {
            let proxy = &mut proxies[p];
            if (tick * 10) % proxy.every_ms == 0 {
                if now < proxy.until {
                    if proxy.lease > 0 {
                        proxy.lease -= 1;
                        proxy.spent += 1;
                        *admitted.all.entry(window).or_default() += 1;
                    } else {
                        proxy.denied += 1;
                    }
                } else {
                    let used = proxy.fallback_used.entry(window).or_default();
                    if *used < FALLBACK {
                        *used += 1;
                        proxy.spent += 1;
                        *admitted.all.entry(window).or_default() += 1;
                        *admitted.outside_leases.entry(window).or_default() += 1;
                    } else {
                        proxy.denied += 1;
                    }
                }
                admissions.push((now, admitted.clone()));
            }
            if (tick * 10) % 1_000 != proxy.offset_ms {
                continue;
            }
            let (spent, denied) = (proxy.spent, proxy.denied);
            let request = batch(proxy.name, 1_000, vec![entry("k", &[limit], spent, denied)]);
            let grant = sync_at(&state, &request, now).await.remove(0);
            // what Redis counts for the window after the grant (sliding: its number too)
            let counted = match limit.algorithm {
                AlgorithmSpec::SlidingWindow => {
                    let number =
                        |name| field(&redis, &key, name).and_then(|v| v.parse::<f64>().ok());
                    let into = ((now % MINUTE) as f64) / MINUTE as f64;
                    number("w")
                        .zip(number("p").zip(number("c")))
                        .map(|(w, (p, c))| (Some(w as u64), p * (1.0 - into) + c))
                }
                _ => field(&redis, &key, "n")
                    .and_then(|v| v.parse().ok())
                    .map(|n| (None, n)),
            };
            if !pace.keeps_up(now - W0) && !judged {
                return None;
            }
            let proxy = &mut proxies[p];
            (proxy.spent, proxy.denied) = (0, 0);
            proxy.lease = grant.tokens;
            proxy.granted = grant.tokens;
            proxy.until = now + grant.ttl_ms * MS;
            assert!(proxy.until <= window_end, "a lease outlives its window");
            if (now - W0) % MINUTE < 1_000 * MS {
                match first_grants.last_mut() {
                    Some((w, grants)) if *w == window => grants.push(grant.tokens),
                    _ => first_grants.push((window, vec![grant.tokens])),
                }
            }
            // At every grant, the window's count and every unexpired lease fit in it.
            if grant.tokens > 0 {
                let (number, counted) = counted.expect("a grant leaves the window's count");
                if let Some(number) = number {
                    assert_eq!(number, now / MINUTE);
                }
                let leases: u64 = proxies
                    .iter()
                    .filter(|q| q.until > now)
                    .map(|q| q.granted)
                    .sum();
                assert!(
                    counted + leases as f64 <= 100.0 + 1e-9,
                    "at +{} ms: counted {counted} + leases {leases} > 100",
                    (now - W0) / MS
                );
            }
        }
    }
    Some((admitted, first_grants))
}

#[tokio::test]
async fn a_fixed_window_admits_at_most_its_requests_plus_the_fallbacks_outside_a_lease() {
    let (admitted, first_grants) = simulate(FIXED, |_, _| {}).await;
    eprintln!("fixed: {admitted:?}; grants in each window's first second: {first_grants:?}");
    for window in [0, 1] {
        let all = admitted.all[&window];
        let outside = admitted.outside_leases[&window];
        assert!(
            all <= 100 + outside,
            "window {window}: admitted {all} > 100 + {outside} outside a lease"
        );
        // the window is used, not starved: 14/s use it up in about 7 s
        assert!(all >= 100, "window {window}: admitted only {all}");
        // the leases ended with the first window: each proxy's fallback answered first
        assert!(outside > 0 && outside <= 2 * FALLBACK, "{outside}");
    }
    // the second window starts fresh: both proxies get leases in its first second
    assert!(
        first_grants
            .iter()
            .any(|(w, grants)| *w == 1 && grants.len() == 2 && grants.iter().all(|&g| g > 0)),
        "{first_grants:?}"
    );
}

#[tokio::test]
async fn a_sliding_window_never_weighs_more_than_its_requests_plus_the_fallbacks() {
    // The true sliding count over every admission, by the window it happened in.
    let mut worst: f64 = 0.0;
    let (admitted, _) = simulate(SLIDING, |now, admitted| {
        let window = (now - W0) / MINUTE;
        let into = ((now - W0) % MINUTE) as f64 / MINUTE as f64;
        let get = |map: &HashMap<u64, u64>, w: Option<u64>| {
            w.and_then(|w| map.get(&w)).copied().unwrap_or(0) as f64
        };
        let previous = window.checked_sub(1);
        let weighted =
            get(&admitted.all, previous) * (1.0 - into) + get(&admitted.all, Some(window));
        let outside = get(&admitted.outside_leases, previous) * (1.0 - into)
            + get(&admitted.outside_leases, Some(window));
        worst = worst.max(weighted);
        assert!(
            weighted <= 100.0 + outside + 1e-9,
            "at +{} ms: weighted {weighted} > 100 + {outside}",
            (now - W0) / MS
        );
    })
    .await;
    eprintln!("sliding: {admitted:?}; the most weighed: {worst:.2}");
    assert!(worst > 95.0, "the window was used: {worst}");
}
