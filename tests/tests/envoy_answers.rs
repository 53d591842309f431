//! What a client sees of sluice's local replies in a real Envoy: one contract for every body (checked against
//! `schema/reply.schema.json`), gRPC answers for gRPC clients (a real `grpcio` client and server, through Envoy
//! over HTTP/2), and each rule's own answer. Run with `make test`, which builds the filter, installs Envoy and
//! grpcio into .venv, and sets `SLUICE_ENVOY` and `SLUICE_WASM`.

use serde_json::{json, Value};
use sluice_tests::contract::checked_body;
use sluice_tests::envoy::{
    agent, free_ports, get, repo_root, wasm_path, Envoy, EnvoyOptions, Reply, Template,
};
use sluice_tests::grpc::{calls, GrpcAnswer, GrpcServer};

/// Envoy in front of `server` (over HTTP/2), the counter service's port closed (strict rules cannot reach it).
fn start(server: &GrpcServer, plugin: Value) -> Envoy {
    let closed = free_ports(1).unwrap()[0];
    Envoy::start(EnvoyOptions {
        template: Template::File(repo_root().join("envoy/sluice-grpc.yaml.tmpl")),
        plugin_config_json: plugin.to_string(),
        concurrency: 2,
        placeholders: vec![
            ("UPSTREAM_PORT".into(), server.port.to_string()),
            ("SERVICE_PORT".into(), closed.to_string()),
            ("WASM".into(), wasm_path().unwrap().display().to_string()),
        ],
    })
    .unwrap()
}

fn target(envoy: &Envoy) -> String {
    format!("127.0.0.1:{}", envoy.listen_port)
}

/// A strict rule that fails closed on requests under `prefix`.
fn closed(name: &str, prefix: &str) -> Value {
    json!({"name": name, "match": {"path_prefix": prefix}, "key": ["const:all"],
           "consistency": "strict", "fallback": {"policy": "fail_closed"},
           "limits": [{"requests": 100, "per": "second"}]})
}

fn service() -> Value {
    json!({"cluster": "sluice_service", "timeout_ms": 200, "breaker_failures": 1000})
}

/// The seconds of `Retry-After` in a gRPC answer's metadata, and its pushback in milliseconds.
#[track_caller]
fn waits(answer: &GrpcAnswer) -> (u64, u64) {
    let number = |name: &str| -> u64 {
        answer
            .trailing
            .get(name)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {answer:?}"))
    };
    (number("retry-after"), number("grpc-retry-pushback-ms"))
}

#[test]
fn a_rate_limited_grpc_call_gets_resource_exhausted_and_a_pushback() {
    let server = GrpcServer::start().unwrap();
    let envoy = start(
        &server,
        json!({"headers": "both", "rules": [
            {"name": "limited", "match": {"path_prefix": "/sluice.Test/Limited"}, "key": ["const:all"],
             "limits": [{"requests": 2, "per": "minute"}]}]}),
    );
    let answers = calls(&target(&envoy), "/sluice.Test/Limited", 3, false).unwrap();
    let codes: Vec<u32> = answers.iter().map(|a| a.code).collect();
    assert_eq!(
        codes,
        [0, 0, 8],
        "two admitted, then RESOURCE_EXHAUSTED: {answers:?}"
    );
    assert_eq!(answers[0].response.as_deref(), Some("ok"), "{answers:?}");
    let denied = &answers[2];
    assert_eq!(
        denied.details, "rate limit exceeded: 2 requests per minute for rule limited",
        "{denied:?}"
    );
    let (retry_after, pushback) = waits(denied);
    // One token of 2 a minute comes back every 30 s.
    assert!((29..=30).contains(&retry_after), "{denied:?}");
    assert_eq!(pushback, retry_after * 1_000, "{denied:?}");
    assert_eq!(
        denied
            .trailing
            .get("x-ratelimit-remaining")
            .map(String::as_str),
        Some("0")
    );
}

