//! Every local reply the filter can send, each kind's body checked against the committed JSON
//! Schema (`schema/reply.schema.json`), its headers against its body, and each kind's gRPC answer.

use serde_json::Value;
use sluice_core::protocol::CheckResponse;
use sluice_core::reply::{self, Protocol, GRPC_RESOURCE_EXHAUSTED, GRPC_UNAVAILABLE};
use sluice_core::shed::{Level, Seat, ShedReason};
use sluice_core::{Exchange, Limiter, MemoryStore, Moment, PlainRequest, Reply, Step};

const SECOND: u64 = 1_000_000;
const T0: u64 = 1_700_000_000 * SECOND;

fn validator() -> jsonschema::Validator {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../schema/reply.schema.json");
    let text = std::fs::read_to_string(path).unwrap();
    let schema: Value = serde_json::from_str(&text).unwrap();
    jsonschema::validator_for(&schema).unwrap()
}

fn limiter(json: &str) -> Limiter {
    Limiter::new(sluice_core::parse(json.as_bytes()).unwrap())
}

/// The body, valid against the schema, with `Retry-After` and the content type it promises.
#[track_caller]
fn checked(reply: &Reply) -> Value {
    let body: Value = serde_json::from_str(&reply.body)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", reply.body));
    let validator = validator();
    let errors: Vec<String> = validator
        .iter_errors(&body)
        .map(|e| format!("{} at {}", e, e.instance_path()))
        .collect();
    assert!(errors.is_empty(), "{}: {errors:?}", reply.body);
    let retry: u64 = reply.headers.get("retry-after").unwrap().parse().unwrap();
    assert_eq!(body["retryAfter"], retry, "{reply:?}");
    assert_eq!(
        reply.headers.get("content-type"),
        Some("application/json"),
        "{reply:?}"
    );
    assert_eq!(reply.grpc_status, None, "{reply:?}");
    body
}

/// The gRPC answer: no body, the status, the message percent-encoded, the wait in
/// `grpc-retry-pushback-ms`.
#[track_caller]
fn grpc_checked(reply: &Reply, status: u32, http: &Reply) {
    assert_eq!(reply.grpc_status, Some(status), "{reply:?}");
    assert_eq!(
        reply.details, http.details,
        "one name in the log, whatever the protocol"
    );
    assert!(reply.body.is_empty(), "{reply:?}");
    assert_eq!(
        reply.headers.get("content-type"),
        None,
        "Envoy's: {reply:?}"
    );
    let retry: u64 = reply.headers.get("retry-after").unwrap().parse().unwrap();
    let pushback: u64 = reply
        .headers
        .get("grpc-retry-pushback-ms")
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(pushback, retry * 1_000, "{reply:?}");
    let http: Value = serde_json::from_str(&http.body).unwrap();
    let message = http["message"].as_str().unwrap();
    // The HTTP message tells the wait in words; the gRPC one leaves it to the pushback.
    let words = message.split("; retry in ").next().unwrap();
    assert_eq!(
        reply.headers.get("grpc-message"),
        Some(reply::percent_encode(words).as_str()),
        "{reply:?}"
    );
}

fn grpc_request(path: &str) -> PlainRequest {
    PlainRequest::get(path).with_header("content-type", "application/grpc")
}

fn respond(step: Step) -> Reply {
    match step {
        Step::Respond(reply) => reply,
        other => panic!("not answered locally: {other:?}"),
    }
}

