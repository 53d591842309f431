//! Per-customer limits: one key's own limits set by an operator (a live override that travels
//! to the proxies beside the rules' limits), and a rule's limit read from the request's identity
//! (`limits_from`), bounded.

use serde_json::json;
use sluice_core::exchange::{Effect, Exchange, Moment, Step};
use sluice_core::overrides::{self, key_limits_target, MAX_KEY_LIMITS};
use sluice_core::policy::RuleId;
use sluice_core::protocol::{KeyAction, LiveOverrides};
use sluice_core::{Limiter, MemoryStore, PlainRequest, Policy};

const T0: u64 = 1_795_996_800_000_000;

fn parse(json: &str) -> Policy {
    sluice_core::parse(json.as_bytes()).unwrap_or_else(|e| panic!("{e}: {json}"))
}

/// Admitted of `n` requests made by `make` at one moment.
fn admitted(
    limiter: &Limiter,
    store: &mut MemoryStore,
    n: usize,
    make: impl Fn() -> PlainRequest,
) -> usize {
    (0..n)
        .filter(|_| {
            let mut request = make();
            let (_, step, _) = Exchange::start(limiter, &mut request, None, Moment::at(T0), store);
            step == Step::Continue
        })
        .count()
}

fn customer(id: &str) -> PlainRequest {
    PlainRequest::get("/").with_header("x-customer", id)
}

/// `limits` for each `(rule, key parts)` as the service sends them.
fn key_limits(entries: &[(&str, &[&str], serde_json::Value)]) -> LiveOverrides {
    let limits = entries
        .iter()
        .map(|(rule, parts, limits)| {
            let parts: Vec<String> = parts.iter().map(|p| p.to_string()).collect();
            let serde_json::Value::Array(limits) = limits.clone() else {
                panic!("limits is a list")
            };
            (key_limits_target(rule, &parts), limits)
        })
        .collect();
    LiveOverrides {
        version: 1,
        limits,
        ..Default::default()
    }
}

/// `limits` (a JSON list) in place of rule `rule`'s own, as the service sends a rule override.
fn rule_limits(rule: &str, limits: serde_json::Value) -> LiveOverrides {
    let serde_json::Value::Array(limits) = limits else {
        panic!("limits is a list")
    };
    LiveOverrides {
        version: 1,
        limits: [(rule.to_string(), limits)].into(),
        ..Default::default()
    }
}

fn overridden(configured: &Policy, live: &LiveOverrides) -> (Limiter, Vec<String>) {
    let (applied, problems) = overrides::apply(configured, live);
    let limiter = Limiter::with_overrides(applied, configured, [7, 9]);
    (limiter, problems)
}

#[test]
fn a_key_with_limits_of_its_own_counts_with_them_and_the_others_with_the_rules() {
    let configured = parse(
        r#"{"rules": [
            {"name": "api", "key": ["header:x-customer"], "limits": [{"requests": 2, "per": "minute"}]},
            {"name": "plans", "key": ["header:x-customer"], "tiers": {"from": "header:x-plan", "default": "free",
                "limits": {"free": [{"requests": 3, "per": "hour"}], "pro": [{"requests": 30, "per": "hour"}]}}}]}"#,
    );
    let live = key_limits(&[
        ("api", &["42"], json!([{"requests": 5, "per": "minute"}])),
        ("plans", &["42"], json!([{"requests": 100, "per": "hour"}])),
    ]);
    let (limiter, problems) = overridden(&configured, &live);
    assert!(problems.is_empty(), "{problems:?}");
    let mut store = MemoryStore::default();
    // Rule "plans" (every tier) lets 42 through 100 times: "api" decides.
    assert_eq!(admitted(&limiter, &mut store, 8, || customer("42")), 5);
    assert_eq!(admitted(&limiter, &mut store, 8, || customer("43")), 2);
    // A tier counts the key with its own limits too.
    let only_plans = parse(
        r#"{"rules": [{"name": "plans", "key": ["header:x-customer"], "tiers": {"from": "header:x-plan", "default": "free",
            "limits": {"free": [{"requests": 3, "per": "hour"}], "pro": [{"requests": 30, "per": "hour"}]}}}]}"#,
    );
    let (limiter, problems) = overridden(&only_plans, &live);
    assert_eq!(problems.len(), 1, "rule api is not there: {problems:?}");
    let pro = |id: &'static str| move || customer(id).with_header("x-plan", "pro");
    assert_eq!(admitted(&limiter, &mut store, 120, pro("42")), 100);
    assert_eq!(admitted(&limiter, &mut store, 40, pro("44")), 30);
    assert_eq!(admitted(&limiter, &mut store, 5, || customer("45")), 3);
    // Without the override, 42 is a key like any other.
    let (limiter, _) = overridden(&configured, &LiveOverrides::default());
    let mut store = MemoryStore::default();
    assert_eq!(admitted(&limiter, &mut store, 8, || customer("42")), 2);
}