#[test]
fn a_grpc_call_refused_by_a_rule_failing_closed_gets_unavailable_and_an_http_client_the_contract() {
    let server = GrpcServer::start().unwrap();
    let envoy = start(
        &server,
        json!({"service": service(), "rules": [
            closed("closed", "/sluice.Test/Closed"), closed("closed-http", "/closed")]}),
    );
    let answers = calls(&target(&envoy), "/sluice.Test/Closed", 1, false).unwrap();
    let refused = &answers[0];
    assert_eq!(refused.code, 14, "UNAVAILABLE: {refused:?}");
    assert!(
        refused.details.contains("rule closed fails closed"),
        "{refused:?}"
    );
    let (retry_after, pushback) = waits(refused);
    assert_eq!(pushback, retry_after * 1_000, "{refused:?}");

    let reply = get(&agent(), &envoy.url("/closed"), &[]).unwrap();
    assert_eq!(reply.status, 503, "{reply:?}");
    let body = checked_body(&reply.body);
    assert_eq!(body["error"], "limiter_unavailable", "{body}");
    assert_eq!(body["rule"], "closed-http", "{body}");
    let retry_after: u64 = reply.header("retry-after").unwrap().parse().unwrap();
    assert_eq!(body["retryAfter"], retry_after, "{body}");
}

#[test]
fn grpc_failures_count_against_the_success_rate_and_a_shed_grpc_call_gets_unavailable() {
    let server = GrpcServer::start().unwrap();
    let envoy = start(
        &server,
        json!({"shedding": {"bulkheads": [{"name": "grpc", "limit": {"static": 1000},
               "success_rate": {"threshold": 0.9, "min_requests": 10}}]}}),
    );
    // Every call fails upstream (HTTP 200, grpc-status 14): counted as failures, they raise the rejection
    // probability (0.95 at most) once the bulkhead's window ends; sluice then sheds calls itself. Bounded.
    let answers = calls(&target(&envoy), "/sluice.Test/Fail", 1_000, true).unwrap();
    let shed_at = answers
        .iter()
        .position(|a| a.trailing.contains_key("x-sluice-shed"))
        .unwrap_or_else(|| {
            panic!(
                "no call shed in {} failing calls: gRPC failures were not counted; {:?}",
                answers.len(),
                envoy.sluice_stats()
            )
        });
    assert!(
        shed_at >= 10,
        "fewer answers than min_requests never reject: {shed_at}"
    );
    for upstream in &answers[..shed_at] {
        assert_eq!(
            (upstream.code, upstream.details.as_str()),
            (14, "upstream down")
        );
    }
    let shed = &answers[shed_at];
    assert_eq!(shed.code, 14, "UNAVAILABLE: {shed:?}");
    assert_eq!(
        shed.trailing.get("x-sluice-shed").map(String::as_str),
        Some("errors")
    );
    assert_eq!(
        shed.details, "the upstream is overloaded (errors)",
        "{shed:?}"
    );
    let (retry_after, pushback) = waits(shed);
    assert_eq!((retry_after, pushback), (1, 1_000), "{shed:?}");
    assert!(envoy.stat("wasmcustom.sluice.shed.grpc.shed.errors") >= 1);
}

#[test]
fn an_admitted_grpc_call_reaches_the_upstream() {
    let server = GrpcServer::start().unwrap();
    let envoy = start(
        &server,
        json!({"rules": [{"name": "roomy", "key": ["const:all"],
               "limits": [{"requests": 100, "per": "minute"}]}]}),
    );
    let answers = calls(&target(&envoy), "/sluice.Test/Ok", 2, false).unwrap();
    for answer in &answers {
        assert_eq!(
            (answer.code, answer.response.as_deref()),
            (0, Some("ok")),
            "{answers:?}"
        );
    }
}

/// Whether a reply carries rate-limit headers (either style).
fn limit_headers(reply: &Reply) -> bool {
    reply
        .headers
        .iter()
        .any(|(n, _)| n.starts_with("x-ratelimit") || n.starts_with("ratelimit"))
}

/// A message with what would break JSON or a header if it were copied as it is.
const MESSAGE: &str = r#"Exports: "1 a minute" \ 100% — {"retryAfter":0}"#;

