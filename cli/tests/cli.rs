//! The `sluice` binary as a user runs it: its output, its messages and its exit status.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use serde_json::Value;

/// Runs `sluice args…`, `stdin` on its standard input.
fn sluice(args: &[&str], stdin: &[u8]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the sluice binary runs");
    // A command that does not read its input may have exited already.
    let _ = child.stdin.take().unwrap().write_all(stdin);
    child.wait_with_output().unwrap()
}

fn stdout(output: &Output) -> String {
    String::from_utf8(output.stdout.clone()).unwrap()
}

fn stderr(output: &Output) -> String {
    String::from_utf8(output.stderr.clone()).unwrap()
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The done-when of the tooling: `sluice check` says what the filter says, for every fixture.
#[test]
fn check_gives_the_filters_message_for_every_config_error_fixture() {
    let dir = repo().join("core/tests/config");
    let mut entries: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    entries.sort();
    assert!(
        entries.len() >= 25,
        "only {} fixtures in {}",
        entries.len(),
        dir.display()
    );
    for path in &entries {
        let expected = std::fs::read_to_string(path.with_extension("err")).unwrap();
        let expected = expected.trim_end_matches('\n');
        // The filter logs `parse`'s error.
        let filter = sluice_core::parse(&std::fs::read(path).unwrap())
            .expect_err("a fixture is a bad configuration")
            .to_string();
        assert_eq!(
            filter,
            expected,
            "the filter's message for {}",
            path.display()
        );

        let output = sluice(&["check", path.to_str().unwrap()], b"");
        assert_eq!(output.status.code(), Some(1), "{}", path.display());
        assert_eq!(
            stderr(&output),
            format!("{expected}\n"),
            "{}",
            path.display()
        );
        assert_eq!(stdout(&output), "", "{}", path.display());
    }
}

#[test]
fn check_reads_standard_input_and_says_the_same() {
    let path = repo().join("core/tests/config/bad_period.json");
    let expected = std::fs::read_to_string(path.with_extension("err")).unwrap();
    let output = sluice(&["check", "-"], &std::fs::read(&path).unwrap());
    assert_eq!(output.status.code(), Some(1));
    assert_eq!(stderr(&output).trim_end(), expected.trim_end());

    let output = sluice(&["check", "-"], b"  \n");
    assert_eq!(output.status.code(), Some(1));
    assert_eq!(
        stderr(&output),
        "the configuration is empty; expected a JSON object with \"rules\"\n"
    );
}

/// The example of core's `the_documented_example_is_accepted`.
const DOCUMENTED: &str = r#"{
  "headers": "draft",
  "bypass": {"paths": ["/healthz"]},
  "client_ip": {"trusted_hops": 0},
  "rules": [
    {"name": "per-ip", "match": {"path_prefix": "/api/", "methods": ["GET", "POST"]},
     "key": ["client_ip"],
     "limits": [{"requests": 100, "per": "minute", "burst": 20}],
     "mode": "enforce"}
  ]
}"#;

/// The top-level example of the configuration's documentation: a counter service.
const WITH_SERVICE: &str = r#"{
  "headers": "draft",
  "bypass": {"paths": ["/healthz"], "cidrs": ["10.0.0.0/8"]},
  "client_ip": {"trusted_hops": 0},
  "max_keys": 65536,
  "service": {"cluster": "sluice_service", "token": "change-me", "sync_interval_ms": 100},
  "rules": [
    {"name": "per-ip", "match": {"path_prefix": "/api/", "methods": ["GET", "POST"]},
     "key": ["client_ip"],
     "limits": [{"requests": 100, "per": "minute", "burst": 20}],
     "mode": "enforce",
     "consistency": "local"},
    {"name": "per-key", "key": ["header:x-api-key"],
     "limits": [{"requests": 1000, "per": "minute"}, {"requests": 100000, "per": "day"}],
     "consistency": "cached",
     "fallback": {"policy": "fail_open", "limits": [{"requests": 250, "per": "minute"}]}}
  ]
}"#;

/// Tiers from a claim, a first-present key, a path template on a host, a header match, a
/// leaky bucket, a monitored sliding log.
const TIERS: &str = r#"{
  "bypass": {"paths": ["/healthz"], "cidrs": ["10.0.0.0/8"]},
  "client_ip": {"trusted_hops": 1},
  "rules": [
    {"name": "per-ip", "match": {"path_prefix": "/api/"}, "key": ["client_ip"],
     "limits": [{"requests": 100, "per": "minute", "burst": 20}]},
    {"name": "export",
     "match": {"path_templates": ["/users/{id}/export"], "methods": ["GET"], "hosts": ["api.example.com"]},
     "key": ["jwt:sub|client_ip"],
     "tiers": {"from": "jwt:plan", "default": "free",
               "limits": {"free": [{"requests": 10, "per": "day", "algorithm": "fixed_window"}],
                          "pro": [{"requests": 1000, "per": "day", "algorithm": "fixed_window"}]}},
     "cost": 2},
    {"name": "uploads", "match": {"paths": ["/upload"], "headers": {"x-api-key": true}},
     "key": ["header:x-api-key"],
     "limits": [{"requests": 50, "per": "second", "algorithm": "leaky_bucket", "delay": 5, "queue": 20, "max_delay_ms": 500}]},
    {"name": "login", "match": {"paths": ["/login"], "methods": ["POST"]}, "key": ["client_ip/24"],
     "limits": [{"requests": 5, "per": "minute", "algorithm": "sliding_log"}], "mode": "monitor"}
  ]
}"#;

const SHEDDING_ONLY: &str = r#"{"shedding": {"bulkheads": [
  {"name": "api", "match": {"path_prefix": "/api/"}, "limit": {"static": 32}}]}}"#;

