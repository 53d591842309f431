//! Time-based scenarios for the limiter, on a fake clock and an in-memory store.

use sluice_core::limiter::Conditions;
use sluice_core::policy::RuleId;
use sluice_core::{Decision, Limiter, MemoryStore, Outcome, PlainRequest};

const SECOND: u64 = 1_000_000;
const T0: u64 = 1_700_000_000 * SECOND;

fn limiter(json: &str) -> Limiter {
    Limiter::new(sluice_core::parse(json.as_bytes()).unwrap())
}

fn at(now_us: u64) -> Conditions {
    Conditions {
        now_us,
        service_up: true,
        service_back_us: 0,
        load: Default::default(),
    }
}

fn allowed(d: &Decision) -> bool {
    matches!(d, Decision::Allow { .. })
}

const PER_IP: &str = r#"{"rules": [{"name": "per-ip", "match": {"path_prefix": "/api/"},
    "key": ["client_ip"], "limits": [{"requests": 60, "per": "minute", "burst": 5}]}]}"#;

#[test]
fn burst_then_one_per_second() {
    let limiter = limiter(PER_IP);
    let mut store = MemoryStore::default();
    let mut req = PlainRequest::get("/api/a").from_ip("10.0.0.1");
    for i in 0..5 {
        let e = limiter.decide(&mut req, at(T0), &mut store);
        assert!(allowed(&e.decision), "request {i} at T0");
    }
    let denied = limiter.decide(&mut req, at(T0), &mut store);
    let Decision::Deny {
        rule,
        quota,
        retry_after_us,
    } = denied.decision
    else {
        panic!("6th request at T0 admitted: {denied:?}");
    };
    assert_eq!(rule, RuleId::new(0));
    assert_eq!(quota.remaining, 0);
    assert_eq!(retry_after_us, SECOND, "one token a second");
    assert_eq!(denied.outcomes[..], [(RuleId::new(0), Outcome::Denied)]);

    let now = T0 + SECOND;
    assert!(
        allowed(&limiter.decide(&mut req, at(now), &mut store).decision),
        "at T0+1s"
    );
    assert!(
        !allowed(&limiter.decide(&mut req, at(now), &mut store).decision),
        "at T0+1s again"
    );
}

#[test]
fn keys_are_separate_and_other_paths_are_not_limited() {
    let limiter = limiter(PER_IP);
    let mut store = MemoryStore::default();
    for _ in 0..5 {
        limiter.decide(
            &mut PlainRequest::get("/api/a").from_ip("10.0.0.1"),
            at(T0),
            &mut store,
        );
    }
    let other_ip = limiter.decide(
        &mut PlainRequest::get("/api/a").from_ip("10.0.0.2"),
        at(T0),
        &mut store,
    );
    assert!(allowed(&other_ip.decision));
    let other_path = limiter.decide(
        &mut PlainRequest::get("/static").from_ip("10.0.0.1"),
        at(T0),
        &mut store,
    );
    assert_eq!(other_path.decision, Decision::Allow { quota: None });
    assert!(other_path.outcomes.is_empty());
}

#[test]
fn every_limit_of_a_rule_is_enforced() {
    let limiter = limiter(
        r#"{"rules": [{"name": "tiered", "key": ["header:x-api-key"],
        "limits": [{"requests": 2, "per": "second"}, {"requests": 5, "per": "hour"}]}]}"#,
    );
    let mut store = MemoryStore::default();
    let mut admitted = 0;
    // 2 a second would allow 20 over 10 s; the hourly 5 stops it at 5.
    for s in 0..10 {
        for _ in 0..3 {
            let mut req = PlainRequest::get("/").with_header("x-api-key", "k1");
            admitted += allowed(
                &limiter
                    .decide(&mut req, at(T0 + s * SECOND), &mut store)
                    .decision,
            ) as u32;
        }
    }
    assert_eq!(admitted, 5);
}

