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
            load: Default::default(),
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
fn a_curve_a_percentile_and_a_saturation_header_say_they_are_not_simulated() {
    let config = r#"{"rules": [{"name": "r", "key": ["const:all"], "limits": [{"requests": 2, "per": "minute"}]}],
        "shedding": {"bulkheads": [{"name": "api", "limit": {"adaptive": {"min": 2, "max": 50}},
        "curve": [{"at": 0.7, "shed": 0.1}], "saturation_header": "x-upstream-saturation"}]}}"#;
    let r = report(config, "0,a\n");
    let notes: Vec<&str> = r["notes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|n| n.as_str())
        .collect();
    for expected in [
        "bulkhead api sheds at random by its curve",
        "bulkhead api reads the upstream's saturation in response header x-upstream-saturation: not simulated",
        "bulkhead api has an adaptive limit by its p90 latency",
    ] {
        assert!(notes.iter().any(|n| n.starts_with(expected)), "{expected}: {notes:?}");
    }
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

#[test]
fn a_fleet_share_fallback_is_named_with_what_it_assumes() {
    let config = r#"{"service": {"cluster": "s"}, "rules": [{"name": "shared", "key": ["const:all"],
        "consistency": "cached", "limits": [{"requests": 8, "per": "minute"}],
        "fallback": {"policy": "fail_open", "share": "fleet", "assume_proxies": 4, "max_proxies": 16}}]}"#;
    let r = report(config, "0,a\n0,a\n0,a\n");
    assert_eq!(r["ok"], true, "{r}");
    assert_eq!(
        r["totals"]["admitted"], 3,
        "the service's whole count decides"
    );
    let notes: Vec<&str> = r["notes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|n| n.as_str())
        .collect();
    assert!(
        notes.iter().any(|n| n.starts_with(
            "rule shared falls back to its limits divided among the proxies the counter service counts (share: fleet)"
        ) && n.contains("believed up to 16 (max_proxies)")
            && n.ends_with("assumes 4 (assume_proxies)")),
        "{notes:?}"
    );
}

/// A penalty needs no upstream: played as a proxy would. Counting by the answer needs the
/// trace's statuses (`status=NNN`): without them, the notes say it counts nothing.
#[test]
fn penalties_are_played_and_count_when_reads_the_traces_statuses() {
    let config = r#"{"rules": [{"name": "login", "key": ["client_ip"], "penalty": "10m",
        "count_when": {"statuses": [401]}, "limits": [{"requests": 2, "per": "minute"}]}]}"#;
    // Two failures, then out for ten minutes: the bucket has room again after a minute, but the
    // penalty denies until 600 s after the denial at 2 s.
    let trace = "0,a,/login,POST,status=401\n1,a,/login,POST,status=401\n2,a,/login,POST\n\
                 100,a,/login,POST\n603,a,/login,POST\n";
    let r = report(config, trace);
    assert_eq!(r["ok"], true, "{r}");
    let decisions: Vec<&str> = r["requests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["decision"].as_str().unwrap())
        .collect();
    assert_eq!(
        decisions,
        ["admitted", "admitted", "denied", "denied", "admitted"]
    );
    assert_eq!(r["requests"][0]["status"], 401);
    assert_eq!(r["requests"][3]["retry_after"], 502);
    // Without statuses, nothing is counted, and the notes say why.
    let r = report(config, "0,a\n0,a\n0,a\n0,a\n");
    assert_eq!(r["totals"]["admitted"], 4);
    assert!(
        r["notes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n.as_str().is_some_and(|n| n.contains("gives no status"))),
        "{}",
        r["notes"]
    );
    // Attacker's test: the trace is the user's; a status outside 100 to 599 is refused, named.
    for bad in [
        "0,a,/,GET,status=99\n",
        "0,a,/,GET,status=600\n",
        "0,a,/,GET,status=x\n",
    ] {
        let r = report(config, bad);
        assert_eq!(r["ok"], false, "{bad}");
        assert!(
            r["message"].as_str().unwrap().contains("status"),
            "{}",
            r["message"]
        );
    }
}

/// Per-key concurrency in the playground: an admitted request holds its slot for the trace's
/// `duration` column, and its slot is free again when that ends; a request without a duration
/// holds none; the notes say how in-flight requests are simulated; a bad duration is named.
#[test]
fn concurrent_limits_hold_slots_for_the_traces_durations() {
    let config = r#"{"headers": "both", "rules": [{"name": "inflight", "key": ["client_ip"],
        "limits": [{"concurrent": 2}]}]}"#;
    let trace = "seconds,client,path,method,extras,duration\n\
        0,a,/,GET,,10\n\
        1,a,/,GET,,5\n\
        2,a\n\
        3,b,/,GET,,1\n\
        5.999,a,/,GET,,1\n\
        6,a,/,GET,,1\n\
        6.5,a\n\
        7,a\n\
        7,a\n";
    let r = report(config, trace);
    assert_eq!(r["ok"], true, "{r}");
    let decisions: Vec<&str> = r["requests"]
        .as_array()
        .expect("requests")
        .iter()
        .map(|q| q["decision"].as_str().unwrap())
        .collect();
    assert_eq!(
        decisions,
        [
            "admitted", // a holds 1 until 10 s
            "admitted", // a holds 2 until 6 s
            "denied",   // a is full
            "admitted", // b has its own
            "denied",   // 5.999: still full
            "admitted", // 6: the 5 s one ended; holds 2 until 7 s
            "denied",   // 6.5: full again
            "admitted", // 7: the 1 s one ended, and this one ends at once
            "admitted", // ... so does this one
        ],
        "{r}"
    );
    let denied = &r["requests"][2];
    assert_eq!(denied["retry_after"], 1, "{denied}");
    assert_eq!(denied["rule"], "inflight");
    assert!(
        r["notes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n.as_str().unwrap().contains("duration column")),
        "{r}"
    );
    for bad in ["-1", "soon", "99999999999"] {
        let r = report(config, &format!("0,a,/,GET,,{bad}\n"));
        assert_eq!(r["ok"], false, "{bad}: {r}");
        let message = r["message"].as_str().unwrap();
        assert!(
            message.starts_with("trace: line 1: duration: expected 0 to"),
            "{message}"
        );
    }
}