#[test]
fn check_accepts_valid_configurations_with_a_summary() {
    let cases = [
        (DOCUMENTED, "valid: 1 rule; no counter service\n"),
        (
            WITH_SERVICE,
            "valid: 2 rules; counter service: cluster sluice_service\n",
        ),
        (
            TIERS,
            "valid: 4 rules (tiers of export: free, pro; 5 rules as enforced); no counter service\n",
        ),
        (
            SHEDDING_ONLY,
            "valid: 0 rules; no counter service; shedding: 1 bulkhead\n",
        ),
    ];
    for (config, summary) in cases {
        sluice_core::parse(config.as_bytes()).expect("the filter accepts it");
        let output = sluice(&["check", "-"], config.as_bytes());
        assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
        assert_eq!(stdout(&output), summary);
        assert_eq!(stderr(&output), "");
    }
}

#[test]
fn a_file_that_cannot_be_read_is_named() {
    let output = sluice(&["check", "no/such/config.json"], b"");
    assert_eq!(output.status.code(), Some(2));
    assert!(
        stderr(&output).starts_with("sluice: cannot read no/such/config.json: "),
        "{}",
        stderr(&output)
    );
    let output = sluice(&["docs", "no/such/config.json"], b"");
    assert_eq!(output.status.code(), Some(2));
}

#[test]
fn bad_flags_are_usage_errors() {
    for args in [
        &["explain", "-", "--path", "users"][..],
        &["explain", "-", "--path", "/", "--client-ip", "alice"],
        &["explain", "-", "--path", "/", "--header", "no-colon"],
        &["explain", "-", "--path", "/", "--claim", "=x"],
        &["explain", "-", "--path", "/", "--method", "GET /"],
        &["explain", "-"],
        &["check"],
        &["frobnicate"],
    ] {
        let output = sluice(args, DOCUMENTED.as_bytes());
        assert_eq!(output.status.code(), Some(2), "{args:?}");
        assert!(stderr(&output).contains("error"), "{args:?}");
    }
}

#[test]
fn explain_shows_the_tier_the_key_and_the_template() {
    let output = sluice(
        &[
            "explain",
            "-",
            "--method",
            "get",
            "--path",
            "/users/42/export",
            "--host",
            "api.example.com",
            "--header",
            "x-user: alice",
            "--client-ip",
            "203.0.113.7",
            "--claim",
            "sub=alice",
            "--claim",
            "plan=pro",
        ],
        TIERS.as_bytes(),
    );
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let text = stdout(&output);
    assert!(text.contains("request:  GET /users/42/export\n"), "{text}");
    assert!(text.contains("bypassed: no\n"), "{text}");
    assert!(
        text.contains("1. per-ip: does not apply: path /users/42/export is not under /api/\n"),
        "{text}"
    );
    assert!(
        text.contains(
            "2. export/free: does not apply: tier free is the default, but jwt:plan is \"pro\", a tier of its own\n"
        ),
        "{text}"
    );
    assert!(text.contains("3. export/pro: applies\n"), "{text}");
    assert!(
        text.contains("   match:       path_templates /users/{id}/export; methods GET; hosts api.example.com\n"),
        "{text}"
    );
    assert!(
        text.contains("   tier:        pro of export (request: jwt:plan is \"pro\")\n"),
        "{text}"
    );
    assert!(
        text.contains("   key:         export/pro:jwt:sub=alice\n"),
        "{text}"
    );
    assert!(
        text.contains("   limits:      1000 per day, fixed_window\n"),
        "{text}"
    );
    assert!(text.contains("   cost:        2\n"), "{text}");
    assert!(
        text.contains("applies: export/pro (1 of 5 rules)\n"),
        "{text}"
    );
}

#[test]
fn explain_shows_a_fleet_share_fallback_and_what_it_assumes() {
    let config = r#"{"service": {"cluster": "svc"}, "rules": [
      {"name": "api", "key": ["header:x-api-key"], "limits": [{"requests": 1000, "per": "minute"}],
       "fallback": {"policy": "fail_open", "share": "fleet", "assume_proxies": 3, "max_proxies": 12}},
      {"name": "lone", "key": ["header:x-api-key"], "limits": [{"requests": 10, "per": "second"}],
       "fallback": {"policy": "fail_open", "share": "fleet", "max_proxies": 8}}]}"#;
    let output = sluice(&["explain", "-", "--path", "/x"], config.as_bytes());
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let text = stdout(&output);
    assert!(
        text.contains("   fallback:    fail_open with the rule's limits divided among the proxies the counter service counts, believed up to 12 (share: fleet; each rounded up, at least one request); until it answers a count, 3 proxies assumed: 334 per minute, burst 334, token_bucket\n"),
        "{text}"
    );
    assert!(
        text.contains("until it answers a count, the whole limit (1 proxy assumed): 10 per second, burst 10, token_bucket\n"),
        "{text}"
    );
    let check = sluice(&["check", "-"], config.as_bytes());
    assert_eq!(check.status.code(), Some(0), "{}", stderr(&check));
}