/// Cached and strict rules: the service counts a key with the limits the proxy sends for it,
/// so the key's own limits travel in its sync entries and checks.
#[test]
fn the_service_is_sent_a_keys_own_limits() {
    let configured = parse(
        r#"{"service": {"cluster": "svc"}, "rules": [
            {"name": "shared", "key": ["header:x-customer"], "consistency": "cached",
             "limits": [{"requests": 10, "per": "minute"}]},
            {"name": "exact", "key": ["header:x-customer"], "consistency": "strict",
             "limits": [{"requests": 10, "per": "second"}]}]}"#,
    );
    let live = key_limits(&[
        (
            "shared",
            &["42"],
            json!([{"requests": 5000, "per": "minute"}]),
        ),
        ("exact", &["42"], json!([{"requests": 70, "per": "second"}])),
    ]);
    let (limiter, problems) = overridden(&configured, &live);
    assert!(problems.is_empty(), "{problems:?}");
    let mut store = MemoryStore::default();
    let sent = |id: &str, store: &mut MemoryStore| {
        let mut request = customer(id);
        let (_, step, effects) =
            Exchange::start(&limiter, &mut request, None, Moment::at(T0), store);
        assert_eq!(step, Step::Wait);
        let checked = effects.iter().find_map(|e| match e {
            Effect::Check { request, .. } => Some(request.limits[0].requests),
            _ => None,
        });
        let key = format!("shared\u{1f}{id}");
        let entry = sluice_core::sync::proxy::snapshot(&limiter, RuleId::new(0), &key, store);
        (checked, entry.map(|e| e.limits[0].requests))
    };
    assert_eq!(sent("42", &mut store), (Some(70), Some(5000)));
    assert_eq!(sent("43", &mut store), (Some(10), Some(10)));
}

