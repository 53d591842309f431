//! `Retry-After` says when the request would actually be admitted: for a cached rule of several
//! limits (the limit that is short, not the first one), for several rules (the longest wait of
//! every rule that would deny), for a blocked key (the time its block has left), and, as a
//! property, for every algorithm, local and cached, one or several limits and rules, against the
//! limiter itself.

use proptest::prelude::*;
use proptest::test_runner::Config;
use serde_json::{json, Value};

use sluice_core::limiter::{Conditions, BLOCKED_RETRY_US, MAX_BLOCKED_RETRY_US};
use sluice_core::policy::RuleId;
use sluice_core::protocol::{KeyAction, Lease, LiveOverrides};
use sluice_core::reply::headers::retry_after_seconds;
use sluice_core::sync::proxy::apply_lease;
use sluice_core::{Decision, Limiter, MemoryStore, Outcome, PlainRequest};

const MS: u64 = 1_000;
const SECOND: u64 = 1_000_000;
const T0: u64 = 1_700_000_000 * SECOND;
const KEY: &str = "shared\u{1f}all";

fn up(now_us: u64) -> Conditions {
    Conditions {
        now_us,
        service_up: true,
        service_back_us: 0,
        load: Default::default(),
    }
}

fn limiter(config: &Value) -> Limiter {
    Limiter::new(sluice_core::parse(config.to_string().as_bytes()).unwrap())
}

/// The decision of one request of `limiter` at `now_us`: `Some(retry_after_us)` when denied.
fn denied(limiter: &Limiter, store: &mut MemoryStore, now_us: u64) -> Option<(RuleId, u64)> {
    let evaluation = limiter.decide(&mut PlainRequest::get("/"), up(now_us), store);
    match evaluation.decision {
        Decision::Allow { .. } => None,
        Decision::Deny {
            rule,
            retry_after_us,
            ..
        } => Some((rule, retry_after_us)),
        other => panic!("{other:?}"),
    }
}

/// The README's `per-key` example, cached: `[1000/minute, 100000/day]`. The service says the
/// minute bucket is empty and the day bucket half used: full again in 12 hours, a token back in
/// every limit in 60 ms. A denied request waits 60 ms (Retry-After: 1), not the 43,140 s the
/// first limit's arithmetic made of the day's reset.
#[test]
fn a_cached_rule_of_several_limits_waits_for_the_limit_that_is_short() {
    let limiter = limiter(&json!({
        "service": {"cluster": "svc", "token": "t"},
        "rules": [{"name": "shared", "key": ["const:all"], "consistency": "cached",
            "limits": [{"requests": 1000, "per": "minute"}, {"requests": 100000, "per": "day"}]}]
    }));
    let mut store = MemoryStore::default();
    let grant = Lease {
        tokens: 0,
        ttl_ms: 300,
        remaining: 0,
        reset_ms: 43_200_000,
        token_ms: Some(60),
        refused: None,
        penalty_ms: 0,
    };
    apply_lease(&limiter, RuleId::new(0), KEY, &grant, T0, &mut store).unwrap();
    let (_, wait) = denied(&limiter, &mut store, T0 + 10 * MS).expect("the lease is empty");
    assert_eq!(wait, 50 * MS, "the minute's token, 60 ms after the answer");
    assert_eq!(retry_after_seconds(wait), 1);
    // An older service says nothing of it: the first limit's arithmetic, as before.
    let mut store = MemoryStore::default();
    let old = Lease {
        token_ms: None,
        ..grant
    };
    apply_lease(&limiter, RuleId::new(0), KEY, &old, T0, &mut store).unwrap();
    let (_, wait) = denied(&limiter, &mut store, T0 + 10 * MS).unwrap();
    assert_eq!(
        retry_after_seconds(wait),
        43_141,
        "43,200 s less 999 tokens of 60 ms, less 10 ms"
    );
}

