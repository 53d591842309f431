//! One key's own limits through the admin API (`PUT /admin/v1/overrides/keys/RULE` with
//! `limits`), on a real Redis: checked as the proxies' configuration checks its rule, bounded by
//! `--key-limits-max` apart from the other limit overrides, sent to the proxies in the set,
//! shown by `GET /admin/v1/overrides` and `GET /admin/v1/keys`, deleted and audited.

mod common;

use axum::body::Body;
use axum::http::StatusCode;
use common::{call, post, Answer, TextFile};
use serde_json::{json, Value};
use sluice_counter_service::AppState;
use sluice_tests::redis::Redis;

const ADMIN: &str = "alice-admin-token";

/// The proxies' configuration: a local rule keyed on a customer, a cached one with tiers, one
/// keyed on the user or the address, and a sliding log.
const POLICY: &str = r#"{"service": {"cluster": "sluice_service"}, "rules": [
    {"name": "api", "key": ["header:x-customer"], "consistency": "local", "cost": 2,
     "limits": [{"requests": 100, "per": "minute"}]},
    {"name": "plans", "key": ["header:x-customer"], "tiers": {"from": "header:x-plan", "default": "free",
     "limits": {"free": [{"requests": 5, "per": "minute"}], "pro": [{"requests": 50, "per": "minute"}]}}},
    {"name": "users", "key": ["jwt:sub|client_ip"], "limits": [{"requests": 5, "per": "minute"}]},
    {"name": "log", "key": ["header:x-customer"], "consistency": "strict",
     "limits": [{"requests": 5, "per": "minute", "algorithm": "sliding_log"}]}
]}"#;

fn state(redis: &Redis, more: &[&str]) -> AppState {
    let admins = TextFile::new("alice alice-admin-token\n");
    let mut args = vec!["--admin-tokens-file", admins.path()];
    args.extend_from_slice(more);
    AppState::new(common::settings(&redis.url(), &args)).unwrap()
}

async fn admin(state: &AppState, method: &str, path: &str, body: Option<Value>) -> Answer {
    let body = body.map_or_else(Body::empty, |json| Body::from(json.to_string()));
    call(state, method, path, Some(ADMIN), body).await
}

fn refused(answer: &Answer, message: &str) {
    assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{answer:?}");
    let text = answer.body["message"].as_str().unwrap_or_default();
    assert!(text.starts_with(message), "{text:?} is not {message:?}");
}

fn limits(requests: u64) -> Value {
    json!({"limits": [{"requests": requests, "per": "minute"}], "reason": "contract 42"})
}