#[test]
fn a_rate_limit_answers_429_with_the_contract() {
    let l = limiter(
        r#"{"headers": "both", "rules": [{"name": "per-ip", "key": ["client_ip"],
        "limits": [{"requests": 1, "per": "minute"}]}]}"#,
    );
    let mut store = MemoryStore::default();
    let answer = |request: &mut PlainRequest, store: &mut MemoryStore| {
        let (_, step, _) = Exchange::start(&l, request, None, Moment::at(T0), store);
        step
    };
    let ip = |r: PlainRequest| r.from_ip("10.0.0.1");
    assert_eq!(
        answer(&mut ip(PlainRequest::get("/")), &mut store),
        Step::Continue
    );
    let http = respond(answer(&mut ip(PlainRequest::get("/")), &mut store));
    assert_eq!(http.status, 429);
    let body = checked(&http);
    assert_eq!(body["error"], "rate_limited");
    assert_eq!(body["rule"], "per-ip");
    assert_eq!(body["retryAfter"], 60);
    assert_eq!(http.details, "sluice_rate_limited");
    assert_eq!(http.headers.get("x-ratelimit-remaining"), Some("0"));

    let grpc = respond(answer(&mut ip(grpc_request("/svc.S/M")), &mut store));
    grpc_checked(&grpc, GRPC_RESOURCE_EXHAUSTED, &http);
    assert_eq!(grpc.headers.get("x-ratelimit-remaining"), Some("0"));
}

#[test]
fn a_rule_failing_closed_answers_503_with_the_contract() {
    let l = limiter(
        r#"{"service": {"cluster": "svc"}, "rules": [{"name": "exact", "key": ["header:x-user"],
        "consistency": "strict", "limits": [{"requests": 10, "per": "second"}],
        "fallback": {"policy": "fail_closed"}}]}"#,
    );
    let answer = |mut request: PlainRequest| {
        let mut store = MemoryStore::default();
        let request = &mut request;
        let (mut exchange, step, effects) =
            Exchange::start(&l, request, None, Moment::at(T0), &mut store);
        assert_eq!(step, Step::Wait);
        assert!(!effects.is_empty());
        let none: Option<CheckResponse> = None;
        let (step, _) = exchange.answered(&l, 0, none, Moment::at(T0), &mut store);
        respond(step.unwrap())
    };
    let http = answer(PlainRequest::get("/").with_header("x-user", "alice"));
    assert_eq!(http.status, 503);
    let body = checked(&http);
    assert_eq!(body["error"], "limiter_unavailable");
    assert_eq!(body["rule"], "exact");
    assert_eq!(http.details, "sluice_limiter_unavailable");
    let grpc = answer(grpc_request("/svc.S/M").with_header("x-user", "alice"));
    grpc_checked(&grpc, GRPC_UNAVAILABLE, &http);
}

#[test]
fn every_shed_reason_answers_503_with_the_contract() {
    let policy = sluice_core::parse(
        br#"{"shedding": {"bulkheads": [{"name": "api", "limit": {"static": 4}}]}}"#,
    )
    .unwrap();
    let shedding = policy.shedding.unwrap();
    let seat = Seat {
        bulkhead: 0,
        class: shedding.default_class,
    };
    for reason in ShedReason::ALL {
        for level in [Level::Normal, Level::Critical] {
            let http = reply::overloaded(&shedding, seat, level, reason, 0.5, Protocol::Http);
            assert_eq!(http.status, 503);
            let body = checked(&http);
            assert_eq!(body["error"], "overloaded");
            assert_eq!(body["reason"], reason.name());
            assert_eq!(body["bulkhead"], "api");
            assert_eq!(body["level"], level.name());
            assert_eq!(http.headers.get("x-sluice-shed"), Some(reason.name()));
            // The access log's response code details: the reason, as the header says it.
            assert_eq!(http.details, format!("sluice_shed_{}", reason.name()));
            let grpc = reply::overloaded(&shedding, seat, level, reason, 0.5, Protocol::Grpc);
            grpc_checked(&grpc, GRPC_UNAVAILABLE, &http);
            assert_eq!(grpc.headers.get("x-sluice-shed"), Some(reason.name()));
        }
    }
}

#[test]
fn the_schema_refuses_what_the_contract_does_not_allow() {
    let validator = validator();
    for bad in [
        // The fail-closed body as it was: another spelling of the wait, no message.
        r#"{"error":"limiter_unavailable","rule":"r","reason":"down","retry_after_seconds":2}"#,
        r#"{"error":"rate_limited","message":"m","retryAfter":0,"rule":"r"}"#,
        r#"{"error":"rate_limited","message":"m","retryAfter":1}"#,
        r#"{"error":"overloaded","message":"m","retryAfter":1,"reason":"bored","bulkhead":"b","class":"c","level":"normal"}"#,
        r#"{"error":"teapot","message":"m","retryAfter":1}"#,
    ] {
        let body: Value = serde_json::from_str(bad).unwrap();
        assert!(!validator.is_valid(&body), "{bad}");
    }
}