/// A cached window used up, as the service last described it: 20 an hour, the hour ends 2,820 s
/// after the answer. A request denied once this proxy's lease (its share of what the window had
/// left) is spent waits until the window admits one more, as the service said (`token_ms`): a
/// fixed window at its end; a sliding window 180 s into the next hour, where the hour's 20 weigh
/// under 19 (not `period / requests`, 180 s, which its lease once meant: it would come back
/// 2,820 s too early and be refused). While the window still has room others' leases hold, the
/// lease is what is short: one request's time at the window's rate.
#[test]
fn a_cached_window_waits_until_the_window_admits_one_more() {
    for (algorithm, reset_ms, token_ms) in [
        ("sliding_window", 6_420_000, 3_000_000),
        ("fixed_window", 2_820_000, 2_820_000),
    ] {
        let limiter = limiter(&json!({
            "service": {"cluster": "svc", "token": "t"},
            "rules": [{"name": "shared", "key": ["const:all"], "consistency": "cached",
                "limits": [{"requests": 20, "per": "hour", "algorithm": algorithm}],
                "fallback": {"policy": "fail_closed"}}]
        }));
        let mut store = MemoryStore::default();
        // The window had 3 left and this proxy leased them: after its 3, the window is used up.
        let grant = Lease {
            tokens: 3,
            ttl_ms: 300,
            remaining: 3,
            reset_ms,
            token_ms: Some(token_ms),
            refused: None,
            penalty_ms: 0,
        };
        apply_lease(&limiter, RuleId::new(0), KEY, &grant, T0, &mut store).unwrap();
        for i in 1..=3 {
            assert_eq!(
                denied(&limiter, &mut store, T0 + i * MS),
                None,
                "{algorithm}"
            );
        }
        let (_, wait) = denied(&limiter, &mut store, T0 + 10 * MS).expect("the lease is spent");
        assert_eq!(
            wait,
            token_ms * MS - 10 * MS,
            "{algorithm}: when the window admits"
        );
        // The window has room others hold: one request's time (3,600 s / 20).
        let mut store = MemoryStore::default();
        let roomy = Lease {
            remaining: 10,
            ..grant
        };
        apply_lease(&limiter, RuleId::new(0), KEY, &roomy, T0, &mut store).unwrap();
        for i in 1..=3 {
            assert_eq!(
                denied(&limiter, &mut store, T0 + i * MS),
                None,
                "{algorithm}"
            );
        }
        let (_, wait) = denied(&limiter, &mut store, T0 + 10 * MS).unwrap();
        assert_eq!(
            wait,
            180 * SECOND,
            "{algorithm}: the lease is short, not the window"
        );
    }
}

/// The service controls `token_ms` (and a corrupt Redis hash the counts it comes from): an
/// absurd one for a window makes no request wait longer than the window's count can weigh, two
/// of its periods, and no arithmetic overflows; one that says "now" leaves the lease short.
#[test]
fn a_cached_window_wait_from_any_token_ms_is_bounded() {
    let limiter = limiter(&json!({
        "service": {"cluster": "svc", "token": "t"},
        "rules": [{"name": "shared", "key": ["const:all"], "consistency": "cached",
            "limits": [{"requests": 20, "per": "hour", "algorithm": "sliding_window"}]}]
    }));
    for (token_ms, wait) in [
        (u64::MAX, 7_200 * SECOND),
        (u64::MAX / 1_000, 7_200 * SECOND),
        (0, 180 * SECOND),
    ] {
        let mut store = MemoryStore::default();
        let grant = Lease {
            tokens: 0,
            ttl_ms: u64::MAX,
            remaining: 0,
            reset_ms: u64::MAX,
            token_ms: Some(token_ms),
            refused: None,
            penalty_ms: 0,
        };
        apply_lease(&limiter, RuleId::new(0), KEY, &grant, T0, &mut store).unwrap();
        let (_, got) = denied(&limiter, &mut store, T0 + 10 * MS).expect("no lease");
        assert_eq!(got, wait, "token_ms {token_ms}");
    }
}