#[test]
fn explain_without_the_claim_falls_back_to_the_address_and_the_default_tier() {
    let output = sluice(
        &[
            "explain",
            "-",
            "--path",
            "/users/42/export",
            "--host",
            "API.example.com:8443",
            "--client-ip",
            "203.0.113.7:40000",
            "--json",
        ],
        TIERS.as_bytes(),
    );
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let json: Value = serde_json::from_str(&stdout(&output)).unwrap();
    assert_eq!(json["bypassed"], false);
    assert_eq!(json["request"]["client_ip"], "203.0.113.7");
    let rules = json["rules"].as_array().unwrap();
    let names: Vec<&str> = rules.iter().map(|r| r["name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        ["per-ip", "export/free", "export/pro", "uploads", "login"]
    );
    let free = &rules[1];
    assert_eq!(free["applies"], true);
    assert_eq!(free["rule"], "export");
    assert_eq!(free["tier"]["name"], "free");
    assert_eq!(free["tier"]["default"], true);
    assert_eq!(free["tier"]["value"], Value::Null);
    assert_eq!(free["keys"][0], "export/free:client_ip=203.0.113.7");
    assert_eq!(free["limits"][0]["requests"], 10);
    assert_eq!(free["limits"][0]["per"], "day");
    assert_eq!(free["limits"][0]["algorithm"], "fixed_window");
    assert_eq!(free["cost"], 2);
    assert_eq!(free["consistency"], "local");
    assert_eq!(free["mode"], "enforce");
    let pro = &rules[2];
    assert_eq!(pro["applies"], false);
    assert_eq!(
        pro["reason"],
        "tier pro, but the request has no jwt:plan (the default tier, free, counts it)"
    );
}

#[test]
fn explain_names_a_missing_key_part_and_a_failed_match() {
    let output = sluice(
        &["explain", "-", "--method", "PUT", "--path", "/upload"],
        TIERS.as_bytes(),
    );
    let text = stdout(&output);
    assert!(
        text.contains("uploads: does not apply: header x-api-key is absent\n"),
        "{text}"
    );

    let output = sluice(&["explain", "-", "--path", "/login"], TIERS.as_bytes());
    let text = stdout(&output);
    assert!(
        text.contains("login: does not apply: method GET is not one of POST\n"),
        "{text}"
    );

    // Matched on the normalized path; without a client address, counted in the missing bucket.
    let output = sluice(
        &["explain", "-", "--path", "//api/../api/x?q=1"],
        TIERS.as_bytes(),
    );
    let text = stdout(&output);
    assert!(
        text.contains("request:  GET //api/../api/x?q=1 (normalized: /api/x)\n"),
        "{text}"
    );
    assert!(
        text.contains(
            "   key:         per-ip:\\x1emissing\n   missing:     the request has no client_ip: counted with every such request, in the rule's missing bucket\n"
        ),
        "{text}"
    );
}

#[test]
fn explain_reads_the_client_address_as_the_filter_and_reports_bypasses() {
    // trusted_hops 1: the last X-Forwarded-For entry, across repeated headers.
    let output = sluice(
        &[
            "explain",
            "-",
            "--path",
            "/api/x",
            "--client-ip",
            "192.0.2.1",
            "-H",
            "X-Forwarded-For: 198.51.100.9",
            "-H",
            "x-forwarded-for: 203.0.113.50",
            "--json",
        ],
        TIERS.as_bytes(),
    );
    let json: Value = serde_json::from_str(&stdout(&output)).unwrap();
    assert_eq!(json["request"]["client_ip"], "203.0.113.50");
    assert_eq!(json["rules"][0]["keys"][0], "per-ip:203.0.113.50");

    let output = sluice(
        &[
            "explain",
            "-",
            "--path",
            "/api/x",
            "-H",
            "x-forwarded-for: 10.1.2.3",
        ],
        TIERS.as_bytes(),
    );
    let text = stdout(&output);
    assert!(
        text.contains("bypassed: yes, client address 10.1.2.3 is in bypass.cidrs (10.0.0.0/8)"),
        "{text}"
    );

    let output = sluice(
        &["explain", "-", "--path", "/healthz?full=1"],
        TIERS.as_bytes(),
    );
    assert!(
        stdout(&output).contains("bypassed: yes, path /healthz is in bypass.paths"),
        "{}",
        stdout(&output)
    );
}

#[test]
fn explain_of_a_shedding_only_configuration_has_no_rules() {
    let output = sluice(
        &["explain", "-", "--path", "/api/x"],
        SHEDDING_ONLY.as_bytes(),
    );
    assert_eq!(output.status.code(), Some(0));
    assert!(stdout(&output).contains("no rate-limit rules"));
}

/// Shedding rolled out per bulkhead: a mode and a ramp of its own, its own class thresholds.
const SHEDDING_ROLLOUT: &str = r#"{"shedding": {"mode": "monitor", "class_header": "x-class", "bulkheads": [
  {"name": "api", "match": {"path_prefix": "/api/"}, "limit": {"static": 32}, "mode": "enforce",
   "ramp_percent": 25, "classes": {"free": 0.5}},
  {"name": "search", "match": {"path_prefix": "/search/"}, "limit": {"static": 8}, "mode": "warn"},
  {"name": "rest", "limit": {"static": 8}}]}}"#;

