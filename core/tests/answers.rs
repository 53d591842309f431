//! A rule's own answer (`deny_status`, `deny_message`, `headers_on_admitted`, `headers_on_denied`) and
//! the policy's `x_ratelimit_reset`: what a client gets, and the worst values an operator (or whoever
//! writes the configuration) can give them, refused with the field named.

use serde_json::{json, Value};
use sluice_core::config::{check_rule, RuleAt};
use sluice_core::policy::Host;
use sluice_core::reply::{percent_encode, MAX_MESSAGE_BYTES};
use sluice_core::{Exchange, Limiter, MemoryStore, Moment, PlainRequest, Reply, Step};

const SECOND: u64 = 1_000_000;
const T0: u64 = 1_700_000_000 * SECOND + 250_000;

/// A configuration of one rule (1 a minute per client) with `extra` fields.
fn config(extra: Value) -> Value {
    let mut rule = json!({"name": "api", "key": ["client_ip"],
                          "limits": [{"requests": 1, "per": "minute"}]});
    for (k, v) in extra.as_object().unwrap() {
        rule[k] = v.clone();
    }
    json!({"headers": "both", "rules": [rule]})
}

fn parse(json: &Value) -> Result<sluice_core::Policy, sluice_core::ConfigError> {
    sluice_core::parse(json.to_string().as_bytes())
}

#[track_caller]
fn refused(json: Value, field: &str) -> String {
    let error = parse(&json).expect_err("accepted");
    assert_eq!(error.field, field, "{error}");
    error.problem
}

fn ask(limiter: &Limiter, store: &mut MemoryStore, request: PlainRequest) -> Step {
    let (_, step, _) = Exchange::start(limiter, &mut request.clone(), None, Moment::at(T0), store);
    step
}