#[test]
fn a_keys_limits_pass_every_check_of_the_configuration_and_keep_the_rules_form() {
    let configured = parse(
        r#"{"service": {"cluster": "svc"}, "rules": [
            {"name": "api", "key": ["header:x-customer"], "consistency": "local", "cost": 3,
             "limits": [{"requests": 10, "per": "minute"}]},
            {"name": "shared", "key": ["header:x-customer"], "limits": [{"requests": 10, "per": "minute"}]},
            {"name": "users", "key": ["jwt:sub|client_ip"], "consistency": "local",
             "limits": [{"requests": 10, "per": "minute"}]}]}"#,
    );
    let cases: [(&str, &[&str], serde_json::Value, &str); 7] = [
        (
            "api",
            &["42"],
            json!([{"requests": 2, "per": "second"}]),
            "keys.api \"42\": limits[0]: 3 is more than keys.api \"42\": limits ever admits at once (2): no request could pass",
        ),
        (
            "api",
            &["42"],
            json!([{"requests": 2, "per": "fortnight"}]),
            "keys.api \"42\": limits[0].per:",
        ),
        (
            "api",
            &["42"],
            json!([{"requests": 20, "per": "minute"}, {"requests": 100, "per": "hour"}]),
            "keys.api \"42\": limits: a key's own limits count in its rule's table, so they keep the form of \"api\"'s: 1 limit(s), [token_bucket]",
        ),
        (
            "api",
            &["42"],
            json!([{"requests": 20, "per": "minute", "algorithm": "fixed_window"}]),
            "keys.api \"42\": limits: a key's own limits count in its rule's table",
        ),
        (
            "shared",
            &["42"],
            json!([{"requests": 20, "per": "minute", "algorithm": "sliding_log"}]),
            "keys.shared \"42\": limits[0].algorithm: sliding_log is exact",
        ),
        (
            "users",
            &["alice"],
            json!([{"requests": 20, "per": "minute"}]),
            "key[0]: a key's own limits are one key's: name the alternative",
        ),
        (
            "nope",
            &["42"],
            json!([{"requests": 20, "per": "minute"}]),
            "rule: no rule named \"nope\"",
        ),
    ];
    for (rule, parts, limits, expected) in cases {
        let (limiter, problems) = overridden(&configured, &key_limits(&[(rule, parts, limits)]));
        assert_eq!(problems.len(), 1, "{rule}: {problems:?}");
        assert!(problems[0].starts_with(expected), "{rule}: {problems:?}");
        assert!(limiter.policy().key_limits.is_empty());
    }
    // The alternative named: applied.
    let named = key_limits(&[(
        "users",
        &["jwt:sub=alice"],
        json!([{"requests": 20, "per": "minute"}]),
    )]);
    let (limiter, problems) = overridden(&configured, &named);
    assert!(problems.is_empty(), "{problems:?}");
    let mut store = MemoryStore::default();
    let alice = || PlainRequest::get("/").with_claim("sub", "alice");
    let ip = || PlainRequest::get("/").from_ip("192.0.2.1");
    let (a, b) = (
        admitted(&limiter, &mut store, 30, alice),
        admitted(&limiter, &mut store, 30, ip),
    );
    // Rule "api" and "shared" count the missing header's key too: 3 at a time of 10, 10.
    assert_eq!((a, b), (3, 0), "api's cost of 3 decides first");
}

/// However many the service sends, a proxy applies at most [`MAX_KEY_LIMITS`] keys' limits.
#[test]
fn a_proxy_applies_a_bounded_number_of_keys_limits() {
    let configured = parse(
        r#"{"rules": [{"name": "api", "key": ["header:x-customer"], "limits": [{"requests": 2, "per": "minute"}]}]}"#,
    );
    let limits = json!([{"requests": 5, "per": "minute"}]);
    let ids: Vec<String> = (0..MAX_KEY_LIMITS + 3).map(|i| i.to_string()).collect();
    let entries: Vec<(&str, Vec<&str>, serde_json::Value)> = ids
        .iter()
        .map(|id| ("api", vec![id.as_str()], limits.clone()))
        .collect();
    let entries: Vec<(&str, &[&str], serde_json::Value)> = entries
        .iter()
        .map(|(rule, parts, limits)| (*rule, parts.as_slice(), limits.clone()))
        .collect();
    let (applied, problems) = overrides::apply(&configured, &key_limits(&entries));
    assert_eq!(problems.len(), 3, "{:?}", problems.first());
    assert!(problems[0].ends_with("a proxy applies at most 10000 keys' own limits"));
    assert_eq!(applied.key_limits["api"].len(), MAX_KEY_LIMITS);
}

const FROM_CLAIM: &str = r#"{"rules": [{"name": "api", "key": ["jwt:sub"],
    "limits": [{"requests": 2, "per": "minute"}],
    "limits_from": {"from": "jwt:rate_per_minute", "max": 5}}]}"#;

fn user(sub: &str, rate: Option<&str>) -> PlainRequest {
    let request = PlainRequest::get("/").with_claim("sub", sub);
    match rate {
        Some(rate) => request.with_claim("rate_per_minute", rate),
        None => request,
    }
}

