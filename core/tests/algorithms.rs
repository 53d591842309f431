//! Every algorithm against its definition, written here independently of core's state
//! machines: a log of admitted times, counted the way the definition reads.

use proptest::prelude::*;
use sluice_core::limit::token_bucket::LimitState;
use sluice_core::limit::{Algorithm, Limit, Period};
use sluice_core::{limit::calendar, MemoryStore, PlainRequest};

const S: u64 = 1_000_000;
/// 2026-11-30 00:00:00 UTC, a Monday.
const MIDNIGHT: u64 = 1_795_996_800 * S;

fn windowed(requests: u64, period: Period, algorithm: Algorithm) -> Limit {
    Limit::windowed(requests, period, algorithm).unwrap()
}

/// Runs `times` through one limit's state machine; returns what it admitted.
fn run(limit: &Limit, times: &[u64]) -> Vec<bool> {
    let mut state = LimitState::fresh(limit, times[0]);
    times
        .iter()
        .map(|&t| {
            let (verdict, next) = state.admit(limit, t, 1);
            state = next;
            verdict.allowed
        })
        .collect()
}

/// The fixed window by its definition: at most `requests` admitted in each calendar window.
fn fixed_reference(requests: u64, period: Period, times: &[u64]) -> Vec<bool> {
    let mut admitted: Vec<u64> = Vec::new();
    times
        .iter()
        .map(|&t| {
            let (from, to) = (calendar::start_us(period, t), calendar::end_us(period, t));
            let in_window = admitted.iter().filter(|&&a| a >= from && a < to).count() as u64;
            let ok = in_window < requests;
            if ok {
                admitted.push(t);
            }
            ok
        })
        .collect()
}

/// The sliding window counter by its definition: admitted in the previous window, weighted
/// by the share of it still inside the last `period`, plus admitted in the current one.
fn sliding_reference(requests: u64, period_us: u64, times: &[u64]) -> Vec<bool> {
    let mut admitted: Vec<u64> = Vec::new();
    times
        .iter()
        .map(|&t| {
            let start = t / period_us * period_us;
            let previous = admitted
                .iter()
                .filter(|&&a| a < start && a + period_us >= start)
                .count() as f64;
            let current = admitted.iter().filter(|&&a| a >= start).count() as f64;
            let overlap = 1.0 - (t - start) as f64 / period_us as f64;
            let ok = previous * overlap + current + 1.0 <= requests as f64 + 1e-9;
            if ok {
                admitted.push(t);
            }
            ok
        })
        .collect()
}

/// A token bucket by its definition: `burst` at once, one more every `period / requests`.
fn bucket_reference(requests: u64, burst: u64, period_us: u64, times: &[u64]) -> Vec<bool> {
    // Integer arithmetic: tokens are counted in units of 1 / period_us.
    let full = burst * period_us;
    let mut level = full;
    let mut last = times[0];
    times
        .iter()
        .map(|&t| {
            level = (level + (t - last) * requests).min(full);
            last = t;
            let ok = level >= period_us;
            if ok {
                level -= period_us;
            }
            ok
        })
        .collect()
}

fn arrivals(start: u64, gaps: &[u64]) -> Vec<u64> {
    let mut t = start;
    gaps.iter()
        .map(|g| {
            t += g;
            t
        })
        .collect()
}