#[test]
fn check_explain_and_docs_know_each_bulkheads_mode_ramp_and_thresholds() {
    let output = sluice(&["check", "-"], SHEDDING_ROLLOUT.as_bytes());
    assert_eq!(
        stdout(&output),
        "valid: 0 rules; no counter service; shedding: 3 bulkheads (api enforces 25%, search in \
         warn, rest in monitor)\n"
    );
    let output = sluice(
        &["explain", "-", "--path", "/api/x", "-H", "x-class: free"],
        SHEDDING_ROLLOUT.as_bytes(),
    );
    let text = stdout(&output);
    assert!(
        text.contains(
            "shedding: bulkhead api (32 in flight), class free shed from 50% of the limit\n"
        ) && text.contains("mode enforce, ramping: 25% of would-be sheds are shed"),
        "{text}"
    );
    let output = sluice(
        &[
            "explain",
            "-",
            "--path",
            "/api/x",
            "-H",
            "x-class: free",
            "--json",
        ],
        SHEDDING_ROLLOUT.as_bytes(),
    );
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(
        json["shedding"],
        serde_json::json!({"bulkhead": "api", "class": "free", "mode": "enforce", "ramp_percent": 25,
                           "threshold": 0.5, "limit": "32 in flight"})
    );
    let output = sluice(
        &["explain", "-", "--path", "/search/x"],
        SHEDDING_ROLLOUT.as_bytes(),
    );
    assert!(
        stdout(&output).contains("mode warn: never shed"),
        "{}",
        stdout(&output)
    );
    let output = sluice(&["docs", "-"], SHEDDING_ROLLOUT.as_bytes());
    let text = stdout(&output);
    assert!(
        text.contains("Load shedding of `api` is being rolled out: 25% of the requests")
            && text.contains("Load shedding of `search` is in warn mode")
            && text.contains("Load shedding of `rest` is in monitor mode"),
        "{text}"
    );
    let guaranteed = SHEDDING_ROLLOUT.replace(
        r#""mode": "monitor","#,
        r#""mode": "monitor", "guaranteed": {"premium": 0.2},"#,
    );
    let output = sluice(
        &["explain", "-", "--path", "/api/x", "-H", "x-class: premium"],
        guaranteed.as_bytes(),
    );
    assert!(
        stdout(&output)
            .contains("class premium shed from 90% of the limit, guaranteed 20% of the limit"),
        "{}",
        stdout(&output)
    );
    // A ramp of a bulkhead that does not enforce: the filter's message, naming the field.
    let bad = SHEDDING_ROLLOUT.replace(r#""mode": "warn""#, r#""mode": "warn", "ramp_percent": 5"#);
    let output = sluice(&["check", "-"], bad.as_bytes());
    assert_ne!(output.status.code(), Some(0));
    assert!(
        stderr(&output).contains("shedding.bulkheads[1].ramp_percent: ramps an enforce bulkhead"),
        "{}",
        stderr(&output)
    );
}

/// A curve, a percentile and a saturation header: every command says so.
const SHEDDING_CURVE: &str = r#"{"shedding": {"class_header": "x-class", "classes": {"basic": 1.0},
  "bulkheads": [{"name": "api", "limit": {"adaptive": {"min": 4, "max": 200, "percentile": 99}},
    "curve": [{"at": 0.7, "shed": 0.1}, {"at": 0.85, "shed": 0.5}],
    "saturation_header": "x-upstream-saturation"}]}}"#;

#[test]
fn check_explain_and_docs_know_the_curve_the_percentile_and_the_saturation_header() {
    let output = sluice(&["check", "-"], SHEDDING_CURVE.as_bytes());
    assert_eq!(
        stdout(&output),
        "valid: 0 rules; no counter service; shedding: 1 bulkhead, shed at random by a curve: \
         api, the upstream reports its saturation: api (x-upstream-saturation)\n"
    );
    let output = sluice(
        &["explain", "-", "--path", "/api/x", "-H", "x-class: basic"],
        SHEDDING_CURVE.as_bytes(),
    );
    let text = stdout(&output);
    assert!(
        text.contains("(adaptive, 4 to 200 in flight, by its p99 latency)")
            && text.contains("shed at random by the curve: 10% at 70%, 50% at 85%")
            && text.contains("response header x-upstream-saturation counts"),
        "{text}"
    );
    let output = sluice(
        &["explain", "-", "--path", "/api/x", "--json"],
        SHEDDING_CURVE.as_bytes(),
    );
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(
        json["shedding"]["curve"],
        serde_json::json!([[0.7, 0.1], [0.85, 0.5]])
    );
    assert_eq!(
        json["shedding"]["saturation_header"],
        "x-upstream-saturation"
    );
    let output = sluice(&["docs", "-"], SHEDDING_CURVE.as_bytes());
    assert!(
        stdout(&output).contains("a 503 with reason `curve` may come"),
        "{}",
        stdout(&output)
    );
    let bad = SHEDDING_CURVE.replace(r#""at": 0.85"#, r#""at": 0.6"#);
    let output = sluice(&["check", "-"], bad.as_bytes());
    assert!(
        stderr(&output).contains("shedding.bulkheads[0].curve[1].at: must be above"),
        "{}",
        stderr(&output)
    );
}

#[test]
fn explain_and_docs_refuse_an_invalid_configuration_with_the_filters_message() {
    let path = repo().join("core/tests/config/bad_template.json");
    let expected = std::fs::read_to_string(path.with_extension("err")).unwrap();
    for args in [
        &["explain", path.to_str().unwrap(), "--path", "/"][..],
        &["docs", path.to_str().unwrap()],
    ] {
        let output = sluice(args, b"");
        assert_eq!(output.status.code(), Some(1));
        assert_eq!(stderr(&output).trim_end(), expected.trim_end());
        assert_eq!(stdout(&output), "");
    }
}

#[test]
fn docs_tabulates_the_limits_per_endpoint_and_tier() {
    let output = sluice(&["docs", "-"], TIERS.as_bytes());
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let text = stdout(&output);
    let rows = [
        "| endpoint | methods | keyed by | tier | limits | cost | mode | rule |",
        "| `/api/*` | any | client IP | — | 100 per minute, bursts of up to 20 | 1 | enforced | `per-ip` |",
        "| `/users/{id}/export` on `api.example.com` | GET | token claim `sub`, else client IP | `free` (default) | 10 per day, resets daily at 00:00 UTC | 2 | enforced | `export/free` |",
        "| `/users/{id}/export` on `api.example.com` | GET | token claim `sub`, else client IP | `pro` | 1,000 per day, resets daily at 00:00 UTC | 2 | enforced | `export/pro` |",
        "| `/upload`, with header `x-api-key` | any | header `x-api-key` | — | 50 per second, paced (up to 6 at once; 20 more wait up to 500 ms) | 1 | enforced | `uploads` |",
        "| `/login` | POST | client network (IPv4 /24, IPv6 /64) | — | 5 in any minute | 1 | not enforced (monitored) | `login` |",
        "The tier of `export` is the request's token claim `plan`; requests without one, or of a tier not listed, count as `free`.",
        "Never limited: `/healthz`.",
    ];
    for row in rows {
        assert!(
            text.lines().any(|line| line == row),
            "missing {row:?} in\n{text}"
        );
    }
    assert!(text.starts_with("## Rate limits\n"));
    assert!(text.contains("`RateLimit-Policy` and `RateLimit`"));

    let output = sluice(&["docs", "-"], WITH_SERVICE.as_bytes());
    let text = stdout(&output);
    assert!(
        text.lines().any(|line| line
            == "| every path | any | header `x-api-key` | — | 1,000 per minute; 100,000 per day | 1 | enforced | `per-key` |"),
        "{text}"
    );

    let output = sluice(&["docs", "-"], SHEDDING_ONLY.as_bytes());
    assert_eq!(
        stdout(&output),
        "## Rate limits\n\nNo rate limits are configured.\n"
    );
}

/// Durations: `check` accepts them, `explain` writes them as the configuration reads them back,
/// `docs` in words, with a fixed window's epoch alignment.
#[test]
fn durations_are_checked_explained_and_documented() {
    let config = br#"{"service": {"cluster": "c"}, "rules": [
      {"name": "login", "key": ["client_ip"], "limits": [{"requests": 5, "per": "15m", "algorithm": "fixed_window"}]},
      {"name": "api", "key": ["client_ip"], "consistency": "cached", "limits": [{"requests": 100, "per": 10, "burst": 20}]},
      {"name": "slow", "key": ["client_ip"], "consistency": "strict", "limits": [{"requests": 10, "per": "6h", "algorithm": "sliding_log"}]}]}"#;
    let output = sluice(&["check", "-"], config);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let output = sluice(&["explain", "--path", "/", "-"], config);
    let text = stdout(&output);
    for line in [
        "   limits:      5 per 15m, fixed_window",
        "   limits:      100 per 10s, burst 20, token_bucket",
        "   limits:      10 per 6h, sliding_log",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing {line:?} in\n{text}"
        );
    }
    let output = sluice(&["docs", "-"], config);
    let text = stdout(&output);
    for cell in [
        "| 5 per 15 minutes, resets every 15 minutes counted from 1970-01-01 00:00 UTC |",
        "| 100 per 10 seconds, bursts of up to 20 |",
        "| 10 in any 6 hours |",
    ] {
        assert!(text.contains(cell), "missing {cell:?} in\n{text}");
    }
}