#[test]
fn a_rule_answers_with_its_own_status_message_and_headers() {
    let envoy = Envoy::start(EnvoyOptions {
        template: Template::Sluice,
        plugin_config_json: json!({"headers": "both", "x_ratelimit_reset": "unix", "rules": [
            {"name": "export", "match": {"path_prefix": "/export"}, "key": ["const:all"],
             "deny_status": 503, "deny_message": MESSAGE, "headers_on_denied": false,
             "limits": [{"requests": 1, "per": "minute"}]},
            {"name": "quiet", "match": {"path_prefix": "/quiet"}, "key": ["const:all"],
             "headers_on_admitted": false, "limits": [{"requests": 5, "per": "minute"}]},
            {"name": "loud", "match": {"path_prefix": "/loud"}, "key": ["const:all"],
             "limits": [{"requests": 1, "per": "minute"}]}]})
        .to_string(),
        concurrency: 2,
        ..EnvoyOptions::default()
    })
    .unwrap();
    let client = agent();
    let get = |path: &str| get(&client, &envoy.url(path), &[]).unwrap();

    assert_eq!(get("/export").status, 200);
    let denied = get("/export");
    assert_eq!(denied.status, 503, "the rule's status: {denied:?}");
    let body = checked_body(&denied.body);
    assert_eq!(body["error"], "rate_limited", "{body}");
    assert_eq!(body["message"], MESSAGE, "{body}");
    assert_eq!(body["rule"], "export", "{body}");
    let retry_after: u64 = denied.header("retry-after").unwrap().parse().unwrap();
    assert_eq!(body["retryAfter"], retry_after, "{body}");
    assert!(!limit_headers(&denied), "hidden on denials: {denied:?}");

    let quiet = get("/quiet");
    assert_eq!(quiet.status, 200);
    assert!(!limit_headers(&quiet), "hidden when admitted: {quiet:?}");

    // Shown by default; X-RateLimit-Reset as a Unix time: whole again a minute after the request.
    let before = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let loud = get("/loud");
    let reset: u64 = loud.header("x-ratelimit-reset").unwrap().parse().unwrap();
    assert!(
        (before + 59..=before + 62).contains(&reset),
        "{reset} vs now {before}: {loud:?}"
    );
    assert_eq!(
        loud.header("ratelimit"),
        Some(r#""loud";r=0;t=60"#),
        "{loud:?}"
    );
    let denied = get("/loud");
    assert_eq!(denied.status, 429, "the default: {denied:?}");
    assert!(limit_headers(&denied), "{denied:?}");
    checked_body(&denied.body);
}

#[test]
fn a_grpc_client_reads_a_rules_own_message_whatever_its_status() {
    let server = GrpcServer::start().unwrap();
    let envoy = start(
        &server,
        json!({"rules": [{"name": "custom", "match": {"path_prefix": "/sluice.Test/Custom"},
               "key": ["const:all"], "deny_status": 503, "deny_message": MESSAGE,
               "limits": [{"requests": 1, "per": "minute"}]}]}),
    );
    let answers = calls(&target(&envoy), "/sluice.Test/Custom", 2, false).unwrap();
    assert_eq!(answers[0].code, 0, "{answers:?}");
    assert_eq!(answers[1].code, 8, "RESOURCE_EXHAUSTED: {answers:?}");
    assert_eq!(answers[1].details, MESSAGE, "decoded as sent: {answers:?}");
}

/// A rule on a UTC schedule and its quota path, in Envoy: during a window around the current UTC time the
/// window's limit is counted and reported (headers, Retry-After); `/rate_limit` answers the caller's own quota
/// of it without spending it or reaching the upstream, and only on that exact path.
#[test]
fn a_scheduled_limit_is_reported_and_the_quota_path_reads_it_without_spending() {
    let now_s = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let minute = (now_s % 86_400) / 60;
    let hm = |m: u64| format!("{:02}:{:02}", (m % 1_440) / 60, m % 60);
    // Two hours around now, across midnight when now is near it.
    let window = format!("{}-{}", hm(minute + 1_440 - 60), hm(minute + 60));
    let envoy = Envoy::start(EnvoyOptions {
        template: Template::Sluice,
        plugin_config_json: json!({"headers": "both", "rules": [
            {"name": "api", "match": {"path_prefix": "/api/"}, "key": ["header:x-user"],
             "quota_path": "/rate_limit", "quota_path_any_key": true,
             "limits": [{"requests": 50, "per": "minute"}],
             "schedule": [{"utc": window, "limits": [{"requests": 2, "per": "minute"}]}]}]})
        .to_string(),
        concurrency: 2,
        ..EnvoyOptions::default()
    })
    .unwrap();
    let client = agent();
    let get = |path: &str, user: &str| get(&client, &envoy.url(path), &[("x-user", user)]).unwrap();
    let quota = |user: &str| -> Value {
        let reply = get("/rate_limit", user);
        assert_eq!(reply.status, 200, "{reply:?}");
        assert_eq!(
            reply.header("content-type"),
            Some("application/json"),
            "{reply:?}"
        );
        serde_json::from_str::<Value>(&reply.body).unwrap()["rules"]["api"].clone()
    };
    for _ in 0..5 {
        let q = quota("alice");
        assert_eq!(
            (q["limit"].as_u64(), q["remaining"].as_u64()),
            (Some(2), Some(2)),
            "{q}"
        );
    }
    assert_eq!(
        get("/api/x", "alice").status,
        200,
        "the quota reads spent nothing"
    );
    let admitted = get("/api/x", "alice");
    assert_eq!(admitted.status, 200);
    assert_eq!(
        admitted.header("ratelimit-policy"),
        Some(r#""api";q=2;w=60"#)
    );
    let denied = get("/api/x", "alice");
    assert_eq!(denied.status, 429, "{denied:?}");
    assert_eq!(denied.header("x-ratelimit-limit"), Some("2"), "{denied:?}");
    assert_eq!(denied.header("retry-after"), Some("30"), "{denied:?}");
    assert_eq!(quota("alice")["remaining"], 0);
    assert_eq!(quota("bob")["remaining"], 2, "another key is its own");
    // Only the exact path: the upstream answers the others.
    for path in ["/rate_limit/", "/Rate_Limit", "/rate_limit2"] {
        let reply = get(path, "alice");
        assert!(!reply.body.contains("\"rules\""), "{path}: {reply:?}");
    }
}

/// A quota path answers only for keys the caller cannot choose: a rule keyed by a header any client sends (here an
/// account's name, with a penalty) and a quota path, without `quota_path_any_key`, is refused at load, naming the
/// field, so an anonymous client cannot read another account's remaining requests or the end of its penalty by
/// naming the account.
#[test]
fn a_quota_path_keyed_by_a_header_the_client_sends_is_refused_without_the_opt_in() {
    let refusal = Envoy::start_expect_failure(EnvoyOptions {
        template: Template::Sluice,
        plugin_config_json: json!({"rules": [
            {"name": "login", "match": {"path_prefix": "/login"}, "key": ["header:x-account"],
             "quota_path": "/rate_limit", "penalty": "10m",
             "limits": [{"requests": 5, "per": "minute"}]}]})
        .to_string(),
        concurrency: 2,
        ..EnvoyOptions::default()
    })
    .unwrap();
    let line = refusal
        .log
        .lines()
        .find(|l| l.contains("sluice: invalid configuration"))
        .unwrap_or_else(|| panic!("no refusal in Envoy's log:\n{}", refusal.log));
    assert!(
        line.contains("rules[0].quota_path: the key part header:x-account is sent by the caller")
            && line.contains("quota_path_any_key"),
        "{line}"
    );
}

/// Probes of a quota path are limited like any request: a per-address rule that matches the path spends a token
/// on each and answers 429 past its limit, whatever else the probe names; the rule answering the path spends
/// nothing of the key it reports.
#[test]
fn quota_path_probes_past_a_per_address_limit_get_429() {
    let envoy = Envoy::start(EnvoyOptions {
        template: Template::Sluice,
        plugin_config_json: json!({"rules": [
            {"name": "per-ip", "key": ["client_ip"], "limits": [{"requests": 3, "per": "minute"}]},
            {"name": "api", "match": {"path_prefix": "/api/"}, "key": ["client_ip"],
             "quota_path": "/rate_limit", "limits": [{"requests": 10, "per": "minute"}]}]})
        .to_string(),
        concurrency: 2,
        ..EnvoyOptions::default()
    })
    .unwrap();
    let client = agent();
    let mut statuses = Vec::new();
    for user in ["alice", "bob", "carol", "dave", "erin"] {
        let reply = get(&client, &envoy.url("/rate_limit"), &[("x-user", user)]).unwrap();
        if reply.status == 200 {
            let body: Value = serde_json::from_str(&reply.body).unwrap();
            assert_eq!(body["rules"]["api"]["remaining"], 10, "{reply:?}");
        } else {
            let body = checked_body(&reply.body);
            assert_eq!(
                (&body["error"], &body["rule"]),
                (&json!("rate_limited"), &json!("per-ip")),
                "{reply:?}"
            );
        }
        statuses.push(reply.status);
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429], "3 probes an address");
}
