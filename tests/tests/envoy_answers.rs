//! What a client sees of sluice's local replies in a real Envoy: one contract for every body (checked against
//! `schema/reply.schema.json`), gRPC answers for gRPC clients (a real `grpcio` client and server, through Envoy
//! over HTTP/2), and each rule's own answer. Run with `make test`, which builds the filter, installs Envoy and
//! grpcio into .venv, and sets `SLUICE_ENVOY` and `SLUICE_WASM`.

use serde_json::{json, Value};
use sluice_tests::contract::checked_body;
use sluice_tests::envoy::{
    agent, free_ports, get, repo_root, wasm_path, Envoy, EnvoyOptions, Template,
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
