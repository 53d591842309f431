//! The playground's answers are core's: the same counts as `Limiter::decide` on the same
//! trace, the filter's headers, and the parser's messages.

use sluice_core::limiter::Conditions;
use sluice_core::{Decision, Limiter, MemoryStore};
use sluice_playground::{parse_trace, simulate, validate, EPOCH_US};

fn report(config: &str, trace: &str) -> serde_json::Value {
    serde_json::from_str(&simulate(config, trace)).expect("the report is JSON")
}

/// A deterministic trace: `n` requests from `clients` clients, bursty.
fn trace(n: usize, clients: usize) -> String {
    let mut csv = String::from("seconds,client,path\n");
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut t = 0.0f64;
    for i in 0..n {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        // Gaps of 0 to 0.4 s, with a burst of simultaneous requests every 50.
        if i % 50 >= 10 {
            t += (state % 400) as f64 / 1000.0;
        }
        let client = (state >> 20) as usize % clients;
        csv.push_str(&format!("{t:.6},198.51.100.{},/api/items\n", client + 1));
    }
    csv
}

/// (admitted, denied) by core's limiter, request by request, with no simulation in between.
fn native(config: &str, csv: &str) -> (u64, u64) {
    let limiter = Limiter::new(sluice_core::parse(config.as_bytes()).expect("valid"));
    let mut store = MemoryStore::default();
    let (mut admitted, mut denied) = (0, 0);
    for arrival in parse_trace(csv).expect("a trace") {
        let mut request = sluice_core::PlainRequest::get(&arrival.path).from_ip(&arrival.client);
        let conditions = Conditions {
            now_us: EPOCH_US + arrival.at_us,
            service_up: true,
            service_back_us: 0,
        };
        match limiter
            .decide(&mut request, conditions, &mut store)
            .decision
        {
            Decision::Allow { .. } => admitted += 1,
            _ => denied += 1,
        }
    }
    (admitted, denied)
}

#[test]
fn every_algorithm_decides_as_core_does() {
    let csv = trace(3_000, 5);
    for limit in [
        r#"{"requests": 60, "per": "minute", "burst": 10}"#,
        r#"{"requests": 60, "per": "minute", "burst": 10, "algorithm": "gcra"}"#,
        r#"{"requests": 30, "per": "minute", "algorithm": "fixed_window"}"#,
        r#"{"requests": 30, "per": "minute", "algorithm": "sliding_window"}"#,
        r#"{"requests": 20, "per": "minute", "algorithm": "sliding_log"}"#,
        r#"{"requests": 2, "per": "second", "algorithm": "leaky_bucket", "queue": 5}"#,
        r#"{"requests": 40, "per": "90s", "burst": 10}"#,
        r#"{"requests": 15, "per": 45, "algorithm": "gcra"}"#,
        r#"{"requests": 30, "per": "7m", "algorithm": "fixed_window"}"#,
        r#"{"requests": 30, "per": "2m", "algorithm": "sliding_window"}"#,
        r#"{"requests": 20, "per": 70, "algorithm": "sliding_log"}"#,
        r#"{"requests": 3, "per": "2s", "algorithm": "leaky_bucket", "queue": 5}"#,
    ] {
        let config = format!(
            r#"{{"rules": [{{"name": "per-client", "key": ["client_ip"], "limits": [{limit}]}}]}}"#
        );
        let r = report(&config, &csv);
        assert_eq!(r["ok"], true, "{limit}: {r}");
        let (admitted, denied) = native(&config, &csv);
        assert_eq!(r["totals"]["offered"], 3_000, "{limit}");
        assert_eq!(r["totals"]["admitted"], admitted, "{limit}");
        assert_eq!(r["totals"]["denied"], denied, "{limit}");
        assert!(
            denied > 0 && admitted > 0,
            "{limit}: the trace tests both answers"
        );
        let series: u64 = r["series"]["denied"]
            .as_array()
            .expect("a series")
            .iter()
            .filter_map(|v| v.as_u64())
            .sum();
        assert_eq!(series, denied, "{limit}: the series adds up");
    }
}

#[test]
fn a_denied_request_has_the_filters_answer() {
    let config = r#"{"headers": "both", "rules": [{"name": "per-ip", "key": ["client_ip"],
        "limits": [{"requests": 60, "per": "minute", "burst": 2}]}]}"#;
    let r = report(config, "0,10.0.0.1,/a\n0,10.0.0.1,/a\n0.5,10.0.0.1,/a\n");
    let requests = r["requests"].as_array().expect("requests");
    assert_eq!(requests[1]["decision"], "admitted");
    assert_eq!(
        requests[1]["headers"],
        serde_json::json!([
            ["x-ratelimit-limit", "60"],
            ["x-ratelimit-remaining", "0"],
            ["x-ratelimit-reset", "2"],
            ["ratelimit-policy", "\"per-ip\";q=60;w=60"],
            ["ratelimit", "\"per-ip\";r=0;t=2"]
        ])
    );
    let denied = &requests[2];
    assert_eq!(denied["decision"], "denied");
    assert_eq!(denied["status"], 429);
    assert_eq!(denied["rule"], "per-ip");
    assert_eq!(denied["retry_after"], 1, "half a token in half a second");
    let headers = denied["headers"].as_array().expect("headers");
    assert_eq!(headers[0], serde_json::json!(["retry-after", "1"]));
    let state = &denied["outcomes"][0]["state"][0];
    assert_eq!(state["remaining"], 0);
    assert_eq!(
        state["tokens"], 0.5,
        "one token a second, refilled for 0.5 s"
    );
    assert_eq!(denied["outcomes"][0]["key"], "10.0.0.1");
}