#[test]
fn login_fields_are_checked_explained_and_documented() {
    let config = br#"{"rules": [
      {"name": "login", "key": ["cookie:sid"], "count_when": {"statuses": [403, 401]},
       "penalty": "10m", "limits": [{"requests": 5, "per": "minute"}]}]}"#;
    let output = sluice(&["check", "-"], config);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let output = sluice(
        &["explain", "--path", "/", "--header", "cookie: sid=abc", "-"],
        config,
    );
    let text = stdout(&output);
    for line in [
        "   counted:     only when the response's status is 401, 403 (checked up front, spent after the answer)",
        "   penalty:     a key that goes over stays denied for 10m",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing {line:?} in\n{text}"
        );
    }
    let output = sluice(&["docs", "-"], config);
    let text = stdout(&output);
    for cell in [
        "1 when the response's status is 401, 403",
        "A client that goes over `login` is refused for 10m after",
    ] {
        assert!(text.contains(cell), "missing {cell:?} in\n{text}");
    }
    let counted = br#"{"rules": [{"name": "api", "key": ["client_ip"], "top_keys": 16,
       "limits": [{"requests": 5, "per": "minute"}]}]}"#;
    let output = sluice(
        &["explain", "--path", "/", "--client-ip", "192.0.2.1", "-"],
        counted,
    );
    let line = "   top keys:    the keys it admits and denies most, 16 counters of each per worker (sluice top; logged each minute without a service)";
    assert!(
        stdout(&output).lines().any(|l| l == line),
        "{}{}",
        stdout(&output),
        stderr(&output)
    );
    let bad = br#"{"rules": [{"name": "login", "key": ["client_ip"], "penalty": 0,
       "limits": [{"requests": 5, "per": "minute"}]}]}"#;
    let output = sluice(&["check", "-"], bad);
    assert_ne!(output.status.code(), Some(0));
    assert!(
        stderr(&output).contains("rules[0].penalty"),
        "{}",
        stderr(&output)
    );
}

#[test]
fn concurrent_limits_are_checked_explained_and_documented() {
    let config = br#"{"rules": [
      {"name": "inflight", "key": ["header:x-api-key"], "limits": [{"concurrent": 10, "max_hold": "5m"}]}]}"#;
    let output = sluice(&["check", "-"], config);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let output = sluice(
        &["explain", "--path", "/", "-H", "x-api-key: k1", "-"],
        config,
    );
    let text = stdout(&output);
    let line = "   limits:      10 in flight at once, max_hold 5m, concurrency";
    assert!(
        text.lines().any(|l| l == line),
        "missing {line:?} in\n{text}"
    );
    let output = sluice(&["explain", "--json", "--path", "/", "-"], config);
    let json: Value = serde_json::from_str(&stdout(&output)).unwrap();
    let limit = &json["rules"][0]["limits"][0];
    assert_eq!(limit["requests"], 10, "{json}");
    assert_eq!(limit["per"], "in flight", "{json}");
    assert_eq!(limit["max_hold"], "5m", "{json}");
    let text = stdout(&sluice(&["docs", "-"], config));
    assert!(
        text.contains(
            "| 10 requests in flight at once (a further one is answered 429, Retry-After: 1) |"
        ),
        "{text}"
    );
    assert!(
        text.contains("A limit of requests in flight counts a request"),
        "{text}"
    );
    // Refused as the filter refuses it, the field named.
    let cached = br#"{"service": {"cluster": "c"}, "rules": [
      {"name": "inflight", "key": ["client_ip"], "consistency": "cached", "limits": [{"concurrent": 10}]}]}"#;
    let output = sluice(&["check", "-"], cached);
    assert_ne!(output.status.code(), Some(0));
    assert!(
        stderr(&output).contains("rules[0].consistency"),
        "{}",
        stderr(&output)
    );
}