#[test]
fn limits_from_reads_the_identitys_limit_bounded_by_max() {
    let limiter = Limiter::new(parse(FROM_CLAIM));
    let mut store = MemoryStore::default();
    let mut count = |sub: &'static str, rate: Option<&'static str>| {
        admitted(&limiter, &mut store, 10, move || user(sub, rate))
    };
    assert_eq!(count("alice", Some("4")), 4);
    assert_eq!(count("bob", Some("3")), 3);
    // Above max: max.
    assert_eq!(count("carol", Some("1000000")), 5);
    // No claim: the rule's own limit.
    assert_eq!(count("dave", None), 2);
}

/// Who controls the value: a token's issuer (a claim), or whoever can set the header when the
/// filter that should set it does not strip a client's. The worst values never exempt a request
/// and never raise a key above `max`; each key keeps its own count.
#[test]
fn no_value_read_exempts_a_request_or_passes_max() {
    let limiter = Limiter::new(parse(FROM_CLAIM));
    let mut store = MemoryStore::default();
    let hostile = [
        "",
        "-3",
        "NaN",
        "inf",
        "1e3",
        "2.5",
        "0",
        "00",
        " 7",
        "7 ",
        "+4",
        "0x10",
        "٣",
        "4\u{0}",
        "18446744073709551616",
        "99999999999999999999999",
        "-0",
    ];
    for (i, value) in hostile.iter().enumerate() {
        let sub: &'static str = Box::leak(format!("user{i}").into_boxed_str());
        let value: &'static str = value;
        let got = admitted(&limiter, &mut store, 10, move || user(sub, Some(value)));
        assert_eq!(got, 2, "{value:?}: the rule's own limit");
    }
    // 19 digits: a number, bounded.
    let got = admitted(&limiter, &mut store, 10, || {
        user("big", Some("9999999999999999999"))
    });
    assert_eq!(got, 5);
    // A value for one key does not reach another: alice's 5 leave bob his own 2.
    assert_eq!(
        admitted(&limiter, &mut store, 10, || user("alice", Some("5"))),
        5
    );
    assert_eq!(admitted(&limiter, &mut store, 10, || user("bob", None)), 2);

    // A header (a filter before sluice sets it): a forged one is bounded the same way.
    let limiter = Limiter::new(parse(
        r#"{"rules": [{"name": "api", "key": ["header:x-customer"],
            "limits": [{"requests": 2, "per": "minute", "burst": 4}],
            "limits_from": {"from": "header:x-rate-limit", "max": 6}}]}"#,
    ));
    let with = |id: &'static str, rate: &'static str| {
        move || customer(id).with_header("x-rate-limit", rate)
    };
    // The burst keeps its proportion: 2 a minute with 4 at once, so 3 a minute takes 6 at once.
    assert_eq!(admitted(&limiter, &mut store, 20, with("a", "3")), 6);
    // Forged huge: max 6 a minute, 12 at once.
    assert_eq!(
        admitted(&limiter, &mut store, 20, with("b", "2147483648")),
        12
    );
    assert_eq!(admitted(&limiter, &mut store, 20, with("c", "x")), 4);
}