/// Two rules that both deny: the client is told the longer wait (the second rule's minute, not
/// the first one's second), and the second rule, only asked, is not charged.
#[test]
fn several_denying_rules_answer_the_longest_wait() {
    let limiter = limiter(&json!({"rules": [
        {"name": "fast", "key": ["const:all"], "limits": [{"requests": 1, "per": "second"}]},
        {"name": "slow", "key": ["const:all"], "limits": [{"requests": 1, "per": "minute"}]}
    ]}));
    let mut store = MemoryStore::default();
    assert_eq!(denied(&limiter, &mut store, T0), None);
    let (rule, wait) = denied(&limiter, &mut store, T0 + 100 * MS).unwrap();
    assert_eq!(
        (rule, wait),
        (RuleId::new(1), 60 * SECOND - 100 * MS),
        "the minute's wait, said by the rule that makes it"
    );
    // Only the first rule denies (the second admits): its own wait.
    let limiter = self::limiter(&json!({"rules": [
        {"name": "fast", "key": ["const:all"], "limits": [{"requests": 1, "per": "minute"}]},
        {"name": "slow", "key": ["const:all"], "limits": [{"requests": 2, "per": "minute"}]}
    ]}));
    let mut store = MemoryStore::default();
    assert_eq!(denied(&limiter, &mut store, T0), None);
    for i in 1..=10 {
        let evaluation =
            limiter.decide(&mut PlainRequest::get("/"), up(T0 + i * SECOND), &mut store);
        assert!(
            matches!(evaluation.decision, Decision::Deny { rule, .. } if rule == RuleId::new(0)),
            "{evaluation:?}"
        );
        assert_eq!(
            evaluation.outcomes.to_vec(),
            vec![(RuleId::new(0), Outcome::Denied)],
            "the rules after a denial decide nothing"
        );
    }
    // The second rule was asked ten times and charged for none: its table (read by a limiter of
    // it alone) still holds the token the first request left, and a third of another.
    let only_slow = self::limiter(&json!({"rules": [
        {"name": "slow", "key": ["const:all"], "limits": [{"requests": 2, "per": "minute"}]}
    ]}));
    assert_eq!(denied(&only_slow, &mut store, T0 + 11 * SECOND), None);
    assert!(denied(&only_slow, &mut store, T0 + 12 * SECOND).is_some());
}

fn blocked_limiter(expires_ms: Option<u64>) -> Limiter {
    let configured = sluice_core::parse(
        br#"{"rules": [{"name": "api", "key": ["header:x-user"], "limits": [{"requests": 100, "per": "second"}]},
                       {"name": "later", "key": ["header:x-user"], "limits": [{"requests": 100, "per": "second"}]}]}"#,
    )
    .unwrap();
    let live = LiveOverrides {
        version: 1,
        keys: [(
            "api".to_string(),
            [("eve".to_string(), KeyAction::Block)].into(),
        )]
        .into(),
        expires: expires_ms
            .map(|at| [("api".to_string(), [("eve".to_string(), at)].into())].into())
            .unwrap_or_default(),
        ..Default::default()
    };
    let (policy, problems) = sluice_core::overrides::apply(&configured, &live);
    assert!(problems.is_empty(), "{problems:?}");
    Limiter::with_overrides(policy, &configured, [1, 2])
}

fn blocked_wait(limiter: &Limiter, now_us: u64) -> u64 {
    let mut store = MemoryStore::default();
    let mut request = PlainRequest::get("/").with_header("x-user", "eve");
    match limiter
        .decide(&mut request, up(now_us), &mut store)
        .decision
    {
        Decision::Deny { retry_after_us, .. } => retry_after_us,
        other => panic!("{other:?}"),
    }
}

/// A key blocked with a ttl waits for the time its block has left (the header rounds it up);
/// without a ttl, the documented default. Whatever the expiry a sync answer carries (the service
/// controls it), the wait is bounded: a block past its end says 1 s (the next sync lifts it), one
/// absurdly far says at most 366 days.
#[test]
fn a_blocked_key_waits_for_its_block_to_end() {
    let expires_ms = T0 / MS + 90_500;
    let limiter = blocked_limiter(Some(expires_ms));
    assert_eq!(blocked_wait(&limiter, T0), 90_500 * MS);
    assert_eq!(retry_after_seconds(blocked_wait(&limiter, T0)), 91);
    assert_eq!(blocked_wait(&limiter, T0 + 90 * SECOND), 500 * MS);
    assert_eq!(
        retry_after_seconds(blocked_wait(&limiter, T0 + 100 * SECOND)),
        1,
        "past its end, not lifted yet"
    );
    assert_eq!(blocked_wait(&blocked_limiter(None), T0), BLOCKED_RETRY_US);
    assert_eq!(
        blocked_wait(&blocked_limiter(Some(u64::MAX)), T0),
        MAX_BLOCKED_RETRY_US
    );
}