/// The reply to the second request (the first spends the minute's one).
fn denial(policy: sluice_core::Policy, content_type: Option<&str>) -> Reply {
    let limiter = Limiter::new(policy);
    let mut store = MemoryStore::default();
    let mut request = PlainRequest::get("/").from_ip("10.0.0.1");
    if let Some(c) = content_type {
        request = request.with_header("content-type", c);
    }
    assert_eq!(ask(&limiter, &mut store, request.clone()), Step::Continue);
    match ask(&limiter, &mut store, request) {
        Step::Respond(reply) => reply,
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_deny_status_is_an_error_status_from_400_to_599() {
    for status in [
        0u64,
        200,
        204,
        302,
        399,
        600,
        999,
        65_536,
        u32::MAX as u64 + 1,
    ] {
        let problem = refused(
            config(json!({"deny_status": status})),
            "rules[0].deny_status",
        );
        assert!(problem.contains("400 to 599"), "{status}: {problem}");
    }
    // Not a number of the right kind: the parser names the field.
    for bad in [json!(-1), json!(429.5), json!("429"), json!(null)] {
        let result = parse(&config(json!({"deny_status": bad.clone()})));
        if bad.is_null() {
            assert!(result.is_ok(), "null is the default");
            continue;
        }
        assert_eq!(result.unwrap_err().field, "rules[0].deny_status", "{bad}");
    }
    for status in [400u32, 429, 503, 599] {
        let policy = parse(&config(json!({"deny_status": status}))).unwrap();
        assert_eq!(denial(policy, None).status, status);
    }
}

#[test]
fn a_deny_message_is_one_bounded_line_of_text() {
    let huge = "x".repeat(1 << 20);
    let problem = refused(
        config(json!({"deny_message": huge})),
        "rules[0].deny_message",
    );
    assert!(problem.contains("at most 1024"), "{problem}");
    let just = "y".repeat(MAX_MESSAGE_BYTES);
    assert!(parse(&config(json!({"deny_message": just}))).is_ok());
    for bad in [
        "",
        "   ",
        "two\nlines",
        "cr\r",
        "nul\0",
        "tab\tbed",
        "\u{1b}[31mred",
        "c1\u{85}",
        "del\u{7f}",
    ] {
        refused(
            config(json!({"deny_message": bad})),
            "rules[0].deny_message",
        );
    }
}

#[test]
fn quotes_and_backslashes_in_a_message_keep_the_body_json_and_the_grpc_message_one_header() {
    let message = r#"slow "down" \ 100% — {"retryAfter":0}"#;
    let policy = parse(&config(
        json!({"deny_message": message, "deny_status": 503}),
    ))
    .unwrap();
    let http = denial(policy.clone(), None);
    assert_eq!(http.status, 503);
    let body: Value = serde_json::from_str(&http.body).unwrap();
    assert_eq!(body["message"], message, "{}", http.body);
    assert_eq!(body["error"], "rate_limited");
    assert_eq!(
        body["retryAfter"], 60,
        "the message cannot change the wait: {}",
        http.body
    );
    assert_eq!(body.as_object().unwrap().len(), 4, "{}", http.body);

    let grpc = denial(policy, Some("application/grpc"));
    assert_eq!(
        grpc.grpc_status,
        Some(8),
        "a rate limit whatever the status"
    );
    let encoded = grpc.headers.get("grpc-message").unwrap();
    assert_eq!(encoded, percent_encode(message));
    assert!(
        encoded.bytes().all(|b| (0x20..=0x7e).contains(&b)),
        "{encoded}"
    );
}

#[test]
fn a_rule_may_hide_its_headers_on_denials_and_on_admitted_responses() {
    let hidden = parse(&config(json!({"headers_on_denied": false}))).unwrap();
    let reply = denial(hidden, None);
    assert_eq!(reply.headers.get("retry-after"), Some("60"), "always");
    assert_eq!(reply.headers.get("x-ratelimit-limit"), None, "{reply:?}");
    assert_eq!(reply.headers.get("ratelimit"), None, "{reply:?}");

    // The admitted response shows the most restrictive rule that shows its headers.
    let two = json!({"headers": "legacy", "rules": [
        {"name": "quiet", "key": ["client_ip"], "headers_on_admitted": false,
         "limits": [{"requests": 2, "per": "minute"}]},
        {"name": "loud", "key": ["client_ip"], "limits": [{"requests": 100, "per": "minute"}]}]});
    let limiter = Limiter::new(parse(&two).unwrap());
    let mut store = MemoryStore::default();
    let mut request = PlainRequest::get("/").from_ip("10.0.0.1");
    let (mut exchange, step, _) =
        Exchange::start(&limiter, &mut request, None, Moment::at(T0), &mut store);
    assert_eq!(step, Step::Continue);
    let headers = exchange.response_headers(&limiter);
    assert!(
        headers.contains(&("x-ratelimit-limit", "100".to_string())),
        "{headers:?}"
    );
}

#[test]
fn the_legacy_reset_is_seconds_or_a_unix_time() {
    let mut json = config(json!({}));
    let seconds = denial(parse(&json).unwrap(), None);
    assert_eq!(seconds.headers.get("x-ratelimit-reset"), Some("60"));
    json["x_ratelimit_reset"] = json!("unix");
    let unix = denial(parse(&json).unwrap(), None);
    // Whole at T0 + 60 s, rounded up to the second.
    let at = (T0 + 60 * SECOND).div_ceil(SECOND).to_string();
    assert_eq!(unix.headers.get("x-ratelimit-reset"), Some(at.as_str()));
    assert_eq!(
        unix.headers.get("ratelimit"),
        Some("\"api\";r=0;t=60"),
        "t stays seconds"
    );
    for bad in ["hours", "UNIX", "", "unix\n"] {
        json["x_ratelimit_reset"] = json!(bad);
        let error = parse(&json).unwrap_err();
        assert_eq!(error.field, "x_ratelimit_reset", "{error}");
        assert!(!error.to_string().contains('\n'), "one line: {error}");
    }
}

/// The checks live overrides go through (`config::check_rule`) refuse a bad answer however the rule was
/// built, and an override of a rule's limits keeps its answer.
#[test]
fn the_answer_is_checked_on_the_path_live_overrides_take() {
    let policy = parse(&config(
        json!({"deny_status": 503, "deny_message": "later"}),
    ))
    .unwrap();
    let mut rule = policy.rules[0].clone();
    rule.answer.status = 200;
    let at = RuleAt::Config {
        rule: "rules[0]",
        limits: "rules[0].limits",
    };
    assert_eq!(
        check_rule(&rule, 64, Host::Envoy, &at).unwrap_err().field,
        "rules[0].deny_status"
    );
    let over = RuleAt::Override { limits: "limits" };
    assert_eq!(
        check_rule(&rule, 64, Host::Envoy, &over).unwrap_err().field,
        "deny_status"
    );
    rule.answer.status = 503;
    rule.answer.message = Some("a\nb".into());
    assert_eq!(
        check_rule(&rule, 64, Host::Envoy, &over).unwrap_err().field,
        "deny_message"
    );

    let overridden = sluice_core::overrides::check_limits(
        &policy,
        "api",
        &[json!({"requests": 5, "per": "minute"})],
        "rule",
        "limits",
    )
    .unwrap();
    assert_eq!(overridden[0].1.answer, policy.rules[0].answer);
}