#[test]
fn limits_from_is_refused_where_it_cannot_be_right() {
    let cases = [
        (
            r#""consistency": "cached", "limits": [{"requests": 2, "per": "minute"}], "limits_from": {"from": "jwt:rate", "max": 5}"#,
            "rules[0].limits_from: a cached or strict rule counts a key with one limit on every proxy",
        ),
        (
            r#""limits": [{"requests": 2, "per": "minute"}], "limits_from": {"from": "client_ip", "max": 5}"#,
            "rules[0].limits_from.from: a limit is read from jwt:CLAIM",
        ),
        (
            r#""limits": [{"requests": 2, "per": "minute"}], "limits_from": {"from": "jwt:rate", "max": 0}"#,
            "rules[0].limits_from.max: must be between 1 and 2147483648, got 0",
        ),
        (
            r#""limits": [{"requests": 20, "per": "minute"}], "limits_from": {"from": "jwt:rate", "max": 5}"#,
            "rules[0].limits_from.max: limits_from.max (5) is less than rules[0].limits[0].requests (20)",
        ),
        (
            r#""limits": [{"requests": 2, "per": "minute", "algorithm": "sliding_log"}], "limits_from": {"from": "jwt:rate", "max": 5}"#,
            "rules[0].limits[0].algorithm: limits_from takes a token_bucket, gcra, fixed_window or sliding_window limit",
        ),
        (
            r#""limits": [{"requests": 2, "per": "second"}, {"requests": 20, "per": "hour"}], "limits_from": {"from": "jwt:rate", "max": 5}"#,
            "rules[0].limits[1]: limits_from replaces the requests of one limit",
        ),
        (
            r#""limits": [{"requests": 2, "per": "second"}], "cost_header": "x-cost", "limits_from": {"from": "jwt:rate", "max": 5}"#,
            "rules[0].limits_from: a limit read from the request counts the request up front",
        ),
        (
            r#""limits": [{"requests": 2, "per": "second"}], "limits_from": {"from": "jwt:rate", "max": 5, "min": 1}"#,
            "rules[0].limits_from.min: unknown field `min`",
        ),
    ];
    for (body, expected) in cases {
        let local = if body.contains("consistency") {
            ""
        } else {
            r#""consistency": "local", "#
        };
        let json = format!(
            r#"{{"service": {{"cluster": "svc"}}, "rules": [{{"name": "api", "key": ["jwt:sub"], {local}{body}}}]}}"#
        );
        let error = sluice_core::parse(json.as_bytes())
            .err()
            .unwrap_or_else(|| panic!("accepted: {body}"))
            .to_string();
        assert!(error.starts_with(expected), "{body}: {error}");
    }
}

/// A request a later rule denies gives back what it spent under the limit its value gave: a key
/// whose value is 10 keeps its 10, not the rule's own 2, however many requests the later rule
/// denies.
#[test]
fn a_refund_gives_back_under_the_limit_the_value_gave() {
    let limiter = Limiter::new(parse(
        r#"{"rules": [
            {"name": "contract", "key": ["jwt:sub"], "limits": [{"requests": 2, "per": "minute"}],
             "limits_from": {"from": "jwt:rate_per_minute", "max": 10}},
            {"name": "per-path", "key": ["header:x-b"], "limits": [{"requests": 1, "per": "minute"}]}]}"#,
    ));
    let mut store = MemoryStore::default();
    let request = |b: String| move || user("alice", Some("10")).with_header("x-b", &b);
    assert_eq!(admitted(&limiter, &mut store, 6, request("one".into())), 1);
    // Alice spent one of her 10; the 5 denials by per-path gave theirs back.
    let fresh: usize = (0..12)
        .map(|i| admitted(&limiter, &mut store, 1, request(format!("fresh-{i}"))))
        .sum();
    assert_eq!(fresh, 9);
}

/// A key's own limits are its contract, day and night: a rule's schedule does not put the rule's
/// night limits in their place (its windows are the rule's), while every other key follows it.
/// `limits_from` with a schedule is refused (`core/tests/config/limits_from_schedule.err`).
#[test]
fn a_key_s_own_limits_hold_through_the_rule_s_schedule() {
    // T0 is 00:00 UTC: inside the night window.
    let configured = parse(
        r#"{"rules": [{"name": "api", "key": ["header:x-customer"],
            "limits": [{"requests": 4, "per": "minute"}],
            "schedule": [{"utc": "00:00-06:00", "limits": [{"requests": 1, "per": "minute"}]}]}]}"#,
    );
    let live = key_limits(&[("api", &["42"], json!([{"requests": 6, "per": "minute"}]))]);
    let (limiter, problems) = overridden(&configured, &live);
    assert!(problems.is_empty(), "{problems:?}");
    let mut store = MemoryStore::default();
    assert_eq!(admitted(&limiter, &mut store, 9, || customer("42")), 6);
    assert_eq!(admitted(&limiter, &mut store, 9, || customer("43")), 1);
}