/// A rule's limits in the property tests (a rule's limits share one algorithm): their JSON.
fn limits() -> impl Strategy<Value = Value> {
    let per = prop_oneof![Just("second"), Just("minute")];
    let limit = (1..6u64, 0..4u64, per);
    (0..6u8, prop::collection::vec(limit, 1..3)).prop_map(|(algorithm, limits)| {
        let limits: Vec<Value> = limits
            .into_iter()
            .map(|(requests, extra, per)| match algorithm {
                0 => json!({"requests": requests, "per": per, "burst": requests + extra}),
                1 => json!({"requests": requests, "per": per, "burst": requests + extra,
                            "algorithm": "gcra"}),
                2 => json!({"requests": requests, "per": per, "algorithm": "fixed_window"}),
                3 => json!({"requests": requests, "per": per, "algorithm": "sliding_window"}),
                4 => json!({"requests": requests, "per": per, "algorithm": "sliding_log"}),
                _ => json!({"requests": requests, "per": per, "algorithm": "leaky_bucket",
                            "delay": 0, "queue": 0}),
            })
            .collect();
        Value::Array(limits)
    })
}

fn config() -> Config {
    Config {
        cases: std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|c| c.parse().ok())
            .unwrap_or(256),
        failure_persistence: None,
        ..Config::default()
    }
}