/// `docs_url`: every kind of reply names it in its body (`docs`) and in a `Link` header, the
/// bodies still valid; a gRPC answer carries only the header.
#[test]
fn every_reply_links_the_configured_docs() {
    const DOCS: &str = "https://api.example.com/docs/rate-limits?lang=en#429";
    let l = limiter(&format!(
        r#"{{"docs_url": "{DOCS}", "service": {{"cluster": "svc"}},
        "rules": [
          {{"name": "per-ip", "key": ["client_ip"], "limits": [{{"requests": 1, "per": "minute"}}]}},
          {{"name": "exact", "key": ["header:x-user"], "consistency": "strict",
            "limits": [{{"requests": 10, "per": "second"}}], "fallback": {{"policy": "fail_closed"}}}}],
        "shedding": {{"bulkheads": [{{"name": "api", "limit": {{"static": 4}}}}]}}}}"#
    ));
    let link = format!("<{DOCS}>; rel=\"help\"");
    let mut store = MemoryStore::default();
    let mut denied = None;
    for _ in 0..2 {
        let mut request = PlainRequest::get("/").from_ip("10.0.0.1");
        let (_, step, _) = Exchange::start(&l, &mut request, None, Moment::at(T0), &mut store);
        denied = Some(step);
    }
    let http = respond(denied.unwrap());
    assert_eq!(checked(&http)["docs"], DOCS, "{http:?}");
    assert_eq!(http.headers.get("link"), Some(link.as_str()));

    let mut request = PlainRequest::get("/").with_header("x-user", "alice");
    let (mut exchange, step, _) =
        Exchange::start(&l, &mut request, None, Moment::at(T0), &mut store);
    assert_eq!(step, Step::Wait);
    let none: Option<CheckResponse> = None;
    let (step, _) = exchange.answered(&l, 0, none, Moment::at(T0), &mut store);
    let unavailable = respond(step.unwrap());
    assert_eq!(checked(&unavailable)["docs"], DOCS, "{unavailable:?}");

    let shedding = l.policy().shedding.as_ref().unwrap();
    let seat = Seat {
        bulkhead: 0,
        class: shedding.default_class,
    };
    for protocol in [Protocol::Http, Protocol::Grpc] {
        let shed = reply::overloaded(
            shedding,
            seat,
            Level::High,
            ShedReason::Concurrency,
            0.5,
            protocol,
        )
        .linking(shedding.docs_url.as_deref());
        assert_eq!(shed.headers.get("link"), Some(link.as_str()), "{shed:?}");
        match protocol {
            Protocol::Http => assert_eq!(checked(&shed)["docs"], DOCS),
            Protocol::Grpc => assert!(shed.body.is_empty(), "{shed:?}"),
        }
    }
}

/// `docs_url` goes verbatim into a header and a JSON string: whatever could end either, or is not a
/// web page, is refused naming the field.
#[test]
fn a_docs_url_that_could_break_a_reply_is_refused() {
    let long = format!("https://example.com/{}", "a".repeat(600));
    for url in [
        "javascript:alert(1)",
        "ftp://example.com/",
        "https://",
        "https://example.com/\r\nSet-Cookie: a=b",
        "https://example.com/a b",
        "https://example.com/\",\"rule\":\"x",
        "https://example.com/>; rel=\"next\"",
        "https://example.com/\\",
        "https://exämple.com/",
        long.as_str(),
    ] {
        let config = serde_json::json!({"docs_url": url, "rules": [{"name": "r", "key": ["client_ip"],
            "limits": [{"requests": 1, "per": "minute"}]}]});
        let error = sluice_core::parse(config.to_string().as_bytes()).unwrap_err();
        assert_eq!(error.field, "docs_url", "{url:?}: {error}");
    }
}