#[test]
fn a_request_without_the_key_header_is_counted_in_the_missing_bucket_or_skipped() {
    let counted = limiter(
        r#"{"rules": [{"name": "per-key", "key": ["header:x-api-key"],
        "limits": [{"requests": 1, "per": "hour"}]}]}"#,
    );
    let mut store = MemoryStore::default();
    let decisions: Vec<bool> = (0..3)
        .map(|_| {
            allowed(
                &counted
                    .decide(&mut PlainRequest::get("/"), at(T0), &mut store)
                    .decision,
            )
        })
        .collect();
    assert_eq!(
        decisions,
        [true, false, false],
        "one bucket for every request without a key"
    );
    let skipped = limiter(
        r#"{"rules": [{"name": "per-key", "key": ["header:x-api-key"], "when_missing": "skip",
        "limits": [{"requests": 1, "per": "hour"}]}]}"#,
    );
    let mut store = MemoryStore::default();
    for _ in 0..3 {
        let e = skipped.decide(&mut PlainRequest::get("/"), at(T0), &mut store);
        assert_eq!(e.decision, Decision::Allow { quota: None });
    }
    assert!(store.is_empty(), "nothing stored for skipped requests");
}

#[test]
fn tokens_are_spent_only_when_every_rule_allows() {
    // "wide" has plenty; "narrow" allows 1. Denied requests must not drain "wide".
    let both = limiter(
        r#"{"headers": "both", "rules": [
        {"name": "wide", "key": ["client_ip"], "limits": [{"requests": 3, "per": "hour"}]},
        {"name": "narrow", "key": ["client_ip"], "limits": [{"requests": 1, "per": "hour"}]}]}"#,
    );
    let mut store = MemoryStore::default();
    let mut req = PlainRequest::get("/").from_ip("10.0.0.1");
    let first = both.decide(&mut req, at(T0), &mut store);
    let Decision::Allow {
        quota: Some((rule, quota)),
    } = first.decision
    else {
        panic!("{first:?}");
    };
    assert_eq!(
        (rule, quota.remaining),
        (RuleId::new(1), 0),
        "the tightest rule sets the headers"
    );
    for _ in 0..10 {
        let e = both.decide(&mut req, at(T0), &mut store);
        assert!(
            matches!(e.decision, Decision::Deny { rule, .. } if rule == RuleId::new(1)),
            "{e:?}"
        );
    }
    // A request that only "wide" counts (other client, narrow untouched) shows wide's tokens.
    let wide_only = self::limiter(
        r#"{"rules": [{"name": "wide", "key": ["client_ip"], "limits": [{"requests": 3, "per": "hour"}]}]}"#,
    );
    let e = wide_only.decide(&mut req, at(T0), &mut store);
    let Decision::Allow {
        quota: Some((_, quota)),
    } = e.decision
    else {
        panic!("{e:?}");
    };
    assert_eq!(
        quota.remaining, 1,
        "wide spent 1 for the admitted request and 1 now: refunds worked"
    );
}

#[test]
fn shadow_rules_count_but_never_deny() {
    let limiter = limiter(
        r#"{"rules": [{"name": "trial", "key": ["const:all"], "mode": "shadow",
        "limits": [{"requests": 2, "per": "minute"}]}]}"#,
    );
    let mut store = MemoryStore::default();
    let outcomes: Vec<_> = (0..4)
        .map(|_| {
            let e = limiter.decide(&mut PlainRequest::get("/"), at(T0), &mut store);
            assert!(allowed(&e.decision));
            e.outcomes[0].1
        })
        .collect();
    assert_eq!(
        outcomes,
        vec![
            Outcome::Allowed,
            Outcome::Allowed,
            Outcome::ShadowDenied,
            Outcome::ShadowDenied
        ]
    );
}

#[test]
fn bypass_by_path_cidr_and_switch() {
    let limiter = limiter(
        r#"{"bypass": {"paths": ["/healthz"], "cidrs": ["10.9.0.0/16"]},
        "rules": [{"name": "a", "key": ["client_ip"], "limits": [{"requests": 1, "per": "hour"}]}]}"#,
    );
    assert!(limiter.bypassed("/healthz", None));
    assert!(!limiter.bypassed("/healthz/x", None));
    assert!(limiter.bypassed("/x", Some("10.9.3.4".parse().unwrap())));
    assert!(!limiter.bypassed("/x", Some("10.8.3.4".parse().unwrap())));
}