proptest! {
    #[test]
    fn the_fixed_window_admits_exactly_what_its_definition_allows(
        requests in 1u64..20,
        gaps in proptest::collection::vec(0u64..400_000, 1..300),
        offset in 0u64..S,
    ) {
        let limit = windowed(requests, Period::Second, Algorithm::FixedWindow);
        let times = arrivals(MIDNIGHT + offset, &gaps);
        prop_assert_eq!(run(&limit, &times), fixed_reference(requests, Period::Second, &times));
    }

    #[test]
    fn the_sliding_window_admits_exactly_what_its_definition_allows(
        requests in 1u64..20,
        gaps in proptest::collection::vec(0u64..300_000, 1..300),
        offset in 0u64..S,
    ) {
        let limit = windowed(requests, Period::Second, Algorithm::SlidingWindow);
        let times = arrivals(MIDNIGHT + offset, &gaps);
        prop_assert_eq!(run(&limit, &times), sliding_reference(requests, S, &times));
    }

    /// The bound the README states: never more than twice the limit in any span of a period.
    #[test]
    fn the_sliding_window_never_admits_twice_its_limit_in_any_period(
        requests in 1u64..20,
        gaps in proptest::collection::vec(0u64..200_000, 1..400),
    ) {
        let limit = windowed(requests, Period::Second, Algorithm::SlidingWindow);
        let times = arrivals(MIDNIGHT + 777, &gaps);
        let admitted: Vec<u64> = times
            .iter()
            .zip(run(&limit, &times))
            .filter_map(|(&t, ok)| ok.then_some(t))
            .collect();
        for (i, &from) in admitted.iter().enumerate() {
            let within = admitted[i..].iter().take_while(|&&t| t < from + S).count() as u64;
            prop_assert!(within <= 2 * requests, "{} admitted within a second of {}", within, from);
        }
    }

    #[test]
    fn gcra_admits_exactly_what_a_token_bucket_admits(
        requests in prop::sample::select(vec![1u64, 2, 4, 5, 8, 10, 20, 25, 50, 100]),
        burst in 1u64..20,
        gaps in proptest::collection::vec(0u64..300_000, 1..300),
    ) {
        let limit = Limit::new(requests, Period::Second, Some(burst)).unwrap().gcra();
        let times = arrivals(MIDNIGHT, &gaps);
        prop_assert_eq!(run(&limit, &times), bucket_reference(requests, burst, S, &times));
    }

    /// Whenever a request is refused, one sent `Retry-After` later is admitted, and one sent
    /// a microsecond before that is not.
    #[test]
    fn retry_after_is_exact_for_every_algorithm(
        algorithm in prop::sample::select(vec![Algorithm::Gcra, Algorithm::FixedWindow, Algorithm::SlidingWindow]),
        requests in 1u64..10,
        gaps in proptest::collection::vec(0u64..200_000, 1..60),
    ) {
        let limit = match algorithm {
            Algorithm::Gcra => Limit::new(requests, Period::Second, None).unwrap().gcra(),
            a => windowed(requests, Period::Second, a),
        };
        let times = arrivals(MIDNIGHT + 123_457, &gaps);
        let mut state = LimitState::fresh(&limit, times[0]);
        for &t in &times {
            let (verdict, next) = state.admit(&limit, t, 1);
            if !verdict.allowed {
                let wait = verdict.retry_after_us;
                prop_assert!(wait > 0);
                let (at, _) = next.check(&limit, t + wait, 1);
                prop_assert!(at.allowed, "{:?}: not admitted {} us later", algorithm, wait);
                if wait > 1 {
                    let (before, _) = next.check(&limit, t + wait - 2, 1);
                    prop_assert!(!before.allowed, "{:?}: admitted before {} us", algorithm, wait);
                }
            }
            state = next;
        }
    }

    /// A key evicted and seen again never has more left than it had.
    #[test]
    fn a_returning_key_gets_back_no_more_than_it_had(
        algorithm in prop::sample::select(vec![Algorithm::TokenBucket, Algorithm::Gcra, Algorithm::FixedWindow, Algorithm::SlidingWindow]),
        requests in 1u64..30,
        used in 0u64..30,
        later in 0u64..2_000_000,
    ) {
        let limit = match algorithm {
            Algorithm::TokenBucket => Limit::new(requests, Period::Minute, None).unwrap(),
            Algorithm::Gcra => Limit::new(requests, Period::Minute, None).unwrap().gcra(),
            a => windowed(requests, Period::Minute, a),
        };
        let t0 = MIDNIGHT + 17 * S;
        let mut state = LimitState::fresh(&limit, t0);
        for i in 0..used.min(requests) {
            state = state.admit(&limit, t0 + i, 1).1;
        }
        let evicted_at = t0 + 1_000;
        let ghost = state.ghost_us(&limit, evicted_at);
        let back_at = evicted_at + later;
        let truth = state.check(&limit, back_at, 0).0.remaining;
        let returned = if ghost > back_at {
            LimitState::returning(&limit, back_at, ghost)
        } else {
            LimitState::fresh(&limit, back_at)
        };
        let given = returned.check(&limit, back_at, 0).0.remaining;
        prop_assert!(given <= truth, "{:?}: {} left after return, {} truly", algorithm, given, truth);
    }
}