const REGENERATE: &str = "cargo run -p sluice-cli -- schema > schema/sluice.schema.json";

#[test]
fn the_committed_schema_is_what_the_code_generates() {
    let path = repo().join("schema/sluice.schema.json");
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    let output = sluice(&["schema"], b"");
    assert_eq!(output.status.code(), Some(0));
    assert!(
        stdout(&output) == committed,
        "schema/sluice.schema.json differs from the schema the configuration's types make: \
         regenerate it with `{REGENERATE}`"
    );
}

fn schema() -> Value {
    let output = sluice(&["schema"], b"");
    serde_json::from_str(&stdout(&output)).unwrap()
}

fn property_names(object: &Value) -> Vec<&str> {
    let mut names: Vec<&str> = object["properties"]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    names.sort();
    names
}

#[test]
fn the_schema_lists_the_fields_of_the_configuration_and_of_a_rule() {
    let schema = schema();
    assert_eq!(schema["$schema"], "http://json-schema.org/draft-07/schema#");
    assert_eq!(schema["type"], "object");
    assert_eq!(schema["additionalProperties"], false);
    assert_eq!(
        property_names(&schema),
        [
            "access_log",
            "bypass",
            "client_ip",
            "docs_url",
            "headers",
            "host",
            "jwt_payload_in_metadata",
            "max_keys",
            "rules",
            "service",
            "shedding",
            "x_ratelimit_reset"
        ]
    );
    assert_eq!(
        schema["properties"]["rules"]["items"]["$ref"],
        "#/definitions/Rule"
    );

    let rule = &schema["definitions"]["Rule"];
    assert_eq!(rule["additionalProperties"], false);
    assert_eq!(
        property_names(rule),
        [
            "consistency",
            "cost",
            "cost_header",
            "count_when",
            "deny_message",
            "deny_status",
            "fallback",
            "headers_on_admitted",
            "headers_on_denied",
            "key",
            "limits",
            "limits_from",
            "match",
            "mode",
            "name",
            "penalty",
            "query_names",
            "quota_path",
            "quota_path_any_key",
            "ramp_percent",
            "scale",
            "schedule",
            "tiers",
            "top_keys",
            "when_missing"
        ]
    );
    assert_eq!(rule["required"], serde_json::json!(["name", "key"]));
    let limit = &schema["definitions"]["Limit"];
    assert_eq!(limit["required"], Value::Null);
    assert_eq!(
        limit["anyOf"],
        serde_json::json!([{"required": ["requests", "per"]}, {"required": ["concurrent"]}]),
        "a rate, or requests in flight"
    );
    assert_eq!(
        schema["definitions"]["Match"]["properties"]["methods"]["default"],
        serde_json::json!([])
    );
}

#[test]
fn every_field_of_the_schema_is_described() {
    let schema = schema();
    let mut objects = vec![("(top level)".to_string(), &schema)];
    for (name, definition) in schema["definitions"].as_object().unwrap() {
        objects.push((name.clone(), definition));
        for variant in definition["oneOf"].as_array().into_iter().flatten() {
            objects.push((name.clone(), variant));
        }
    }
    for (name, object) in objects {
        let described = object.get("description").is_some();
        assert!(described, "{name} has no description");
        let Some(properties) = object.get("properties").and_then(Value::as_object) else {
            continue;
        };
        for (field, property) in properties {
            let described = property.get("description").is_some() || name == "BulkheadLimit";
            assert!(described, "{name}.{field} has no description");
        }
    }
}