#[test]
fn a_flood_of_unique_keys_stays_within_max_keys() {
    let limiter = limiter(
        r#"{"max_keys": 1024, "rules": [{"name": "per-ip", "key": ["client_ip"],
        "limits": [{"requests": 10, "per": "minute"}]}]}"#,
    );
    let mut store = MemoryStore::default();
    for i in 0..50_000u32 {
        let ip = std::net::Ipv4Addr::from(0x0a00_0000 + i).to_string();
        limiter.decide(
            &mut PlainRequest::get("/").from_ip(&ip),
            at(T0 + i as u64),
            &mut store,
        );
    }
    let set = sluice_core::limit::table::set_len(1, 0);
    let sets = 1024 / sluice_core::limit::table::WAYS;
    assert!(store.len() <= sets, "{} sets", store.len());
    let payload: usize = store.bytes();
    assert!(
        payload <= sets * (set + 40),
        "{payload} bytes for {sets} sets of {set} bytes (1024 keys)"
    );
    // The most recent keys are remembered: the last IP is limited exactly.
    let last = std::net::Ipv4Addr::from(0x0a00_0000 + 49_999u32).to_string();
    let mut req = PlainRequest::get("/").from_ip(&last);
    let mut admitted = 1; // it was admitted once in the flood
    for _ in 0..20 {
        admitted += allowed(
            &limiter
                .decide(&mut req, at(T0 + 50_000), &mut store)
                .decision,
        ) as u32;
    }
    assert_eq!(admitted, 10);
}

/// A worker remembers a local denial until a request could be admitted: the same decisions
/// and answers as reading the key table every time, with fewer reads.
#[test]
fn remembered_denials_answer_exactly_as_the_table_would() {
    for limit in [
        r#"{"requests": 5, "per": "second", "burst": 3}"#,
        r#"{"requests": 4, "per": "second", "algorithm": "gcra"}"#,
        r#"{"requests": 3, "per": "second", "algorithm": "fixed_window"}"#,
        r#"{"requests": 3, "per": "second", "algorithm": "sliding_window"}"#,
        r#"{"requests": 3, "per": "second", "algorithm": "sliding_log"}"#,
        r#"{"requests": 30, "per": "minute", "burst": 4}"#,
        r#"{"requests": 20, "per": "minute", "algorithm": "fixed_window"}"#,
    ] {
        let json = format!(
            r#"{{"rules": [{{"name": "r", "key": ["header:x-user"], "limits": [{limit}]}}]}}"#
        );
        let policy = sluice_core::parse(json.as_bytes()).unwrap();
        let remembering = sluice_core::Limiter::new(policy.clone());
        let mut store = sluice_core::MemoryStore::default();
        let mut reference_store = sluice_core::MemoryStore::default();
        let mut now = 1_795_996_800_000_000u64;
        let mut seed = 0x5eed_u64;
        for _ in 0..3_000 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            now += (seed >> 33) % 120_000;
            let user = ["a", "b"][(seed >> 20) as usize % 2];
            let conditions = sluice_core::Conditions {
                now_us: now,
                service_up: true,
                service_back_us: 0,
                load: Default::default(),
            };
            let mut request = PlainRequest::get("/").with_header("x-user", user);
            let got = remembering.decide(&mut request, conditions, &mut store);
            // The reference reads the table every time: a fresh limiter remembers nothing.
            let fresh = sluice_core::Limiter::new(policy.clone());
            let mut request = PlainRequest::get("/").with_header("x-user", user);
            let want = fresh.decide(&mut request, conditions, &mut reference_store);
            // The same decision, and the same answer to the microsecond's rounding.
            match (&got.decision, &want.decision) {
                (
                    sluice_core::Decision::Deny {
                        quota: a,
                        retry_after_us: ra,
                        ..
                    },
                    sluice_core::Decision::Deny {
                        quota: b,
                        retry_after_us: rb,
                        ..
                    },
                ) => {
                    assert!(ra.abs_diff(*rb) <= 1, "{limit} at {now}: {ra} vs {rb}");
                    assert!(a.reset_us.abs_diff(b.reset_us) <= 1, "{limit} at {now}");
                    assert_eq!((a.limit, a.remaining), (b.limit, b.remaining));
                }
                (g, w) => assert_eq!(g, w, "{limit} at {now}"),
            }
        }
    }
}