#[test]
fn a_fixed_window_admits_twice_its_limit_across_a_boundary_and_a_sliding_window_does_not() {
    // 10 a minute: 10 in the last 100 ms of a minute, 10 in the first 100 ms of the next.
    let edge = MIDNIGHT + 60 * S;
    let times: Vec<u64> = (0..10)
        .map(|i| edge - 100_000 + i * 10_000)
        .chain((0..10).map(|i| edge + i * 10_000))
        .collect();
    let fixed = run(
        &windowed(10, Period::Minute, Algorithm::FixedWindow),
        &times,
    );
    assert_eq!(
        fixed.iter().filter(|&&a| a).count(),
        20,
        "the classic 2x burst"
    );
    let sliding = run(
        &windowed(10, Period::Minute, Algorithm::SlidingWindow),
        &times,
    );
    assert_eq!(sliding.iter().filter(|&&a| a).count(), 10, "{sliding:?}");
    let bucket = run(&Limit::new(10, Period::Minute, None).unwrap(), &times);
    assert_eq!(bucket.iter().filter(|&&a| a).count(), 10);
    let log = through_limiter(
        r#"{"requests": 10, "per": "minute", "algorithm": "sliding_log"}"#,
        &times,
    );
    assert_eq!(
        log.iter().filter(|&&a| a).count(),
        10,
        "none of the second burst: {log:?}"
    );
    assert!(log[..10].iter().all(|&a| a));
}

/// Runs `times` through the limiter (key table, records, rings) for one key and a rule of
/// `limits` (JSON, comma separated); returns what it admitted.
fn through_limiter(limits: &str, times: &[u64]) -> Vec<bool> {
    let json = format!(
        r#"{{"max_keys": 64, "rules": [{{"name": "r", "key": ["client_ip"], "limits": [{limits}]}}]}}"#
    );
    let limiter = sluice_core::Limiter::new(sluice_core::parse(json.as_bytes()).unwrap());
    let mut store = MemoryStore::default();
    times
        .iter()
        .map(|&t| {
            let mut request = PlainRequest::get("/x").from_ip("192.0.2.1");
            let conditions = sluice_core::Conditions {
                now_us: t,
                service_up: true,
                service_back_us: 0,
                load: Default::default(),
            };
            let evaluation = limiter.decide(&mut request, conditions, &mut store);
            matches!(evaluation.decision, sluice_core::Decision::Allow { .. })
        })
        .collect()
}

/// The sliding log by its definition: admitted while fewer than `requests` admitted requests
/// arrived in the last `period` (a request at `a` counts while `t < a + period`), for every
/// `(requests, period)`.
fn log_reference(limits: &[(u64, u64)], times: &[u64]) -> Vec<bool> {
    let mut admitted: Vec<u64> = Vec::new();
    times
        .iter()
        .map(|&t| {
            let ok = limits.iter().all(|&(requests, period_us)| {
                (admitted.iter().filter(|&&a| t < a + period_us).count() as u64) < requests
            });
            if ok {
                admitted.push(t);
            }
            ok
        })
        .collect()
}