/// A live override of a `limits_from` rule's limits passes the checks the configuration makes of
/// them: an override adding an hourly cap used to be accepted, and a caller with a value was then
/// counted under the value's limit alone, escaping the cap; one above `max` gave a caller without
/// a value more than `max`. Both are refused, naming the override's limit, and the rule is left as
/// configured; a one-limit override within `max` is taken.
#[test]
fn an_override_of_a_limits_from_rule_passes_its_checks() {
    let configured = parse(FROM_CLAIM);
    let refused = [
        (
            json!([{"requests": 2, "per": "minute"}, {"requests": 3, "per": "hour"}]),
            "limits.api[1]: limits_from replaces the requests of one limit",
        ),
        (
            json!([{"requests": 50, "per": "minute"}]),
            "limits.api[0].requests: limits_from.max (5) is less than limits.api[0].requests (50)",
        ),
        (
            json!([{"requests": 2, "per": "minute", "algorithm": "sliding_log"}]),
            "limits.api[0].algorithm: limits_from takes a token_bucket",
        ),
    ];
    for (limits, expected) in refused {
        let (limiter, problems) = overridden(&configured, &rule_limits("api", limits.clone()));
        assert!(
            problems.len() == 1 && problems[0].starts_with(expected),
            "{limits}: {problems:?}"
        );
        assert_eq!(
            limiter.policy().rules[0].limits,
            configured.rules[0].limits,
            "{limits}: left as configured"
        );
        // the value's limit still holds, and no more
        let mut store = MemoryStore::default();
        assert_eq!(
            admitted(&limiter, &mut store, 10, || user("erin", Some("4"))),
            4
        );
    }
    let (limiter, problems) = overridden(
        &configured,
        &rule_limits("api", json!([{"requests": 3, "per": "minute"}])),
    );
    assert!(problems.is_empty(), "{problems:?}");
    let mut store = MemoryStore::default();
    assert_eq!(
        admitted(&limiter, &mut store, 10, || user("frank", None)),
        3
    );
    assert_eq!(
        admitted(&limiter, &mut store, 10, || user("gina", Some("5"))),
        5
    );
}

