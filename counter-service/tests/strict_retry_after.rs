//! A strict rule's `Retry-After` is when the request would be admitted. The proxy answers a strict
//! denial with the service's `retry_after_ms` (rounded up to seconds), so the service's figure is
//! the client's. For every algorithm the service decides (`token_bucket`, which GCRA travels as,
//! `fixed_window`, `sliding_window`, `sliding_log`), one limit or several, a cost of 1 or more:
//! random traces through the service's check on a real Redis with a fake clock, and at each
//! denial the same request asked again a millisecond before the wait is over (denied) and when it
//! is over (admitted). Nothing else is sent in between, so nothing else can take the room.

mod common;

use sluice_counter_service::{check_handler, validate, AppState};
use sluice_protocol::{AlgorithmSpec, CheckRequest, LimitSpec};
use sluice_tests::redis::Redis;

/// splitmix64: a seeded generator, so a failure replays.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

const SECOND: u64 = 1_000;
const MINUTE: u64 = 60_000;
const HOUR: u64 = 3_600_000;

/// The limit sets of one algorithm: one limit, and several where either may be the one short.
fn limit_sets(algorithm: AlgorithmSpec) -> Vec<Vec<LimitSpec>> {
    let limit = |requests: u64, period_ms: u64, burst: u64| match algorithm {
        AlgorithmSpec::TokenBucket => LimitSpec::token_bucket(requests, period_ms, burst),
        windowed => LimitSpec::window(windowed, requests, period_ms),
    };
    vec![
        vec![limit(5, SECOND, 3)],
        vec![limit(7, MINUTE, 7)],
        vec![limit(4, SECOND, 4), limit(12, MINUTE, 6)],
        vec![
            limit(30, MINUTE, 10),
            limit(3, SECOND, 2),
            limit(50, HOUR, 50),
        ],
    ]
}

/// One check at `now_us` (a fake clock): (allowed, retry_after_ms).
fn check(
    runtime: &tokio::runtime::Runtime,
    state: &AppState,
    request: &CheckRequest,
    now_us: u64,
) -> (bool, u64) {
    let answer = runtime
        .block_on(check_handler::decide(state, request, None, now_us))
        .unwrap();
    (answer.allowed, answer.retry_after_ms)
}

#[test]
fn a_strict_denial_says_when_the_request_would_be_admitted() {
    let redis = Redis::start().unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let state = runtime.block_on(async { common::state(&redis.url()) });
    let mut rng = Rng(23);
    let mut cases = 0;
    let mut denials = 0;
    for algorithm in [
        AlgorithmSpec::TokenBucket,
        AlgorithmSpec::FixedWindow,
        AlgorithmSpec::SlidingWindow,
        AlgorithmSpec::SlidingLog,
    ] {
        for (set, limits) in limit_sets(algorithm).into_iter().enumerate() {
            let smallest = limits.iter().map(|l| l.burst).min().unwrap_or(1);
            let mut costs = vec![1, 2.min(smallest), smallest];
            costs.dedup();
            for cost in costs {
                for trace in 0..3 {
                    cases += 1;
                    let request = CheckRequest {
                        key: format!("{}-{set}-{cost}-{trace}", algorithm.name()),
                        limits: limits.clone(),
                        cost,
                        penalty_ms: 0,
                        proxy: None,
                    };
                    validate::check_request(&request, &state.settings)
                        .unwrap_or_else(|e| panic!("{request:?} refused: {e}"));
                    // Somewhere in 2023, not on a window's edge.
                    let mut now = 1_700_000_000_000_000 + rng.below(86_400_000_000);
                    // Arrivals about twice as fast as the fastest limit admits, so it denies often.
                    let fastest_us = limits
                        .iter()
                        .map(|l| l.period_ms * 1_000 / l.requests)
                        .min()
                        .unwrap_or(1);
                    let mut history = Vec::new();
                    for _ in 0..60 {
                        now += match rng.below(4) {
                            0 => 0,
                            _ => rng.below(fastest_us),
                        };
                        let (allowed, wait_ms) = check(&runtime, &state, &request, now);
                        history.push((now, allowed, wait_ms));
                        if allowed {
                            continue;
                        }
                        denials += 1;
                        let denied_at = now;
                        let what = || {
                            format!(
                                "{:?} cost {cost}, denied at {denied_at} us with retry_after_ms {wait_ms}; \
                                 the trace (us, allowed, retry_after_ms): {history:?}",
                                request.limits
                            )
                        };
                        assert!(wait_ms >= 1, "{}", what());
                        // A millisecond before the wait is over: still denied (the wait is not too long).
                        let before = now + (wait_ms - 1) * 1_000;
                        let (early, _) = check(&runtime, &state, &request, before);
                        assert!(!early, "admitted 1 ms before the wait was over; {}", what());
                        // When it is over: admitted.
                        now += wait_ms * 1_000;
                        let (admitted, _) = check(&runtime, &state, &request, now);
                        assert!(
                            admitted,
                            "denied again when the wait was over, at {now} us; {}",
                            what()
                        );
                        history.push((now, true, 0));
                    }
                }
            }
        }
    }
    eprintln!("{cases} traces, {denials} denials each checked at its wait");
    assert!(denials >= cases * 5, "{denials} denials in {cases} traces");
}