fn notes(r: &serde_json::Value) -> Vec<String> {
    r["notes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|n| n.as_str().map(str::to_string))
        .collect()
}

/// A schedule needs no upstream: the trace's clock decides it (second 0 is 00:00 UTC). A scale
/// reads load, which is not simulated, and a quota path is answered: the notes say so.
#[test]
fn schedules_are_played_scales_named_and_quota_paths_answered() {
    let config = r#"{"shedding": {"bulkheads": [{"name": "all", "limit": {"static": 10}}]},
        "rules": [{"name": "api", "key": ["client_ip"], "quota_path": "/rate_limit",
        "limits": [{"requests": 5, "per": "minute"}], "scale": {"high": 0.5},
        "schedule": [{"utc": "00:00-01:00", "limits": [{"requests": 1, "per": "minute"}]}]}]}"#;
    let trace = "0,a\n0,a\n0,a\n0,a,/rate_limit\n3600,b\n3600,b\n3600,b\n";
    let r = report(config, trace);
    assert_eq!(r["ok"], true, "{r}");
    assert_eq!(r["totals"]["denied"], 2, "the night's 1 a minute, then 5");
    let quota = &r["requests"][3];
    assert_eq!(quota["decision"], "answered");
    assert_eq!(quota["status"], 200);
    assert_eq!(
        quota["body"],
        r#"{"rules":{"api":{"limit":1,"remaining":0,"reset":60,"resetAt":1767225660,"window":60}}}"#
    );
    let notes = notes(&r);
    for start in [
        "rule api scales its limits by the proxy's shedding level (scale): load is not simulated",
        "rule api has other limits during 00:00-01:00 UTC (schedule), simulated",
        "rule api answers /rate_limit with the caller's own quota (quota_path)",
    ] {
        assert!(
            notes.iter().any(|n| n.starts_with(start)),
            "{start}: {notes:?}"
        );
    }
}

/// A penalty of a cached rule is the fleet's; the playground plays one proxy, and says so.
#[test]
fn a_shared_penalty_is_named_fleet_wide() {
    let config = r#"{"service": {"cluster": "s"}, "rules": [{"name": "login", "key": ["client_ip"],
        "consistency": "cached", "penalty": "10m", "limits": [{"requests": 2, "per": "minute"}]}]}"#;
    let notes = notes(&report(config, "0,a\n"));
    assert!(
        notes.iter().any(|n| n.starts_with(
            "rule login's penalty is shared fleet-wide through the counter service (cached)"
        )),
        "{notes:?}"
    );
}

#[test]
fn a_rule_counting_its_top_keys_plays_the_same_and_says_what_is_not_shown() {
    let plain = r#"{"rules": [{"name": "r", "key": ["client_ip"], "limits": [{"requests": 2, "per": "minute"}]}]}"#;
    let counted = r#"{"rules": [{"name": "r", "key": ["client_ip"], "limits": [{"requests": 2, "per": "minute"}], "top_keys": 8}]}"#;
    let trace = "0,a\n0,a\n0,a\n0,b\n";
    let (p, c) = (report(plain, trace), report(counted, trace));
    assert_eq!(c["ok"], true, "{c}");
    assert_eq!(p["totals"], c["totals"], "counting changes no decision");
    let notes: Vec<&str> = c["notes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|n| n.as_str())
        .collect();
    assert!(
        notes
            .iter()
            .any(|n| n.starts_with("top keys (top_keys) are counted")),
        "{notes:?}"
    );
}

/// A limit read from the request (`limits_from`) plays from the trace's claims: each client its
/// own, at most `max`, and the rule's own limit for a client without one (or a bad one).
#[test]
fn a_limit_read_from_the_trace_is_played_bounded() {
    let config = r#"{"rules": [{"name": "api", "key": ["jwt:sub"],
        "limits": [{"requests": 2, "per": "minute"}],
        "limits_from": {"from": "jwt:rate_per_minute", "max": 4}}]}"#;
    let mut trace = String::new();
    for (client, extras) in [
        ("alice", "jwt:rate_per_minute=3"),
        ("bob", "jwt:rate_per_minute=900"),
        ("carol", ""),
        ("dave", "jwt:rate_per_minute=-5"),
    ] {
        for i in 0..6 {
            trace.push_str(&format!("0.{i},{client},/x,GET,{extras}\n"));
        }
    }
    let r = report(config, &trace);
    assert_eq!(r["ok"], true, "{r}");
    let admitted = |client: &str| {
        r["requests"]
            .as_array()
            .unwrap()
            .iter()
            .zip(parse_trace(&trace).unwrap())
            .filter(|(a, arrival)| arrival.client == client && a["decision"] == "admitted")
            .count()
    };
    assert_eq!(
        [
            admitted("alice"),
            admitted("bob"),
            admitted("carol"),
            admitted("dave")
        ],
        [3, 4, 2, 2]
    );
    assert!(
        r["notes"][0]
            .as_str()
            .is_some_and(|n| n
                .starts_with("rule api reads its limit from each request's jwt:rate_per_minute")),
        "{}",
        r["notes"]
    );
}