proptest! {
    #![proptest_config(config())]

    /// Local rules, every algorithm, one or several limits, one or several rules: after any
    /// arrivals, a denial at `t` with `Retry-After` `r` is admitted at `t + r` (to the
    /// microsecond) and at `t + r` rounded up to the second as sent, and denied a millisecond before `t + r` (every local
    /// algorithm answers its exact wait).
    #[test]
    fn a_local_denial_is_admitted_when_its_retry_after_says(
        rules in prop::collection::vec(limits(), 1..3),
        gaps in prop::collection::vec(0..400_000u64, 1..40),
    ) {
        let rules: Vec<Value> = rules
            .iter()
            .enumerate()
            .map(|(i, limits)| json!({"name": format!("r{i}"), "key": ["const:all"], "limits": limits}))
            .collect();
        let config = json!({"rules": rules});
        let Ok(policy) = sluice_core::parse(config.to_string().as_bytes()) else {
            return Err(TestCaseError::reject("a configuration the limiter refuses"));
        };
        let limiter = Limiter::new(policy);
        let mut store = MemoryStore::default();
        let mut now = T0;
        for gap in gaps {
            now += gap;
            let Some((_, wait)) = denied(&limiter, &mut store, now) else {
                continue;
            };
            prop_assert!(wait > 0, "{config} at {now}");
            let at = |when: u64| denied(&limiter.clone(), &mut store.clone(), when);
            // (a microsecond more: a bucket's refill in floating point may fall short of a
            // whole token by a rounding at exactly `t + r`)
            prop_assert_eq!(at(now + wait + 1), None, "{} at {} + {}", config, now, wait);
            let sent = retry_after_seconds(wait) * SECOND;
            prop_assert_eq!(at(now + sent), None, "{} at {} + {} s", config, now, sent);
            if wait > MS {
                prop_assert!(
                    at(now + wait - MS).is_some(),
                    "{} at {}: admitted a millisecond before {}", config, now, wait
                );
            }
            return Ok(());
        }
    }

    /// A cached rule of token buckets and GCRA limits, one or several, on a lease the service
    /// sized from a global state it describes (each limit's tokens, some in debt): a request
    /// denied on the spent lease waits until the global state, as the service described it and
    /// less what this proxy spent since, holds its cost in every limit; while the service's count
    /// says the state is short of a token, no more than the service's millisecond later than
    /// that. (Once that time has passed, the lease is what is short: the wait is a token's time
    /// of the slowest limit for each token short, the next sync may bring one.)
    #[test]
    fn a_cached_denial_waits_until_the_global_state_holds_its_cost(
        limits in prop::collection::vec((1..2_000u64, 0..3u8, 0..50u64, -1_000i64..1_000), 1..4),
        lease_share in 0.0..1.0f64,
        cost in 1..3u64,
        step_us in 1..20_000u64,
    ) {
        let per = ["second", "minute", "hour"];
        let period_us = [SECOND, 60 * SECOND, 3_600 * SECOND];
        let specs: Vec<Value> = limits
            .iter()
            .map(|&(requests, p, extra, _)| {
                json!({"requests": requests, "per": per[p as usize], "burst": requests + extra})
            })
            .collect();
        let config = json!({
            "service": {"cluster": "svc", "token": "t"},
            "rules": [{"name": "shared", "key": ["const:all"], "consistency": "cached",
                       "cost": cost, "limits": specs}]
        });
        let Ok(policy) = sluice_core::parse(config.to_string().as_bytes()) else {
            return Err(TestCaseError::reject("a configuration the limiter refuses"));
        };
        let limiter = Limiter::new(policy);
        // The global state the service describes: per limit, its tokens (tenths, some in debt),
        // its token time in microseconds, its burst.
        let state: Vec<(f64, f64, f64)> = limits
            .iter()
            .map(|&(requests, p, extra, tenths)| {
                let burst = (requests + extra) as f64;
                let tokens = (tenths as f64 / 10.0).min(burst);
                let token_us = (period_us[p as usize] / requests) as f64;
                (tokens, token_us, burst)
            })
            .collect();
        let fewest = state.iter().map(|s| s.0).fold(f64::MAX, f64::min);
        let remaining = fewest.max(0.0).floor() as u64;
        let ms = |tokens: f64, token_us: f64| ((tokens * token_us) / 1_000.0).ceil().max(0.0) as u64;
        let grant = Lease {
            tokens: (remaining as f64 * lease_share).floor() as u64,
            ttl_ms: 3_600_000,
            remaining,
            reset_ms: state.iter().map(|&(t, u, b)| ms(b - t, u)).max().unwrap_or(0),
            token_ms: Some(
                state
                    .iter()
                    .map(|&(t, u, _)| ms(remaining as f64 + 1.0 - t, u))
                    .max()
                    .unwrap_or(0),
            ),
            refused: None,
            penalty_ms: 0,
        };
        let mut store = MemoryStore::default();
        apply_lease(&limiter, RuleId::new(0), KEY, &grant, T0, &mut store).unwrap();
        let mut now = T0;
        let mut spent = 0u64;
        let wait = loop {
            now += step_us;
            match denied(&limiter, &mut store, now) {
                None => spent += cost,
                Some((_, wait)) => break wait,
            }
            prop_assert!(spent <= grant.tokens, "spent more than the lease");
        };
        let short = remaining < spent + cost;
        if !short {
            // Others hold the global tokens: one token's time of the first limit.
            prop_assert_eq!(wait, state[0].1 as u64);
            return Ok(());
        }
        let held = |at: u64, i: usize| {
            let (tokens, token_us, _) = state[i];
            tokens - spent as f64 + (at - T0) as f64 / token_us
        };
        for i in 0..state.len() {
            prop_assert!(
                held(now + wait, i) >= cost as f64 - 1e-6,
                "{}: limit {} holds {} at the retry time", config, i, held(now + wait, i)
            );
        }
        let token_at = T0 + grant.token_ms.unwrap_or(0) * MS;
        if spent == remaining && cost == 1 && now < token_at && wait > 2 * MS {
            let early = now + wait - 2 * MS;
            prop_assert!(
                (0..state.len()).any(|i| held(early, i) < 1.0),
                "{}: every limit held its next token 2 ms before the retry time", config
            );
        }
    }
}