/// The values the schema offers an editor are values the filter accepts.
#[test]
fn every_value_the_schema_lists_is_accepted_by_the_filter() {
    let schema = schema();
    let values = |pointer: &str| -> Vec<String> {
        schema
            .pointer(pointer)
            .and_then(|p| p["enum"].as_array())
            .unwrap_or_else(|| panic!("{pointer} lists no values"))
            .iter()
            .filter_map(|v| v.as_str().map(str::to_string))
            .collect()
    };
    let accepts = |config: String| {
        if let Err(e) = sluice_core::parse(config.as_bytes()) {
            panic!("{config}: {e}");
        }
    };
    let service = r#""service": {"cluster": "c"}"#;
    for headers in values("/properties/headers") {
        accepts(format!(
            r#"{{"headers": "{headers}", "rules": [{{"name": "a", "key": ["const:all"], "limits": [{{"requests": 5, "per": "second"}}]}}]}}"#
        ));
    }
    for mode in values("/definitions/Rule/properties/mode") {
        accepts(format!(
            r#"{{"rules": [{{"name": "a", "key": ["const:all"], "mode": "{mode}", "limits": [{{"requests": 5, "per": "second"}}]}}]}}"#
        ));
    }
    for consistency in values("/definitions/Rule/properties/consistency") {
        accepts(format!(
            r#"{{{service}, "rules": [{{"name": "a", "key": ["const:all"], "consistency": "{consistency}", "limits": [{{"requests": 5, "per": "second"}}]}}]}}"#
        ));
    }
    for policy in values("/definitions/Fallback/properties/policy") {
        accepts(format!(
            r#"{{{service}, "rules": [{{"name": "a", "key": ["const:all"], "fallback": {{"policy": "{policy}"}}, "limits": [{{"requests": 5, "per": "second"}}]}}]}}"#
        ));
    }
    for share in values("/definitions/Fallback/properties/share") {
        accepts(format!(
            r#"{{{service}, "rules": [{{"name": "a", "key": ["const:all"], "fallback": {{"policy": "fail_open", "share": "{share}", "assume_proxies": 3, "max_proxies": 3}}, "limits": [{{"requests": 5, "per": "second"}}]}}]}}"#
        ));
    }
    for field in ["assume_proxies", "max_proxies"] {
        let bounds = &schema["definitions"]["Fallback"]["properties"][field];
        assert_eq!(
            (&bounds["minimum"], &bounds["maximum"]),
            (&serde_json::json!(1), &serde_json::json!(100000)),
            "{field}"
        );
    }
    let algorithms = values("/definitions/Limit/properties/algorithm");
    assert_eq!(algorithms.len(), 7);
    for algorithm in &algorithms {
        let limit = match algorithm.as_str() {
            "concurrency" => r#"{"concurrent": 5, "algorithm": "concurrency"}"#.to_string(),
            _ => format!(r#"{{"requests": 5, "per": "minute", "algorithm": "{algorithm}"}}"#),
        };
        accepts(format!(
            r#"{{"rules": [{{"name": "a", "key": ["const:all"], "limits": [{limit}]}}]}}"#
        ));
    }
    for max_hold in values("/definitions/Limit/properties/max_hold/oneOf/0") {
        accepts(format!(
            r#"{{"rules": [{{"name": "a", "key": ["const:all"], "limits": [{{"concurrent": 5, "max_hold": "{max_hold}"}}]}}]}}"#
        ));
    }
    let max_hold = &schema["definitions"]["Limit"]["properties"]["max_hold"]["oneOf"];
    assert_eq!(max_hold[1]["pattern"], "^[0-9]+[smhd]$");
    let most = max_hold[2]["maximum"].as_u64().unwrap();
    for (held, ok) in [
        ("1", true),
        (&most.to_string(), true),
        ("0", false),
        (&(most + 1).to_string(), false),
    ] {
        let config = format!(
            r#"{{"rules": [{{"name": "a", "key": ["const:all"], "limits": [{{"concurrent": 5, "max_hold": {held}}}]}}]}}"#
        );
        assert_eq!(sluice_core::parse(config.as_bytes()).is_ok(), ok, "{held}");
    }
    for per in values("/definitions/Limit/properties/per/oneOf/0") {
        accepts(format!(
            r#"{{"rules": [{{"name": "a", "key": ["const:all"], "limits": [{{"requests": 5, "per": "{per}", "algorithm": "fixed_window"}}]}}]}}"#
        ));
    }
    // A duration as the schema's pattern allows it, and a number of seconds within its bounds.
    let per = &schema["definitions"]["Limit"]["properties"]["per"]["oneOf"];
    assert_eq!(per[1]["pattern"], "^[0-9]+[smhd]$");
    let (least, most) = (
        per[2]["minimum"].as_u64().unwrap(),
        per[2]["maximum"].as_u64().unwrap(),
    );
    for per in [
        "\"15m\"".to_string(),
        "\"10s\"".to_string(),
        "\"6h\"".to_string(),
        "\"2d\"".to_string(),
        least.to_string(),
        most.to_string(),
    ] {
        accepts(format!(
            r#"{{"rules": [{{"name": "a", "key": ["const:all"], "limits": [{{"requests": 5, "per": {per}, "algorithm": "fixed_window"}}]}}]}}"#
        ));
    }
    for per in [(least - 1).to_string(), (most + 1).to_string()] {
        let config = format!(
            r#"{{"rules": [{{"name": "a", "key": ["const:all"], "limits": [{{"requests": 5, "per": {per}}}]}}]}}"#
        );
        assert!(sluice_core::parse(config.as_bytes()).is_err(), "{per}");
    }
    for mode in values("/definitions/Shedding/properties/mode") {
        accepts(format!(
            r#"{{"shedding": {{"mode": "{mode}", "bulkheads": [{{"name": "b", "limit": {{"static": 4}}}}]}}}}"#
        ));
    }
    for mode in values("/definitions/Bulkhead/properties/mode") {
        accepts(format!(
            r#"{{"shedding": {{"bulkheads": [{{"name": "b", "limit": {{"static": 4}}, "mode": "{mode}"}}]}}}}"#
        ));
    }
    for drop in values("/definitions/Queue/properties/drop") {
        accepts(format!(
            r#"{{"shedding": {{"bulkheads": [{{"name": "b", "limit": {{"static": 4}}, "queue": {{"size": 4, "max_wait_ms": 10, "drop": "{drop}"}}}}]}}}}"#
        ));
    }
}

/// Whatever the input, an answer and an exit status, never a panic.
#[test]
fn odd_inputs_get_an_answer_not_a_panic() {
    let deep = format!("{}{}", "[".repeat(5000), "]".repeat(5000));
    let inputs: [&[u8]; 6] = [
        b"\xff\xfe\x00garbage",
        b"null",
        b"{\"rules\": 7}",
        deep.as_bytes(),
        b"{\"rules\": [{\"name\": \"a\", \"key\": [\"const:all\"], \"limits\": [{\"requests\": 18446744073709551615, \"per\": \"second\"}]}]}",
        b"{\"rules\": [{\"name\": \"a\", \"key\": [\"const:all\"], \"limits\": [{\"requests\": 1e400, \"per\": \"second\"}]}]}",
    ];
    for input in inputs {
        for args in [
            &["check", "-"][..],
            &["docs", "-"],
            &["explain", "-", "--path", "/"],
        ] {
            let output = sluice(args, input);
            assert_eq!(output.status.code(), Some(1), "{args:?}");
            let message = stderr(&output);
            assert!(!message.contains("panicked"), "{message}");
            let expected = sluice_core::parse(input).unwrap_err().to_string();
            assert_eq!(message, format!("{expected}\n"));
        }
    }
    // Odd requests against a valid configuration.
    for path in ["/%ff%00/..%2f..", "/users//export", "/?a=%zz&a", "/\u{1f}x"] {
        let output = sluice(
            &[
                "explain",
                "-",
                "--path",
                path,
                "-H",
                &format!("x-api-key: {path}"),
            ],
            TIERS.as_bytes(),
        );
        assert_eq!(output.status.code(), Some(0), "{path}: {}", stderr(&output));
    }
}

/// `check`, `explain` and `docs` know a rule's `scale`, `schedule` and `quota_path`.
#[test]
fn the_cli_knows_limits_that_follow_load_and_time_and_the_quota_path() {
    let config = br#"{"shedding": {"bulkheads": [{"name": "all", "limit": {"static": 100}}]},
        "rules": [{"name": "api", "key": ["client_ip"], "quota_path": "/rate_limit",
        "limits": [{"requests": 100, "per": "minute"}],
        "scale": {"high": 0.5, "critical": 0.25},
        "schedule": [{"utc": "22:00-06:00", "limits": [{"requests": 20, "per": "minute"}]}]}]}"#;
    let output = sluice(&["check", "-"], config);
    assert!(output.status.success(), "{}", stderr(&output));
    let out = stdout(&output);
    assert!(
        out.contains("limits that follow load or time: api scaled by the proxy level and scheduled 22:00-06:00 UTC"),
        "{out}"
    );
    assert!(out.contains("quota paths: /rate_limit (api)"), "{out}");
    let output = sluice(&["explain", "--path", "/", "-"], config);
    let out = stdout(&output);
    assert!(
        out.contains("   scale:       ×0.5 at high, ×0.25 at critical"),
        "{out}"
    );
    assert!(out.contains("   schedule:    22:00-06:00 UTC: 20"), "{out}");
    assert!(
        out.contains("   quota path:  /rate_limit answers the caller's own quota of this rule"),
        "{out}"
    );
    let any_key = String::from_utf8_lossy(config).replace(
        r#""key": ["client_ip"], "quota_path": "/rate_limit","#,
        r#""key": ["header:x-user"], "quota_path": "/rate_limit", "quota_path_any_key": true,"#,
    );
    let output = sluice(&["explain", "--path", "/", "-"], any_key.as_bytes());
    assert!(
        stdout(&output).contains(
            "   quota path:  /rate_limit answers the quota of any key the caller names (quota_path_any_key)"
        ),
        "{}{}",
        stdout(&output),
        stderr(&output)
    );
    let output = sluice(&["docs", "-"], config);
    let out = stdout(&output);
    assert!(
        out.contains("From 22:00 to 06:00 UTC, `api` allows 20"),
        "{out}"
    );
    assert!(out.contains("Under load, `api` allows less"), "{out}");
    assert!(
        out.contains("`GET /rate_limit` answers your own quota of `api`"),
        "{out}"
    );
}