proptest! {
    #[test]
    fn the_sliding_log_admits_exactly_what_its_definition_allows(
        requests in 1u64..12,
        gaps in proptest::collection::vec(0u64..400_000, 1..300),
    ) {
        let times = arrivals(MIDNIGHT, &gaps);
        let limit = format!(r#"{{"requests": {requests}, "per": "second", "algorithm": "sliding_log"}}"#);
        prop_assert_eq!(through_limiter(&limit, &times), log_reference(&[(requests, S)], &times));
    }

    #[test]
    fn a_rule_of_two_sliding_logs_admits_what_both_allow(
        per_second in 1u64..6,
        per_minute in 5u64..40,
        gaps in proptest::collection::vec(0u64..900_000, 1..300),
    ) {
        let times = arrivals(MIDNIGHT, &gaps);
        let limits = format!(
            r#"{{"requests": {per_second}, "per": "second", "algorithm": "sliding_log"}}, {{"requests": {per_minute}, "per": "minute", "algorithm": "sliding_log"}}"#
        );
        prop_assert_eq!(
            through_limiter(&limits, &times),
            log_reference(&[(per_second, S), (per_minute, 60 * S)], &times)
        );
    }
}

#[test]
fn a_daily_quota_resets_at_midnight_utc_and_says_so() {
    let limit = windowed(3, Period::Day, Algorithm::FixedWindow);
    let evening = MIDNIGHT + 23 * 3_600 * S;
    let mut state = LimitState::fresh(&limit, evening);
    for _ in 0..3 {
        state = state.admit(&limit, evening, 1).1;
    }
    let (verdict, _) = state.check(&limit, evening, 1);
    assert!(!verdict.allowed);
    assert_eq!(verdict.retry_after_us, 3_600 * S, "until 00:00 UTC");
    assert_eq!(verdict.reset_us, 3_600 * S);
    let (verdict, _) = state.check(&limit, MIDNIGHT + 86_400 * S, 1);
    assert!(verdict.allowed);
    assert_eq!(verdict.remaining, 2);
    // A month: November 2026 ends on the 30th at midnight.
    let monthly = windowed(1_000, Period::Month, Algorithm::FixedWindow);
    let (verdict, _) = LimitState::fresh(&monthly, evening).admit(&monthly, evening, 1);
    assert_eq!(verdict.reset_us, 3_600 * S, "{verdict:?}");
}

#[test]
fn configuration_names_the_field_of_every_algorithm_mistake() {
    let rule = |limits: &str, extra: &str| {
        format!(
            r#"{{"service": {{"cluster": "c"}}, "rules": [{{"name": "r", "key": ["client_ip"], "limits": {limits}{extra}}}]}}"#
        )
    };
    let cases = [
        (
            rule(
                r#"[{"requests": 5, "per": "minute", "burst": 9, "algorithm": "fixed_window"}]"#,
                r#", "consistency": "local""#,
            ),
            "rules[0].limits[0].burst",
        ),
        (
            rule(
                r#"[{"requests": 5, "per": "week"}]"#,
                r#", "consistency": "local""#,
            ),
            "rules[0].limits[0].per",
        ),
        (
            rule(
                r#"[{"requests": 5, "per": "month", "algorithm": "sliding_window"}]"#,
                r#", "consistency": "local""#,
            ),
            "rules[0].limits[0].per",
        ),
        (
            // Cached is the default with a service: a log is never leased.
            rule(
                r#"[{"requests": 5, "per": "minute", "algorithm": "sliding_log"}]"#,
                "",
            ),
            "rules[0].consistency",
        ),
        (
            rule(
                r#"[{"requests": 5, "per": "minute", "algorithm": "sliding_log", "burst": 9}]"#,
                r#", "consistency": "strict""#,
            ),
            "rules[0].limits[0].burst",
        ),
        (
            rule(
                r#"[{"requests": 1001, "per": "hour", "algorithm": "sliding_log"}]"#,
                r#", "consistency": "strict""#,
            ),
            "rules[0].limits[0].requests",
        ),
        (
            rule(
                r#"[{"requests": 5, "per": "week", "algorithm": "sliding_log"}]"#,
                r#", "consistency": "local""#,
            ),
            "rules[0].limits[0].per",
        ),
        (
            // 1000 timestamps for each of the default 65,536 keys: 500 MiB.
            rule(
                r#"[{"requests": 1000, "per": "hour", "algorithm": "sliding_log"}]"#,
                r#", "consistency": "local""#,
            ),
            "rules[0].limits[0].requests",
        ),
        (
            rule(
                r#"[{"requests": 5, "per": "minute", "algorithm": "fifo"}]"#,
                "",
            ),
            "rules[0].limits[0].algorithm",
        ),
        (
            rule(
                r#"[{"requests": 5, "per": "minute"}, {"requests": 50, "per": "day", "algorithm": "fixed_window"}]"#,
                r#", "consistency": "local""#,
            ),
            "rules[0].limits[1].algorithm",
        ),
        (
            rule(
                r#"[{"requests": 900000, "per": "second", "algorithm": "fixed_window"}]"#,
                r#", "consistency": "local""#,
            ),
            "rules[0].limits[0].requests",
        ),
    ];
    for (json, field) in cases {
        let error = sluice_core::parse(json.as_bytes()).unwrap_err();
        assert_eq!(error.field, field, "{json}: {error}");
    }
    // What is fine: gcra everywhere; windows locally, strict, cached, and as a cached rule's
    // fallback.
    for ok in [
        rule(
            r#"[{"requests": 5, "per": "minute", "algorithm": "fixed_window"}]"#,
            r#", "consistency": "cached""#,
        ),
        rule(
            r#"[{"requests": 5, "per": "minute", "algorithm": "sliding_window"}]"#,
            r#", "consistency": "cached""#,
        ),
        rule(
            r#"[{"requests": 10000, "per": "month", "algorithm": "fixed_window"}]"#,
            r#", "consistency": "cached", "fallback": {"policy": "fail_open", "limits": [{"requests": 20, "per": "minute"}]}"#,
        ),
        rule(
            r#"[{"requests": 5, "per": "minute", "algorithm": "sliding_window"}]"#,
            r#", "consistency": "strict""#,
        ),
        rule(
            r#"[{"requests": 3, "per": "day", "algorithm": "fixed_window"}, {"requests": 50, "per": "month", "algorithm": "fixed_window"}]"#,
            r#", "consistency": "strict""#,
        ),
        rule(
            r#"[{"requests": 5, "per": "minute", "algorithm": "gcra"}]"#,
            r#", "consistency": "strict""#,
        ),
        rule(
            r#"[{"requests": 10000, "per": "month", "algorithm": "fixed_window"}]"#,
            r#", "consistency": "local""#,
        ),
        rule(
            r#"[{"requests": 5, "per": "minute"}]"#,
            r#", "consistency": "cached", "fallback": {"policy": "fail_open", "limits": [{"requests": 3, "per": "minute", "algorithm": "sliding_window"}]}"#,
        ),
        rule(
            r#"[{"requests": 5, "per": "minute", "algorithm": "sliding_log"}, {"requests": 20, "per": "hour", "algorithm": "sliding_log"}]"#,
            r#", "consistency": "local""#,
        ),
        rule(
            r#"[{"requests": 5, "per": "minute", "algorithm": "sliding_log"}]"#,
            r#", "consistency": "strict""#,
        ),
        rule(
            r#"[{"requests": 5, "per": "minute"}]"#,
            r#", "consistency": "cached", "fallback": {"policy": "fail_open", "limits": [{"requests": 2, "per": "minute", "algorithm": "sliding_log"}]}"#,
        ),
    ] {
        assert!(sluice_core::parse(ok.as_bytes()).is_ok(), "{ok}");
    }
}

#[test]
fn the_limiter_counts_every_algorithm_through_the_key_table() {
    for (algorithm, limit) in [
        (
            "gcra",
            r#"{"requests": 3, "per": "minute", "algorithm": "gcra"}"#,
        ),
        (
            "fixed_window",
            r#"{"requests": 3, "per": "day", "algorithm": "fixed_window"}"#,
        ),
        (
            "sliding_window",
            r#"{"requests": 3, "per": "minute", "algorithm": "sliding_window"}"#,
        ),
    ] {
        let json = format!(
            r#"{{"headers": "legacy", "rules": [{{"name": "r", "key": ["client_ip"], "limits": [{limit}]}}]}}"#
        );
        let limiter = sluice_core::Limiter::new(sluice_core::parse(json.as_bytes()).unwrap());
        let mut store = MemoryStore::default();
        let mut admitted = 0;
        for i in 0..10 {
            let mut request = PlainRequest::get("/x").from_ip("192.0.2.1");
            let conditions = sluice_core::Conditions {
                now_us: MIDNIGHT + 5 * S + i,
                service_up: true,
                service_back_us: 0,
                load: Default::default(),
            };
            let evaluation = limiter.decide(&mut request, conditions, &mut store);
            admitted += matches!(evaluation.decision, sluice_core::Decision::Allow { .. }) as u32;
        }
        assert_eq!(admitted, 3, "{algorithm}");
    }
}

fn leaky(requests: u64, delay: u32, queue: u32, max_delay_ms: u32) -> Limit {
    let shaping = sluice_core::limit::Shaping {
        delay,
        queue,
        max_delay_ms,
    };
    Limit::leaky(requests, Period::Second, shaping).unwrap()
}

proptest! {
    /// Every admitted request leaves on the schedule of its definition: one every
    /// `period / requests`, never before its arrival, the first `delay` of a burst with the
    /// one leaving now; never more than `delay + queue` slots taken ahead.
    #[test]
    fn the_leaky_bucket_lets_requests_leave_at_its_rate(
        requests in prop::sample::select(vec![1u64, 2, 4, 5, 10, 20, 50]),
        delay in 0u32..4,
        queue in 1u32..10,
        gaps in proptest::collection::vec(0u64..300_000, 1..200),
    ) {
        let limit = leaky(requests, delay, queue, 60_000);
        let t = S / requests;
        let times = arrivals(MIDNIGHT, &gaps);
        let mut state = LimitState::fresh(&limit, times[0]);
        // The reference: the next free slot, as the definition reads.
        let mut next_slot = times[0];
        for &now in &times {
            let (verdict, next) = state.admit(&limit, now, 1);
            state = next;
            let slot = next_slot.max(now);
            // At most `delay + queue` slots may be taken ahead of the one leaving now.
            let fits = slot - now <= (delay + queue) as u64 * t;
            prop_assert_eq!(verdict.allowed, fits, "at {}: slot {}", now, slot);
            if fits {
                let leave = slot.saturating_sub(delay as u64 * t).max(now);
                prop_assert_eq!(verdict.delay_us, leave - now);
                next_slot = slot + t;
            }
        }
    }
}

#[test]
fn a_leaky_bucket_refuses_a_wait_beyond_max_delay_and_says_when_to_retry() {
    // 10 a second (one every 100 ms), 20 may wait, but never longer than 250 ms.
    let limit = leaky(10, 0, 20, 250);
    let now = MIDNIGHT;
    let mut state = LimitState::fresh(&limit, now);
    let mut delays = Vec::new();
    loop {
        let (verdict, next) = state.admit(&limit, now, 1);
        if !verdict.allowed {
            // The 4th would wait 300 ms: refused; the wait is within bounds 50 ms later.
            assert_eq!(verdict.retry_after_us, 50_000, "{verdict:?}");
            break;
        }
        delays.push(verdict.delay_us / 1_000);
        state = next;
    }
    assert_eq!(delays, vec![0, 100, 200]);
    // A held request whose client leaves gives its slot back: the next one takes it.
    let state = state.give_back(&limit, 1);
    let (verdict, _) = state.admit(&limit, now, 1);
    assert_eq!(verdict.delay_us, 200_000);
}

#[test]
fn leaky_bucket_configuration_errors_name_their_field() {
    let rule = |limit: &str, extra: &str| {
        format!(
            r#"{{"service": {{"cluster": "c"}}, "rules": [{{"name": "r", "key": ["client_ip"], "limits": [{limit}]{extra}}}]}}"#
        )
    };
    let cases = [
        (
            rule(
                r#"{"requests": 5, "per": "second", "algorithm": "leaky_bucket", "queue": 5}"#,
                r#", "consistency": "cached""#,
            ),
            "rules[0].consistency",
        ),
        (
            rule(
                r#"{"requests": 5, "per": "second", "algorithm": "leaky_bucket", "queue": 5}"#,
                r#", "consistency": "strict""#,
            ),
            "rules[0].consistency",
        ),
        (
            rule(
                r#"{"requests": 5, "per": "second"}"#,
                r#", "fallback": {"policy": "fail_open", "limits": [{"requests": 5, "per": "second", "algorithm": "leaky_bucket", "queue": 1}]}"#,
            ),
            "rules[0].fallback.limits",
        ),
        (
            rule(
                r#"{"requests": 5, "per": "second", "algorithm": "leaky_bucket", "queue": 5, "burst": 3}"#,
                r#", "consistency": "local""#,
            ),
            "rules[0].limits[0].burst",
        ),
        (
            rule(
                r#"{"requests": 5, "per": "second", "algorithm": "leaky_bucket", "queue": 5, "max_delay_ms": 0}"#,
                r#", "consistency": "local""#,
            ),
            "rules[0].limits[0].max_delay_ms",
        ),
        (
            rule(
                r#"{"requests": 5, "per": "second", "queue": 5}"#,
                r#", "consistency": "local""#,
            ),
            "rules[0].limits[0].queue",
        ),
        (
            rule(
                r#"{"requests": 5, "per": "second", "algorithm": "gcra", "delay": 5}"#,
                r#", "consistency": "local""#,
            ),
            "rules[0].limits[0].delay",
        ),
    ];
    for (json, field) in cases {
        let error = sluice_core::parse(json.as_bytes()).unwrap_err();
        assert_eq!(error.field, field, "{json}: {error}");
    }
    let ok = rule(
        r#"{"requests": 5, "per": "second", "algorithm": "leaky_bucket", "delay": 2, "queue": 10, "max_delay_ms": 2000}"#,
        r#", "consistency": "local""#,
    );
    assert!(sluice_core::parse(ok.as_bytes()).is_ok());
}

#[test]
fn the_exchange_holds_a_shaped_request_and_gives_its_slot_back_if_it_never_leaves() {
    use sluice_core::{Exchange, Moment, Step};
    let json = r#"{"rules": [{"name": "shape", "key": ["const:all"],
        "limits": [{"requests": 10, "per": "second", "algorithm": "leaky_bucket", "queue": 5}]}]}"#;
    let limiter = sluice_core::Limiter::new(sluice_core::parse(json.as_bytes()).unwrap());
    let mut store = MemoryStore::default();
    let at = Moment::at;
    let start = |store: &mut MemoryStore| {
        let mut request = PlainRequest::get("/x");
        Exchange::start(&limiter, &mut request, None, at(MIDNIGHT), store)
    };
    let (_, first, _) = start(&mut store);
    assert_eq!(first, Step::Continue);
    let (mut second, step, _) = start(&mut store);
    assert_eq!(
        step,
        Step::Delay {
            until_us: MIDNIGHT + 100_000
        }
    );
    let (_, step, _) = start(&mut store);
    assert_eq!(
        step,
        Step::Delay {
            until_us: MIDNIGHT + 200_000
        }
    );
    // The second's client leaves before its slot: the slot goes back, the next request
    // gets the 200 ms slot again, not the 300 ms one.
    second.cancel_delay(&limiter, &mut store);
    let (_, step, _) = start(&mut store);
    assert_eq!(
        step,
        Step::Delay {
            until_us: MIDNIGHT + 200_000
        }
    );
}