/// The configured policy and `overrides` (target, limits) applied to it, as the filter builds a worker's limiter.
fn overridden(
    configured: &sluice_core::Policy,
    overrides: &[(&str, serde_json::Value)],
) -> Limiter {
    let live = sluice_core::protocol::LiveOverrides {
        version: 1,
        limits: overrides
            .iter()
            .map(|(target, limits)| {
                let limits = limits.as_array().cloned().unwrap_or_default();
                (target.to_string(), limits)
            })
            .collect(),
        ..Default::default()
    };
    let (policy, problems) = sluice_core::overrides::apply(configured, &live);
    assert!(problems.is_empty(), "{problems:?}");
    Limiter::with_overrides(policy, configured, [3, 4])
}

/// Live overrides invite automation: whatever their sequence, a rule's keys stay in at most two tables (its
/// configured layout's, and one for every layout an override gave it), so the store's keys (shared data, which
/// proxy-wasm cannot delete) stay bounded. Each new limit used to make a table of its own: 300 overrides, 300 tables.
#[test]
fn any_sequence_of_overrides_keeps_a_rule_in_two_tables() {
    use serde_json::json;
    let configured = sluice_core::parse(
        br#"{"max_keys": 64, "rules": [
            {"name": "api", "key": ["client_ip"], "limits": [{"requests": 10, "per": "minute"}]},
            {"name": "plans", "key": ["client_ip"], "tiers": {"from": "header:x-plan", "default": "free",
                "limits": {"free": [{"requests": 5, "per": "minute"}], "pro": [{"requests": 50, "per": "minute"}]}}}]}"#,
    )
    .unwrap();
    let sets = 64 / sluice_core::limit::table::WAYS;
    let mut store = MemoryStore::default();
    let mut prefixes = std::collections::BTreeSet::new();
    let mut send = |limiter: &Limiter, round: u32| {
        for i in 0..40u32 {
            let ip = std::net::Ipv4Addr::from(0x0a00_0000 + round * 40 + i).to_string();
            let plan = if i % 2 == 0 { "free" } else { "pro" };
            let mut request = PlainRequest::get("/")
                .from_ip(&ip)
                .with_header("x-plan", plan);
            limiter.decide(&mut request, at(T0 + u64::from(round) * SECOND), &mut store);
        }
    };
    for round in 0..300u32 {
        let n = u64::from(round) + 1;
        // New numbers, then algorithms, sliding logs of every length, two limits, back to the configured layout.
        let limits = match round % 6 {
            0 | 1 => json!([{"requests": n, "per": "minute"}]),
            2 => json!([{"requests": n, "per": "second", "algorithm": "gcra"}]),
            3 => json!([{"requests": n % 900 + 1, "per": "hour", "algorithm": "sliding_log"}]),
            4 => json!([{"requests": n, "per": "minute"}, {"requests": n * 10, "per": "day"}]),
            _ => json!([{"requests": n, "per": "minute", "algorithm": "sliding_window"}]),
        };
        let limiter = overridden(
            &configured,
            &[("api", limits.clone()), ("plans/pro", limits)],
        );
        for rule in limiter.rules() {
            prefixes.insert((rule.rule.name.clone(), rule.table.prefix().to_owned()));
        }
        send(&limiter, round);
    }
    for rule in ["api", "plans/free", "plans/pro"] {
        let tables = prefixes.iter().filter(|(r, _)| r == rule).count();
        let most = if rule == "plans/free" { 1 } else { 2 };
        assert_eq!(tables, most, "{rule}: {prefixes:?}");
    }
    assert!(store.len() <= 5 * sets, "{} sets in the store", store.len());
}