#[test]
fn validation_names_the_field() {
    let bad = r#"{"rules": [{"name": "a", "key": ["client_ip"], "limits": [{"requests": 5, "per": "fortnight"}]}]}"#;
    let answer: serde_json::Value = serde_json::from_str(&validate(bad)).expect("JSON");
    assert_eq!(answer["ok"], false);
    assert_eq!(answer["field"], "rules[0].limits[0].per");
    let parser = sluice_core::parse(bad.as_bytes()).expect_err("invalid");
    assert_eq!(answer["message"], parser.to_string());

    let good: serde_json::Value = serde_json::from_str(&validate(
        r#"{"rules": [{"name": "a", "key": ["client_ip"], "limits": [{"requests": 5, "per": "minute"}]}]}"#,
    ))
    .expect("JSON");
    assert_eq!(good["ok"], true);
    assert_eq!(good["rules"][0]["name"], "a");
}

/// A duration's fixed window in the playground: `"7m"` windows start at multiples of 420 s since
/// the epoch (the simulation's clock starts at one, 2026-01-01 00:00 UTC); the rule lists the
/// period as it reads back and its length; a bad duration is named.
#[test]
fn a_duration_window_turns_at_its_epoch_multiples() {
    let config = r#"{"headers": "draft", "rules": [{"name": "seven", "key": ["client_ip"],
        "limits": [{"requests": 2, "per": "7m", "algorithm": "fixed_window"}]}]}"#;
    let r = report(config, "0,a\n0,a\n0,a\n419.999,a\n420,a\n420,a\n420,a\n");
    assert_eq!(r["ok"], true, "{r}");
    let decisions: Vec<&str> = r["requests"]
        .as_array()
        .expect("requests")
        .iter()
        .map(|q| q["decision"].as_str().unwrap())
        .collect();
    assert_eq!(decisions[..3], ["admitted", "admitted", "denied"]);
    assert_eq!(decisions[3], "denied", "the same window: {r}");
    assert_eq!(decisions[4..], ["admitted", "admitted", "denied"]);
    let limit = &r["rules"][0]["limits"][0];
    assert_eq!(limit["per"], "7m", "{r}");
    assert_eq!(limit["seconds"], 420, "{r}");
    let denied = &r["requests"][2]["headers"];
    assert!(
        denied
            .as_array()
            .unwrap()
            .iter()
            .any(|h| h[0] == "ratelimit-policy" && h[1] == "\"seven\";q=2;w=420"),
        "{denied}"
    );
    let bad = r#"{"rules": [{"name": "a", "key": ["client_ip"], "limits": [{"requests": 5, "per": "1m30s"}]}]}"#;
    let answer: serde_json::Value = serde_json::from_str(&validate(bad)).expect("JSON");
    assert_eq!(answer["field"], "rules[0].limits[0].per");
}

#[test]
fn a_bad_trace_line_is_named() {
    let config = r#"{"rules": [{"name": "a", "key": ["client_ip"], "limits": [{"requests": 5, "per": "minute"}]}]}"#;
    let r = report(config, "seconds,client\n0,a\nsoon,b\n");
    assert_eq!(r["ok"], false);
    assert_eq!(
        r["message"],
        "trace: line 3: seconds: expected a number of seconds, got \"soon\""
    );
    let r = report(config, "0,a,api\n");
    assert_eq!(r["ok"], false, "{r}");
}

#[test]
fn a_bulkheads_rollout_is_named_in_the_notes() {
    let config = r#"{"rules": [{"name": "r", "key": ["const:all"], "limits": [{"requests": 2, "per": "minute"}]}],
        "shedding": {"mode": "warn", "bulkheads": [{"name": "api", "limit": {"static": 4}},
        {"name": "pay", "limit": {"static": 4}, "mode": "enforce", "ramp_percent": 10}]}}"#;
    let r = report(config, "0,a\n");
    let notes: Vec<&str> = r["notes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|n| n.as_str())
        .collect();
    assert!(
        notes.contains(&"bulkhead api is in warn mode: it would shed nothing"),
        "{notes:?}"
    );
    assert!(
        notes.contains(&"bulkhead pay enforces 10% of what it would shed"),
        "{notes:?}"
    );
}

#[test]
fn cached_rules_and_shedding_are_named_in_the_notes() {
    let config = r#"{"service": {"cluster": "s"}, "rules": [{"name": "shared", "key": ["const:all"],
        "consistency": "cached", "limits": [{"requests": 2, "per": "minute"}]}]}"#;
    let r = report(config, "0,a\n0,a\n0,a\n");
    assert_eq!(
        r["totals"]["admitted"], 2,
        "counted exactly, as one local limit"
    );
    assert!(r["notes"][0]
        .as_str()
        .is_some_and(|n| n.starts_with("rule shared is cached")));
}