#[tokio::test]
async fn a_keys_own_limits_are_checked_bounded_sent_shown_and_deleted() {
    let redis = Redis::start().unwrap();
    let policy = TextFile::new(POLICY);
    let state = state(
        &redis,
        &["--policy", policy.path(), "--key-limits-max", "2"],
    );

    let set = admin(
        &state,
        "PUT",
        "/admin/v1/overrides/keys/api?key=42",
        Some(limits(5000)),
    )
    .await;
    assert_eq!(set.status, StatusCode::OK, "{set:?}");
    assert_eq!(set.body["limits"][0]["requests"], 5000);
    assert_eq!(set.body["reason"], "contract 42");

    // Everything the configuration refuses of the rule with these limits, with its message.
    let cases = [
        ("api?key=42", json!({"limits": [{"requests": 1, "per": "minute"}]}),
         "limits[0]: 2 is more than limits ever admits at once (1): no request could pass"),
        ("api?key=42", json!({"limits": [{"requests": 1, "per": "fortnight"}]}), "limits[0].per:"),
        ("api?key=42", json!({"limits": [{"requests": 10, "per": "minute", "algorithm": "gcra"}, {"requests": 100, "per": "hour", "algorithm": "gcra"}]}),
         "limits: a key's own limits count in its rule's table, so they keep the form of \"api\"'s"),
        ("log?key=42", json!({"limits": [{"requests": 6, "per": "minute", "algorithm": "sliding_log"}]}),
         "limits: a key's own limits count in its rule's table, so they keep the form of \"log\"'s: 1 limit(s), [sliding_log of 5]"),
        ("plans?key=42", json!({"limits": [{"requests": 6, "per": "minute", "algorithm": "sliding_log"}]}),
         "limits[0].algorithm: sliding_log is exact"),
        ("users?key=alice", limits(10), "key: a key's own limits are one key's: name the alternative"),
        ("nope?key=1", limits(10), "rule: no rule named \"nope\""),
        ("api?key=42", json!({"limits": [{"requests": 10, "per": "minute"}], "action": "block"}),
         "action: give the key an action (block or allow) or limits of its own, one of the two"),
        ("api?key=42", json!({"reason": "none"}), "action: give the key an action"),
        ("api?key=42", json!({"key": ["42"], "limits": [{"requests": 10, "per": "minute"}]}),
         "key: give the key in the body or as ?key=, not both"),
    ];
    for (path, body, message) in cases {
        let path = format!("/admin/v1/overrides/keys/{path}");
        refused(&admin(&state, "PUT", &path, Some(body)).await, message);
    }
    // A tier's key, and a user named with its alternative: taken.
    for (path, body) in [
        ("plans?key=42", limits(500)),
        (
            "users",
            json!({"key": ["jwt:sub=alice"], "limits": [{"requests": 10, "per": "minute"}]}),
        ),
    ] {
        let path = format!("/admin/v1/overrides/keys/{path}");
        let answer = admin(&state, "PUT", &path, Some(body)).await;
        if path.contains("users") {
            refused(&answer, "key: at most 2 keys are given limits of their own (--key-limits-max): delete one first");
        } else {
            assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
        }
    }
    // Set again: not one more.
    let again = admin(
        &state,
        "PUT",
        "/admin/v1/overrides/keys/api?key=42",
        Some(limits(6000)),
    )
    .await;
    assert_eq!(again.status, StatusCode::OK, "{again:?}");
    // The bound is apart from the rules' limit overrides and the blocks.
    let rule = admin(
        &state,
        "PUT",
        "/admin/v1/overrides/limits/api",
        Some(limits(200)),
    )
    .await;
    assert_eq!(rule.status, StatusCode::OK, "{rule:?}");
    let block = admin(
        &state,
        "PUT",
        "/admin/v1/overrides/keys/api?key=43",
        Some(json!({"action": "block"})),
    )
    .await;
    assert_eq!(block.status, StatusCode::OK, "{block:?}");

    // The proxies receive it beside the rules' limits.
    let sync = post(
        &state,
        "/v1/sync",
        &json!({"proxy": "p1", "interval_ms": 100, "entries": [], "overrides_version": 0}),
    )
    .await;
    let live = &sync.body["hints"]["overrides"]["live"]["limits"];
    assert_eq!(live["key:api\u{1f}42"][0]["requests"], 6000, "{sync:?}");
    assert_eq!(live["key:plans\u{1f}42"][0]["requests"], 500, "{sync:?}");

    // The operator sees it with the set, and with the key's state.
    let view = admin(&state, "GET", "/admin/v1/overrides", None).await;
    let shown = &view.body["key_limits"]["api"]["42"];
    assert_eq!(shown["limits"][0]["requests"], 6000, "{view:?}");
    assert_eq!(shown["who"], "alice", "{view:?}");
    assert!(
        view.body["limits"].get("key:api\u{1f}42").is_none(),
        "{view:?}"
    );
    // (a tier of a cached rule: the service keeps its counts)
    let key = admin(&state, "GET", "/admin/v1/keys/plans/pro?key=42", None).await;
    assert_eq!(key.status, StatusCode::OK, "{key:?}");
    assert_eq!(
        key.body["key_limits"]["limits"][0]["requests"], 500,
        "{key:?}"
    );
    let sources: Vec<&str> = key.body["limits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["source"].as_str().unwrap())
        .collect();
    assert_eq!(sources, ["policy", "key override"], "{key:?}");
    let other = admin(&state, "GET", "/admin/v1/keys/plans/pro?key=44", None).await;
    assert_eq!(other.body["key_limits"], Value::Null, "{other:?}");

    // A delete removes the key's limits (and its block, were there one); then one more fits.
    let gone = admin(
        &state,
        "DELETE",
        "/admin/v1/overrides/keys/api?key=42",
        None,
    )
    .await;
    assert_eq!(gone.status, StatusCode::OK, "{gone:?}");
    let view = admin(&state, "GET", "/admin/v1/overrides", None).await;
    assert!(view.body["key_limits"]["api"].is_null(), "{view:?}");
    assert_eq!(
        view.body["keys"]["api"]["43"]["action"], "block",
        "{view:?}"
    );
    let twice = admin(
        &state,
        "DELETE",
        "/admin/v1/overrides/keys/api?key=42",
        None,
    )
    .await;
    assert_eq!(twice.status, StatusCode::NOT_FOUND, "{twice:?}");
    let fits = admin(
        &state,
        "PUT",
        "/admin/v1/overrides/keys/users",
        Some(json!({"key": ["jwt:sub=alice"], "limits": [{"requests": 10, "per": "minute"}]})),
    )
    .await;
    assert_eq!(fits.status, StatusCode::OK, "{fits:?}");
    let audit = admin(&state, "GET", "/admin/v1/audit?limit=20", None).await;
    let actions: Vec<&str> = audit.body["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["action"].as_str().unwrap())
        .collect();
    assert_eq!(
        actions.iter().filter(|a| **a == "set key limits").count(),
        4,
        "{actions:?}"
    );
    assert!(actions.contains(&"delete key limits"), "{actions:?}");
}

/// Without `--policy` the form of the limits is still checked, and a key's own limits are the
/// state `GET /admin/v1/keys` reads without `limits=`.
#[tokio::test]
async fn without_the_configuration_the_limits_form_is_checked() {
    let redis = Redis::start().unwrap();
    let state = state(&redis, &[]);
    let bad = json!({"limits": [{"requests": 0, "per": "minute"}]});
    refused(
        &admin(
            &state,
            "PUT",
            "/admin/v1/overrides/keys/api?key=42",
            Some(bad),
        )
        .await,
        "limits[0].requests: must be at least 1",
    );
    let long = format!("/admin/v1/overrides/keys/api?key={}", "x".repeat(600));
    refused(
        &admin(&state, "PUT", &long, Some(limits(10))).await,
        "key: longer than",
    );
    let set = admin(
        &state,
        "PUT",
        "/admin/v1/overrides/keys/api?key=42",
        Some(limits(70)),
    )
    .await;
    assert_eq!(set.status, StatusCode::OK, "{set:?}");
    let key = admin(&state, "GET", "/admin/v1/keys/api?key=42", None).await;
    assert_eq!(key.status, StatusCode::OK, "{key:?}");
    assert_eq!(key.body["limits"][0]["source"], "key override", "{key:?}");
    assert_eq!(key.body["limits"][0]["limit"]["requests"], 70, "{key:?}");
}