/// An override of a rule's numbers keeps its table and the counts in it, read by the new limits: a key that spent
/// its tokens stays denied when the limit is raised (refilling at the new rate), and a bucket never holds more
/// than the new burst when it is lowered. Each new limit used to start every key afresh: a lowered limit handed an
/// abusive key a full new burst.
#[test]
fn new_numbers_carry_a_keys_counts() {
    use serde_json::json;
    let configured = sluice_core::parse(
        br#"{"rules": [{"name": "api", "key": ["client_ip"], "limits": [{"requests": 10, "per": "minute"}]}]}"#,
    )
    .unwrap();
    let mut store = MemoryStore::default();
    let admitted = |limiter: &Limiter, ip: &str, n: usize, store: &mut MemoryStore| {
        let mut request = PlainRequest::get("/").from_ip(ip);
        (0..n)
            .filter(|_| allowed(&limiter.decide(&mut request, at(T0), store).decision))
            .count()
    };
    let configured_limiter = Limiter::with_overrides(configured.clone(), &configured, [3, 4]);
    assert_eq!(
        admitted(&configured_limiter, "192.0.2.1", 11, &mut store),
        10
    );
    assert_eq!(admitted(&configured_limiter, "192.0.2.2", 2, &mut store), 2);
    let raised = overridden(
        &configured,
        &[("api", json!([{"requests": 100, "per": "minute"}]))],
    );
    assert_eq!(
        raised.table(RuleId::new(0)),
        configured_limiter.table(RuleId::new(0)),
        "the same table"
    );
    assert_eq!(
        admitted(&raised, "192.0.2.1", 5, &mut store),
        0,
        "its spent tokens stay spent"
    );
    let lowered = overridden(
        &configured,
        &[("api", json!([{"requests": 3, "per": "minute"}]))],
    );
    assert_eq!(
        admitted(&lowered, "192.0.2.2", 10, &mut store),
        3,
        "8 left, at most 3 now"
    );
    // Another algorithm reads the state otherwise: the rule's table for overridden layouts, keys afresh.
    let gcra = overridden(
        &configured,
        &[(
            "api",
            json!([{"requests": 4, "per": "minute", "algorithm": "gcra"}]),
        )],
    );
    assert_ne!(
        gcra.table(RuleId::new(0)),
        configured_limiter.table(RuleId::new(0))
    );
    assert_eq!(admitted(&gcra, "192.0.2.1", 10, &mut store), 4);
    // Back to the configured layout: its table, with what it held.
    assert_eq!(admitted(&configured_limiter, "192.0.2.1", 5, &mut store), 0);
}

/// One tick period per worker, the finest any part needs: nginx arms a tick once.
#[test]
fn the_tick_is_the_finest_any_part_needs() {
    let tick = |json: &str| {
        let policy = sluice_core::parse(json.as_bytes()).unwrap();
        sluice_core::Limiter::new(policy).tick_ms()
    };
    let local = r#"{"rules": [{"name": "r", "key": ["client_ip"], "limits": [{"requests": 1, "per": "second"}]}]}"#;
    assert_eq!(tick(local), 1_000);
    let synced = r#"{"host": "nginx", "service": {"address": "127.0.0.1:8081", "sync_interval_ms": 200},
        "rules": [{"name": "r", "key": ["client_ip"], "limits": [{"requests": 1, "per": "second"}]}]}"#;
    assert_eq!(tick(synced), 20);
    let shaped = r#"{"service": {"cluster": "c"}, "rules": [{"name": "r", "key": ["client_ip"], "consistency": "local",
        "limits": [{"requests": 10, "per": "second", "algorithm": "leaky_bucket"}]}]}"#;
    assert_eq!(tick(shaped), sluice_core::limiter::FINE_TICK_MS);
}