/// A live override of a scheduled rule's limits keeps the rule's schedule, as the configuration
/// reference says ("one that keeps the layout is scaled as the rule's own"): it used to be built
/// as a key's own limits, which hold day and night, so any override dropped the night window on
/// every proxy. A limit that cannot follow load or time is refused under a scale or a schedule,
/// as the configuration refuses it.
#[test]
fn an_override_of_a_scheduled_rule_keeps_its_schedule() {
    // T0 is 00:00 UTC: inside the night window.
    let configured = parse(
        r#"{"rules": [{"name": "api", "key": ["header:x-customer"],
            "limits": [{"requests": 4, "per": "minute"}],
            "schedule": [{"utc": "00:00-06:00", "limits": [{"requests": 1, "per": "minute"}]}]}]}"#,
    );
    let live = rule_limits("api", json!([{"requests": 6, "per": "minute"}]));
    let (limiter, problems) = overridden(&configured, &live);
    assert!(problems.is_empty(), "{problems:?}");
    assert_eq!(limiter.policy().rules[0].limits[0].requests(), 6);
    let mut store = MemoryStore::default();
    assert_eq!(
        admitted(&limiter, &mut store, 9, || customer("43")),
        1,
        "the night window still holds"
    );

    // An override that lowers a limit holds through a window that would allow more: an
    // operator's emergency limit is not undone at night.
    let generous = parse(
        r#"{"rules": [{"name": "api", "key": ["header:x-customer"],
            "limits": [{"requests": 100, "per": "minute"}],
            "schedule": [{"utc": "00:00-06:00", "limits": [{"requests": 50, "per": "minute"}]}]}]}"#,
    );
    for (requests, at_night) in [(10, 10), (80, 50), (500, 50)] {
        let live = rule_limits("api", json!([{"requests": requests, "per": "minute"}]));
        let (limiter, problems) = overridden(&generous, &live);
        assert!(problems.is_empty(), "{problems:?}");
        let mut store = MemoryStore::default();
        admitted(&limiter, &mut store, 600, || customer("44"));
        // a minute on (00:01, still night): what the minute refilled
        let refilled = (0..600)
            .filter(|_| {
                let mut request = customer("44");
                let moment = Moment::at(T0 + 60_000_000);
                let (_, step, _) =
                    Exchange::start(&limiter, &mut request, None, moment, &mut store);
                step == Step::Continue
            })
            .count();
        assert_eq!(
            refilled, at_night,
            "an override of {requests} a minute, a night minute later"
        );
    }

    let scaled = parse(
        r#"{"service": {"cluster": "svc"}, "shedding": {"bulkheads": [{"name": "api", "limit": {"static": 10}}]},
            "rules": [{"name": "api", "key": ["header:x-customer"],
            "consistency": "local", "limits": [{"requests": 4, "per": "minute"}], "scale": {"high": 0.5}}]}"#,
    );
    for (body, field) in [
        (
            json!({"requests": 4, "per": "minute", "algorithm": "sliding_log"}),
            "limits.api[0].algorithm: limits[0] is a sliding_log",
        ),
        (
            json!({"concurrent": 4, "algorithm": "concurrency"}),
            "limits.api[0].",
        ),
    ] {
        let live = rule_limits("api", json!([body.clone()]));
        let (limiter, problems) = overridden(&scaled, &live);
        assert!(
            problems.len() == 1 && problems[0].starts_with(field),
            "{body}: {problems:?}"
        );
        assert_eq!(limiter.policy().rules[0].limits, scaled.rules[0].limits);
    }
}

/// The body of the quota path's answer to `request`.
fn quota_answer(limiter: &Limiter, store: &mut MemoryStore, mut request: PlainRequest) -> String {
    match Exchange::start(limiter, &mut request, None, Moment::at(T0), store).1 {
        Step::Respond(reply) => reply.body,
        other => panic!("not answered: {other:?}"),
    }
}