const LIMITS_FROM: &str = r#"{"rules": [{"name": "api", "key": ["jwt:sub"],
    "limits": [{"requests": 100, "per": "minute"}],
    "limits_from": {"from": "jwt:rate_per_minute", "max": 5000}}]}"#;

#[test]
fn check_explain_and_docs_know_a_limit_read_from_the_request() {
    let output = sluice(&["check", "-"], LIMITS_FROM.as_bytes());
    assert_eq!(stdout(&output), "valid: 1 rule; no counter service\n");
    let explain = |claim: &str| {
        let output = sluice(
            &[
                "explain",
                "-",
                "--path",
                "/x",
                "--claim",
                "sub=alice",
                "--claim",
                claim,
                "--json",
            ],
            LIMITS_FROM.as_bytes(),
        );
        let report: Value = serde_json::from_str(&stdout(&output)).unwrap();
        report["rules"][0].clone()
    };
    let rule = explain("rate_per_minute=9000");
    assert_eq!(rule["limits"][0]["requests"], 5000, "{rule}");
    assert_eq!(
        rule["limits_from"],
        serde_json::json!({"from": "jwt:rate_per_minute", "max": 5000, "value": "9000", "used": true})
    );
    let rule = explain("rate_per_minute=-1");
    assert_eq!(rule["limits"][0]["requests"], 100, "{rule}");
    assert_eq!(rule["limits_from"]["used"], false, "{rule}");
    let output = sluice(
        &[
            "explain",
            "-",
            "--path",
            "/x",
            "--claim",
            "sub=alice",
            "--claim",
            "rate_per_minute=250",
        ],
        LIMITS_FROM.as_bytes(),
    );
    assert!(
        stdout(&output).contains(
            "limit from:  jwt:rate_per_minute, at most 5000 (this request's \"250\" set the limit above)"
        ),
        "{}",
        stdout(&output)
    );
    let output = sluice(&["docs", "-"], LIMITS_FROM.as_bytes());
    assert!(
        stdout(&output).contains(
            "`api`'s limit is your own when your request carries it as its token claim `rate_per_minute` \
             (requests per minute, a whole number, at most 5000)"
        ),
        "{}",
        stdout(&output)
    );
}