/// The quota path tells a key with limits of its own those limits (what decides its requests),
/// its remaining counted under them; every other key the rule's.
#[test]
fn the_quota_path_tells_a_key_its_own_limits() {
    let configured = parse(
        r#"{"rules": [{"name": "api", "key": ["header:x-customer"], "quota_path": "/rate_limit",
            "quota_path_any_key": true, "limits": [{"requests": 1000, "per": "minute"}]}]}"#,
    );
    let live = key_limits(&[(
        "api",
        &["42"],
        json!([{"requests": 20000, "per": "minute"}]),
    )]);
    let (limiter, problems) = overridden(&configured, &live);
    assert!(problems.is_empty(), "{problems:?}");
    let mut store = MemoryStore::default();
    assert_eq!(admitted(&limiter, &mut store, 3, || customer("42")), 3);
    let asked = |id: &str| PlainRequest::get("/rate_limit").with_header("x-customer", id);
    let body = quota_answer(&limiter, &mut store, asked("42"));
    assert!(
        body.contains(r#""limit":20000,"remaining":19997"#),
        "{body}"
    );
    let body = quota_answer(&limiter, &mut store, asked("43"));
    assert!(body.contains(r#""limit":1000,"remaining":1000"#), "{body}");
}

/// The quota path tells a caller the limit its `limits_from` value gives (bounded by `max`, the
/// rule's own for a value that is not a number), as its requests are decided.
#[test]
fn the_quota_path_tells_the_limit_a_limits_from_value_gives() {
    let limiter = Limiter::new(parse(
        r#"{"rules": [{"name": "api", "key": ["jwt:sub"], "quota_path": "/rate_limit",
            "limits": [{"requests": 100, "per": "minute"}],
            "limits_from": {"from": "jwt:rate_per_minute", "max": 200}}]}"#,
    ));
    let mut store = MemoryStore::default();
    assert_eq!(
        admitted(&limiter, &mut store, 2, || user("alice", Some("150"))),
        2
    );
    let asked = |rate: Option<&str>| {
        let mut request = user("alice", rate);
        request.path = "/rate_limit".into();
        request
    };
    let body = quota_answer(&limiter, &mut store, asked(Some("150")));
    assert!(body.contains(r#""limit":150,"remaining":148"#), "{body}");
    let body = quota_answer(&limiter, &mut store, asked(Some("1000000")));
    assert!(body.contains(r#""limit":200,"#), "at most max: {body}");
    let body = quota_answer(&limiter, &mut store, asked(Some("junk")));
    assert!(body.contains(r#""limit":100,"#), "the rule's own: {body}");
}

/// The quota path answers an operator's block or allow of the caller's key as its requests are
/// decided: a blocked key has nothing left until the block ends (its reset is the block's time
/// left), an allowed one is not limited by the rule (`null`); others are counted as ever.
#[test]
fn the_quota_path_tells_a_blocked_key_it_has_nothing_left_and_an_allowed_one_null() {
    let configured = parse(
        r#"{"rules": [{"name": "api", "key": ["header:x-customer"], "quota_path": "/rate_limit",
            "quota_path_any_key": true, "limits": [{"requests": 1000, "per": "minute"}]}]}"#,
    );
    let in_90_s = T0 / 1_000 + 90_000;
    let live = LiveOverrides {
        version: 1,
        keys: [(
            "api".to_string(),
            [
                ("blocked".to_string(), KeyAction::Block),
                ("vip".to_string(), KeyAction::Allow),
            ]
            .into(),
        )]
        .into(),
        expires: [("api".to_string(), [("blocked".to_string(), in_90_s)].into())].into(),
        ..Default::default()
    };
    let (limiter, problems) = overridden(&configured, &live);
    assert!(problems.is_empty(), "{problems:?}");
    let mut store = MemoryStore::default();
    let asked = |id: &str| PlainRequest::get("/rate_limit").with_header("x-customer", id);
    let body = quota_answer(&limiter, &mut store, asked("blocked"));
    assert!(
        body.contains(r#""limit":1000,"remaining":0,"reset":90,"#),
        "{body}"
    );
    let body = quota_answer(&limiter, &mut store, asked("vip"));
    assert_eq!(body, r#"{"rules":{"api":null}}"#);
    let body = quota_answer(&limiter, &mut store, asked("other"));
    assert!(body.contains(r#""limit":1000,"remaining":1000"#), "{body}");
}

/// A key's own limits on a `limits_from` rule are the operator's contract: they may be above the
/// rule's `max` (which bounds what a request's value can give), and they decide the key whatever
/// value its requests carry; the others still follow their values.
#[test]
fn a_key_s_own_limits_on_a_limits_from_rule_may_pass_its_max() {
    let configured = parse(FROM_CLAIM);
    let live = key_limits(&[("api", &["acme"], json!([{"requests": 20, "per": "minute"}]))]);
    let (limiter, problems) = overridden(&configured, &live);
    assert!(problems.is_empty(), "{problems:?}");
    let mut store = MemoryStore::default();
    assert_eq!(
        admitted(&limiter, &mut store, 30, || user("acme", Some("3"))),
        20
    );
    assert_eq!(
        admitted(&limiter, &mut store, 30, || user("bob", Some("3"))),
        3
    );
    // still one limit of the rule's form
    let two = key_limits(&[(
        "api",
        &["acme"],
        json!([{"requests": 20, "per": "minute"}, {"requests": 100, "per": "hour"}]),
    )]);
    let (_, problems) = overridden(&configured, &two);
    assert_eq!(problems.len(), 1, "{problems:?}");
}
