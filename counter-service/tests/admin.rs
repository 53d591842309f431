//! Live overrides through the admin API, on a real Redis: admin credentials apart from the
//! proxies'; every malformed request refused naming its field; each kind set, read, deleted and
//! audited; every sync answered the bypass, and the whole set when its version is not the
//! current one, on any replica; expiry; a restart; a Redis failure; the caps; a Redis Cluster;
//! and through the built binary (its tokens files reloaded on SIGHUP, an admin token rotated).

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::StatusCode;
use common::{call, get, post, Answer, TOKEN};
use serde_json::{json, Value};
use sluice_counter_service::overrides::{
    self, Change, Note, AUDIT_KEY, KEYS, KEYS_KEY, LIMITS_KEY, MAX_KEY_OVERRIDES,
    MAX_LIMIT_OVERRIDES, VERSION_KEY,
};
use sluice_counter_service::AppState;
use sluice_protocol::KeyAction;
use sluice_tests::eventually;
use sluice_tests::redis::{Redis, RedisCluster, Reply};
use sluice_tests::service::{Service, ServiceOptions};

const ALICE: &str = "alice-admin-token";
const BOB: &str = "bob-admin-token";
const ADMINS: &str = "# operators\nalice alice-admin-token\nbob bob-admin-token\n";
/// A fake Redis clock (µs) for the expiry tests.
const T0_US: u64 = 1_700_000_000_000_000;
const T0_MS: u64 = T0_US / 1_000;

use common::TextFile;

/// A service state on this Redis (or cluster) with the admin API enabled.
fn admin_state(redis_url: &str) -> AppState {
    admin_state_with(redis_url, &[])
}

fn admin_state_with(redis_url: &str, more: &[&str]) -> AppState {
    let file = TextFile::new(ADMINS);
    let mut args = vec!["--admin-tokens-file", file.path()];
    args.extend_from_slice(more);
    let settings = common::settings(redis_url, &args);
    AppState::new(settings).unwrap()
}

async fn admin(state: &AppState, method: &str, path: &str, body: Option<Value>) -> Answer {
    admin_as(state, ALICE, method, path, body).await
}

async fn admin_as(
    state: &AppState,
    token: &str,
    method: &str,
    path: &str,
    body: Option<Value>,
) -> Answer {
    let body = body.map_or_else(Body::empty, |json| Body::from(json.to_string()));
    call(state, method, path, Some(token), body).await
}

/// `PUT` that must succeed: its answer.
async fn put(state: &AppState, path: &str, body: Value) -> Value {
    let answer = admin(state, "PUT", path, Some(body)).await;
    assert_eq!(answer.status, StatusCode::OK, "PUT {path}: {answer:?}");
    answer.body
}

fn version(answer: &Value) -> u64 {
    answer["version"].as_u64().unwrap()
}

/// A sync of one entry, from a proxy that holds `overrides_version`.
async fn sync(state: &AppState, overrides_version: u64) -> Answer {
    let body = json!({
        "proxy": "p1",
        "interval_ms": 100,
        "entries": [{"key": "k", "limits": [{"requests": 10, "period_ms": 1000, "burst": 10}], "spent": 0, "denied": 0}],
        "overrides_version": overrides_version,
    });
    let answer = post(state, "/v1/sync", &body).await;
    assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
    assert_eq!(answer.body["grants"][0]["ttl_ms"], 300, "{answer:?}");
    answer
}

fn hinted(answer: &Answer) -> &Value {
    &answer.body["hints"]["overrides"]
}

fn assert_error(answer: &Answer, status: StatusCode, error: &str, message: &str) {
    assert_eq!(answer.status, status, "{answer:?}");
    assert_eq!(answer.body["error"], error, "{answer:?}");
    let text = answer.body["message"].as_str().unwrap_or_default();
    assert!(
        text.starts_with(message),
        "{text:?} should start with {message:?}"
    );
}

async fn metrics(state: &AppState) -> String {
    get(state, "/metrics")
        .await
        .body
        .as_str()
        .unwrap()
        .to_owned()
}

/// The stored audit log, newest first.
fn audit_log(redis: &Redis) -> Vec<Value> {
    let Reply::Array(entries) = redis.query(&["LRANGE", AUDIT_KEY, "0", "-1"]).unwrap() else {
        panic!("the audit log is not a list")
    };
    entries
        .iter()
        .map(|entry| serde_json::from_str(entry.text().unwrap()).unwrap())
        .collect()
}

#[tokio::test]
async fn only_admin_tokens_open_the_admin_api_and_only_proxy_tokens_v1() {
    let redis = Redis::start().unwrap();
    let state = admin_state(&redis.url());
    let empty = json!({"version": 0, "bypass": null, "limits": {}, "bulkheads": {}, "keys": {},
                       "key_limits": {}});
    for token in [ALICE, BOB] {
        let answer = admin_as(&state, token, "GET", "/admin/v1/overrides", None).await;
        assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
        assert_eq!(answer.body, empty);
    }
    // a proxy token, no token, a wrong one: 401 on every admin route
    let body = json!({"enabled": true});
    for token in [Some(TOKEN), None, Some("alice-admin-tokeN")] {
        for (method, path) in [
            ("GET", "/admin/v1/overrides"),
            ("PUT", "/admin/v1/overrides/bypass"),
            ("DELETE", "/admin/v1/overrides/keys/api?key=a"),
            ("GET", "/admin/v1/audit"),
        ] {
            let answer = call(&state, method, path, token, Body::from(body.to_string())).await;
            assert_error(
                &answer,
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "missing or invalid bearer token",
            );
            assert_eq!(answer.headers["www-authenticate"], "Bearer");
        }
    }
    // an admin token on /v1: 401
    let sync_body = json!({"proxy": "p1", "interval_ms": 100, "entries": []});
    let answer = call(
        &state,
        "POST",
        "/v1/sync",
        Some(ALICE),
        Body::from(sync_body.to_string()),
    )
    .await;
    assert_error(&answer, StatusCode::UNAUTHORIZED, "unauthorized", "missing");
    assert_eq!(
        post(&state, "/v1/sync", &sync_body).await.status,
        StatusCode::OK
    );
    // nothing was changed
    assert_eq!(redis.text(&["EXISTS", VERSION_KEY]).unwrap(), "0");

    // without --admin-tokens-file or --admin-client-certs-file: 404 admin_disabled, whatever the
    // token, and the message names both ways to enable it
    let disabled = common::state(&redis.url());
    for token in [ALICE, TOKEN] {
        let answer = admin_as(&disabled, token, "GET", "/admin/v1/overrides", None).await;
        assert_error(
            &answer,
            StatusCode::NOT_FOUND,
            "admin_disabled",
            "the admin API is disabled: start the service with --admin-tokens-file or --admin-client-certs-file",
        );
        let answer = admin_as(
            &disabled,
            token,
            "PUT",
            "/admin/v1/overrides/bypass",
            Some(body.clone()),
        )
        .await;
        assert_error(&answer, StatusCode::NOT_FOUND, "admin_disabled", "");
    }
    // an unknown admin path is the usual 404; a known one with the wrong method a 405
    let answer = admin(&state, "GET", "/admin/v1/nothing", None).await;
    assert_error(
        &answer,
        StatusCode::NOT_FOUND,
        "not_found",
        "no such endpoint",
    );
    let answer = admin(&state, "POST", "/admin/v1/overrides", None).await;
    assert_eq!(answer.status, StatusCode::METHOD_NOT_ALLOWED, "{answer:?}");
    assert_eq!(answer.body["error"], "method_not_allowed", "{answer:?}");
}

/// A limit override may count over a duration, written as the filter's configuration writes it.
#[tokio::test]
async fn a_limit_override_takes_a_duration() {
    let redis = Redis::start().unwrap();
    let state = admin_state(&redis.url());
    let limits = json!([{"requests": 5, "per": "15m"}, {"requests": 50, "per": 21600}]);
    let answer = admin(
        &state,
        "PUT",
        "/admin/v1/overrides/limits/api",
        Some(json!({"limits": limits})),
    )
    .await;
    assert!(answer.status.is_success(), "{answer:?}");
    let answer = admin(&state, "GET", "/admin/v1/overrides", None).await;
    assert_eq!(answer.body["limits"]["api"]["limits"], limits, "{answer:?}");
}

#[tokio::test]
async fn malformed_requests_are_400_naming_the_field() {
    let redis = Redis::start().unwrap();
    let state = admin_state(&redis.url());
    let refused = |method: &'static str, path: &'static str, body: Option<Value>| {
        let state = state.clone();
        async move { admin(&state, method, path, body).await }
    };
    let limits = "/admin/v1/overrides/limits/api";
    let keys = "/admin/v1/overrides/keys/api";

    // limits: the filter's own validation, and its own message
    let fortnight = json!({"requests": 100, "per": "fortnight"});
    let expected = sluice_core::config::parse_limits("limits", std::slice::from_ref(&fortnight))
        .unwrap_err()
        .to_string();
    assert!(expected.starts_with("limits[0].per: "), "{expected}");
    let answer = refused("PUT", limits, Some(json!({"limits": [fortnight]}))).await;
    assert_error(
        &answer,
        StatusCode::BAD_REQUEST,
        "invalid_request",
        &expected,
    );
    assert_eq!(answer.body["message"], expected);
    // A duration an attacker with the admin token may write: refused as the filter refuses it.
    for (per, message) in [
        (json!("0s"), "must be at least 1 second, got \"0s\""),
        (json!(-900), "must be at least 1 second, got -900"),
        (json!(1.5), "a number of seconds is an integer (write 1.5 minutes as 90 or \"90s\"), got 1.5"),
        (json!("1m30s"), "a duration is one whole number and one unit: write 1m30s as \"90s\", got \"1m30s\""),
        (json!("18446744073709551615s"), "must be at most 366 days (31622400 seconds), got \"18446744073709551615s\""),
        (json!(18446744073709551615u64), "must be at most 366 days (31622400 seconds), got 18446744073709551615"),
        (json!("900"), "a number of seconds is written as a JSON number (900) or with its unit (\"900s\"), got \"900\""),
    ] {
        let answer = refused(
            "PUT",
            limits,
            Some(json!({"limits": [{"requests": 5, "per": per}]})),
        )
        .await;
        assert_error(
            &answer,
            StatusCode::BAD_REQUEST,
            "invalid_request",
            &format!("limits[0].per: {message}"),
        );
    }
    let extra = json!({"requests": 100, "per": "minute", "brust": 5});
    let expected = sluice_core::config::parse_limits(
        "limits",
        &[json!({"requests": 1, "per": "second"}), extra.clone()],
    )
    .unwrap_err()
    .to_string();
    assert!(expected.starts_with("limits[1]"), "{expected}");
    assert!(expected.contains("brust"), "{expected}");
    let body = json!({"limits": [{"requests": 1, "per": "second"}, extra]});
    let answer = refused("PUT", limits, Some(body)).await;
    assert_error(
        &answer,
        StatusCode::BAD_REQUEST,
        "invalid_request",
        &expected,
    );
    let answer = refused("PUT", limits, Some(json!({"limits": []}))).await;
    assert_error(
        &answer,
        StatusCode::BAD_REQUEST,
        "invalid_request",
        "limits: must hold at least one limit",
    );
    let answer = refused("PUT", limits, Some(json!({"limits": {"requests": 1}}))).await;
    assert_error(
        &answer,
        StatusCode::BAD_REQUEST,
        "malformed_json",
        "malformed JSON: limits: invalid type",
    );
    // an unknown field of the body
    let body = json!({"limits": [{"requests": 1, "per": "second"}], "ttl": 60});
    let answer = refused("PUT", limits, Some(body)).await;
    assert_error(
        &answer,
        StatusCode::BAD_REQUEST,
        "malformed_json",
        "malformed JSON: ttl: unknown field `ttl`, expected one of `limits`, `ttl_s`, `reason`",
    );
    // a target that is not a rule or rule/tier
    let answer = refused(
        "PUT",
        "/admin/v1/overrides/limits/api/gold/extra",
        Some(json!({"limits": [{"requests": 1, "per": "second"}]})),
    )
    .await;
    assert_error(
        &answer,
        StatusCode::BAD_REQUEST,
        "invalid_request",
        "target: must be a rule's name, or rule/tier",
    );

    // keys
    let answer = refused("PUT", keys, Some(json!({"key": "alice", "action": "ban"}))).await;
    assert_error(
        &answer,
        StatusCode::BAD_REQUEST,
        "malformed_json",
        "malformed JSON: action: unknown variant `ban`, expected `block` or `allow`",
    );
    let answer = refused("PUT", keys, Some(json!({"key": "alice"}))).await;
    assert_error(
        &answer,
        StatusCode::BAD_REQUEST,
        "invalid_request",
        "action: give the key an action (block or allow) or limits of its own, one of the two",
    );
    let cases = [
        (json!([]), "key: must hold at least one part"),
        (json!(""), "key: must not be empty"),
        (json!(["alice", ""]), "key[1]: must not be empty"),
        (json!(["alice", 7]), "key[1]: must be a string"),
        (
            json!({"user": "alice"}),
            "key: must be the key's parts in order",
        ),
        (json!("a\u{1f}b"), "key: must not hold U+001F"),
        (json!("k".repeat(600)), "key: longer than 512 bytes"),
    ];
    for (key, message) in cases {
        let answer = refused("PUT", keys, Some(json!({"key": key, "action": "block"}))).await;
        assert_error(&answer, StatusCode::BAD_REQUEST, "invalid_request", message);
    }
    let long_rule = format!("/admin/v1/overrides/keys/{}", "r".repeat(65));
    let answer = call(
        &state,
        "PUT",
        &long_rule,
        Some(ALICE),
        Body::from(json!({"key": "a", "action": "block"}).to_string()),
    )
    .await;
    assert_error(
        &answer,
        StatusCode::BAD_REQUEST,
        "invalid_request",
        "rule: must be a rule's name",
    );
    let answer = refused(
        "PUT",
        "/admin/v1/overrides/keys/a%20b",
        Some(json!({"key": "a", "action": "block"})),
    )
    .await;
    assert_error(
        &answer,
        StatusCode::BAD_REQUEST,
        "invalid_request",
        "rule: must be a rule's name",
    );
    let answer = refused(
        "PUT",
        "/admin/v1/overrides/keys/api/gold",
        Some(json!({"key": "a", "action": "block"})),
    )
    .await;
    assert_error(
        &answer,
        StatusCode::BAD_REQUEST,
        "invalid_request",
        "rule: must be a rule's name, without a tier",
    );
    let answer = refused("DELETE", keys, None).await;
    assert_error(
        &answer,
        StatusCode::BAD_REQUEST,
        "invalid_request",
        "key: missing",
    );
    let answer = refused(
        "DELETE",
        "/admin/v1/overrides/keys/api?key=a",
        Some(json!({"key": "a"})),
    )
    .await;
    assert_error(
        &answer,
        StatusCode::BAD_REQUEST,
        "invalid_request",
        "key: give the key in the body or as ?key=, not both",
    );
    let answer = refused("DELETE", "/admin/v1/overrides/keys/api?user=a", None).await;
    assert_error(
        &answer,
        StatusCode::BAD_REQUEST,
        "invalid_request",
        "query: user: unknown field `user`, expected `key`",
    );

    // bypass, ttl, reason
    let answer = refused(
        "PUT",
        "/admin/v1/overrides/bypass",
        Some(json!({"ttl_s": 60})),
    )
    .await;
    assert_error(
        &answer,
        StatusCode::BAD_REQUEST,
        "malformed_json",
        "malformed JSON: missing field `enabled`",
    );
    let answer = refused(
        "PUT",
        "/admin/v1/overrides/bypass",
        Some(json!({"enabled": "yes"})),
    )
    .await;
    assert_error(
        &answer,
        StatusCode::BAD_REQUEST,
        "malformed_json",
        "malformed JSON: enabled: invalid type",
    );
    let answer = refused(
        "PUT",
        "/admin/v1/overrides/bypass",
        Some(json!({"enabled": true, "ttl_s": 0})),
    )
    .await;
    assert_error(
        &answer,
        StatusCode::BAD_REQUEST,
        "invalid_request",
        "ttl_s: must be between 1 and 31622400",
    );
    let answer = refused(
        "PUT",
        "/admin/v1/overrides/bypass",
        Some(json!({"enabled": true, "ttl_s": -5})),
    )
    .await;
    assert_error(
        &answer,
        StatusCode::BAD_REQUEST,
        "malformed_json",
        "malformed JSON: ttl_s: invalid value",
    );
    let answer = refused(
        "PUT",
        "/admin/v1/overrides/bypass",
        Some(json!({"enabled": true, "reason": "x".repeat(513)})),
    )
    .await;
    assert_error(
        &answer,
        StatusCode::BAD_REQUEST,
        "invalid_request",
        "reason: longer than 512 bytes",
    );
    let answer = call(
        &state,
        "PUT",
        "/admin/v1/overrides/bypass",
        Some(ALICE),
        Body::from("{\"enabled\":"),
    )
    .await;
    assert_error(
        &answer,
        StatusCode::BAD_REQUEST,
        "malformed_json",
        "malformed JSON: ",
    );
    // bodies are bounded (64 KiB)
    let big = json!({"enabled": true, "reason": "x".repeat(70_000)});
    let answer = refused("PUT", "/admin/v1/overrides/bypass", Some(big)).await;
    assert_error(
        &answer,
        StatusCode::PAYLOAD_TOO_LARGE,
        "payload_too_large",
        "request body larger than 65536 bytes",
    );

    // the audit log's limit
    for path in [
        "/admin/v1/audit?limit=0",
        "/admin/v1/audit?limit=1001",
        "/admin/v1/audit?limit=x",
    ] {
        let answer = admin(&state, "GET", path, None).await;
        assert_error(
            &answer,
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "limit: must be an integer between 1 and 1000",
        );
    }

    // deleting what is not set: 404
    let answer = refused("DELETE", "/admin/v1/overrides/bypass", None).await;
    assert_error(
        &answer,
        StatusCode::NOT_FOUND,
        "not_found",
        "no bypass override is set",
    );
    let answer = refused("DELETE", "/admin/v1/overrides/keys/api?key=alice", None).await;
    assert_error(
        &answer,
        StatusCode::NOT_FOUND,
        "not_found",
        "no key override for [\"alice\"] in rule \"api\" is set",
    );

    // nothing was stored, nothing audited
    let answer = admin(&state, "GET", "/admin/v1/audit", None).await;
    assert_eq!(answer.body, json!({"entries": []}), "{answer:?}");
    assert_eq!(redis.text(&["DBSIZE"]).unwrap(), "0");
}

#[tokio::test]
async fn each_kind_is_set_read_deleted_and_audited() {
    let redis = Redis::start().unwrap();
    let state = admin_state(&redis.url());

    let bypass = put(
        &state,
        "/admin/v1/overrides/bypass",
        json!({"enabled": true, "reason": "incident 42"}),
    )
    .await;
    let v1 = version(&bypass);
    assert!(
        v1 > 1_600_000_000_000,
        "the first version is the clock in ms, plus one: {v1}"
    );
    let set_at = bypass["set_at_ms"].as_u64().unwrap();
    assert_eq!(v1, set_at + 1, "{bypass}");
    assert_eq!(
        bypass,
        json!({"version": v1, "enabled": true, "who": "alice", "reason": "incident 42",
               "set_at_ms": set_at, "expires_at_ms": null})
    );

    let limits = json!([{"requests": 100, "per": "minute"}]);
    let gold = admin_as(
        &state,
        BOB,
        "PUT",
        "/admin/v1/overrides/limits/api/gold",
        Some(json!({"limits": limits, "ttl_s": 600})),
    )
    .await;
    assert_eq!(gold.status, StatusCode::OK, "{gold:?}");
    let gold = gold.body;
    assert_eq!(version(&gold), v1 + 1);
    let gold_at = gold["set_at_ms"].as_u64().unwrap();
    assert_eq!(
        gold,
        json!({"version": v1 + 1, "target": "api/gold", "limits": limits, "who": "bob",
               "reason": null, "set_at_ms": gold_at, "expires_at_ms": gold_at + 600_000})
    );

    let blocked = put(
        &state,
        "/admin/v1/overrides/keys/api",
        json!({"key": ["alice", "GET"], "action": "block"}),
    )
    .await;
    assert_eq!(version(&blocked), v1 + 2);
    assert_eq!(blocked["rule"], "api");
    assert_eq!(blocked["key"], json!(["alice", "GET"]));
    let allowed = put(
        &state,
        "/admin/v1/overrides/keys/login",
        json!({"key": "203.0.113.7", "action": "allow", "reason": "partner"}),
    )
    .await;
    assert_eq!(version(&allowed), v1 + 3);
    assert_eq!(
        allowed["key"],
        json!(["203.0.113.7"]),
        "a string is a one-part key"
    );

    let view = admin(&state, "GET", "/admin/v1/overrides", None).await;
    assert_eq!(view.status, StatusCode::OK, "{view:?}");
    let at = |answer: &Value| answer["set_at_ms"].clone();
    assert_eq!(
        view.body,
        json!({
            "version": v1 + 3,
            "bypass": {"enabled": true, "who": "alice", "reason": "incident 42",
                       "set_at_ms": set_at, "expires_at_ms": null},
            "limits": {"api/gold": {"limits": limits, "who": "bob", "reason": null,
                                    "set_at_ms": gold_at, "expires_at_ms": gold_at + 600_000}},
            "bulkheads": {},
            "keys": {
                "api": {"alice\u{1f}GET": {"key": ["alice", "GET"], "action": "block", "who": "alice",
                                          "reason": null, "set_at_ms": at(&blocked), "expires_at_ms": null}},
                "login": {"203.0.113.7": {"key": ["203.0.113.7"], "action": "allow", "who": "alice",
                                         "reason": "partner", "set_at_ms": at(&allowed), "expires_at_ms": null}},
            },
            "key_limits": {},
        })
    );

    // a PUT replaces: the key is now allowed, still one entry
    let replaced = put(
        &state,
        "/admin/v1/overrides/keys/api",
        json!({"key": ["alice", "GET"], "action": "allow"}),
    )
    .await;
    assert_eq!(version(&replaced), v1 + 4);
    assert_eq!(redis.text(&["HLEN", KEYS_KEY]).unwrap(), "2");

    // every key is under the one hash tag
    let Reply::Array(stored) = redis.query(&["KEYS", "*"]).unwrap() else {
        panic!()
    };
    for key in &stored {
        let key = key.text().unwrap();
        assert!(KEYS.contains(&key), "{key}");
    }

    // deletes: ?key= for a one-part key, the body for any
    let answer = admin(
        &state,
        "DELETE",
        "/admin/v1/overrides/keys/login?key=203.0.113.7",
        None,
    )
    .await;
    assert_eq!(answer.body, json!({"version": v1 + 5}), "{answer:?}");
    let answer = admin(
        &state,
        "DELETE",
        "/admin/v1/overrides/keys/api",
        Some(json!({"key": ["alice", "GET"]})),
    )
    .await;
    assert_eq!(answer.body, json!({"version": v1 + 6}), "{answer:?}");
    let answer = admin(
        &state,
        "DELETE",
        "/admin/v1/overrides/limits/api/gold",
        None,
    )
    .await;
    assert_eq!(answer.body, json!({"version": v1 + 7}), "{answer:?}");
    let answer = admin_as(&state, BOB, "DELETE", "/admin/v1/overrides/bypass", None).await;
    assert_eq!(answer.body, json!({"version": v1 + 8}), "{answer:?}");
    let answer = admin(
        &state,
        "DELETE",
        "/admin/v1/overrides/limits/api/gold",
        None,
    )
    .await;
    assert_error(
        &answer,
        StatusCode::NOT_FOUND,
        "not_found",
        "no limits override for \"api/gold\" is set",
    );
    let view = admin(&state, "GET", "/admin/v1/overrides", None).await;
    assert_eq!(
        view.body,
        json!({"version": v1 + 8, "bypass": null, "limits": {}, "bulkheads": {}, "keys": {},
               "key_limits": {}})
    );
    // only the version, the audit log, the change log and the sizes are left
    assert_eq!(redis.text(&["DBSIZE"]).unwrap(), "4");

    // the audit log: newest first, who, what, on what, with which value
    let answer = admin(&state, "GET", "/admin/v1/audit?limit=3", None).await;
    let entries = answer.body["entries"].as_array().unwrap();
    let summary: Vec<(&str, &str, &str, u64)> = entries
        .iter()
        .map(|e| {
            (
                e["who"].as_str().unwrap(),
                e["action"].as_str().unwrap(),
                e["target"].as_str().unwrap(),
                e["version"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        [
            ("bob", "clear bypass", "bypass", v1 + 8),
            ("alice", "delete limits", "api/gold", v1 + 7),
            ("alice", "delete key", "api", v1 + 6),
        ]
    );
    assert_eq!(entries[2]["value"], json!({"key": ["alice", "GET"]}));
    assert!(entries[0]["at_ms"].as_u64().unwrap() >= set_at);
    let all = admin(&state, "GET", "/admin/v1/audit", None).await.body;
    let all = all["entries"].as_array().unwrap();
    assert_eq!(all.len(), 9);
    assert_eq!(all, &audit_log(&redis)[..]);
    assert_eq!(
        all[8],
        json!({"at_ms": set_at, "version": v1, "who": "alice", "action": "set bypass", "target": "bypass",
               "value": {"enabled": true, "ttl_s": null, "reason": "incident 42"}})
    );
    assert_eq!(
        all[7]["value"],
        json!({"limits": limits, "ttl_s": 600, "reason": null})
    );
    assert_eq!(all[7]["who"], "bob");
    assert_eq!(
        all[4]["value"],
        json!({"key": ["alice", "GET"], "action": "allow", "ttl_s": null, "reason": null})
    );

    let text = metrics(&state).await;
    for line in [
        "sluice_admin_changes_total{action=\"set_key\"} 3".to_owned(),
        "sluice_admin_changes_total{action=\"delete_key\"} 2".to_owned(),
        "sluice_admin_changes_total{action=\"set_limits\"} 1".to_owned(),
        "sluice_admin_changes_total{action=\"clear_bypass\"} 1".to_owned(),
        format!("sluice_overrides_version {}", v1 + 8),
    ] {
        assert!(text.contains(&line), "{line}: {text}");
    }
}

#[tokio::test]
async fn a_sync_carries_the_bypass_and_the_set_when_its_version_differs() {
    let redis = Redis::start().unwrap();
    // every sync reads the set (syncs_close_together_share_one_read shows the default)
    let every_sync = ["--overrides-refresh-ms", "0"];
    let state = admin_state_with(&redis.url(), &every_sync);
    // nothing set: a new proxy (version 0) gets no set
    let answer = sync(&state, 0).await;
    assert_eq!(
        answer.body["hints"],
        json!({"next_sync_ms": 100, "overrides": {"bypass": false}})
    );
    // a proxy with a version the service does not have (Redis lost its data) gets the empty set
    let answer = sync(&state, 41).await;
    assert_eq!(
        hinted(&answer),
        &json!({"bypass": false, "live": {"version": 0}})
    );
    // the bypass gauge an alert watches (ops/): 0 while off
    assert!(metrics(&state).await.contains("\nsluice_bypass 0\n"));

    put(
        &state,
        "/admin/v1/overrides/bypass",
        json!({"enabled": true}),
    )
    .await;
    put(
        &state,
        "/admin/v1/overrides/limits/api",
        json!({"limits": [{"requests": 5, "per": "second", "burst": 10}]}),
    )
    .await;
    put(
        &state,
        "/admin/v1/overrides/keys/api",
        json!({"key": ["alice", "GET"], "action": "block"}),
    )
    .await;
    let v = version(
        &put(
            &state,
            "/admin/v1/overrides/keys/login",
            json!({"key": "10.0.0.1", "action": "allow"}),
        )
        .await,
    );
    let live = json!({
        "version": v,
        "limits": {"api": [{"requests": 5, "per": "second", "burst": 10}]},
        "keys": {"api": {"alice\u{1f}GET": "block"}, "login": {"10.0.0.1": "allow"}},
    });
    for proxy_version in [0, v - 1, v + 1] {
        let answer = sync(&state, proxy_version).await;
        assert_eq!(
            hinted(&answer),
            &json!({"bypass": true, "live": live}),
            "{proxy_version}"
        );
    }
    // up to date: the bypass, no set
    let answer = sync(&state, v).await;
    assert_eq!(hinted(&answer), &json!({"bypass": true}));
    // 1 once a sync read the set with the bypass on
    assert!(metrics(&state).await.contains("\nsluice_bypass 1\n"));

    // a second replica on the same Redis: a change made on either is in the next answer of both,
    // whatever each remembers
    let other = admin_state_with(&redis.url(), &every_sync);
    let answer = sync(&other, 0).await;
    assert_eq!(hinted(&answer)["live"], live);
    let changed = admin(
        &other,
        "DELETE",
        "/admin/v1/overrides/keys/login?key=10.0.0.1",
        None,
    )
    .await;
    assert_eq!(changed.body, json!({"version": v + 1}), "{changed:?}");
    let answer = sync(&state, v).await;
    assert_eq!(
        hinted(&answer),
        &json!({"bypass": true, "live": {
            "version": v + 1,
            "limits": {"api": [{"requests": 5, "per": "second", "burst": 10}]},
            "keys": {"api": {"alice\u{1f}GET": "block"}},
        }})
    );
    let off = put(
        &other,
        "/admin/v1/overrides/bypass",
        json!({"enabled": false}),
    )
    .await;
    assert_eq!(version(&off), v + 2);
    let answer = sync(&state, v + 1).await;
    assert_eq!(hinted(&answer)["bypass"], false);
    assert_eq!(hinted(&answer)["live"]["version"], v + 2);
    let answer = sync(&state, v + 2).await;
    assert_eq!(hinted(&answer), &json!({"bypass": false}));
    assert!(metrics(&state).await.contains("\nsluice_bypass 0\n"));

    let text = metrics(&state).await;
    assert!(text.contains("sluice_overrides_sent_total 6"), "{text}");
    assert!(
        text.contains("sluice_script_calls_total{script=\"overrides\"}"),
        "{text}"
    );
}

/// Within --overrides-refresh-ms of a read, a replica answers syncs from what it read: a change
/// made through another replica waits for the refresh, one made through this replica does not.
#[tokio::test]
async fn syncs_close_together_share_one_read() {
    let redis = Redis::start().unwrap();
    let a = admin_state(&redis.url());
    let long = admin_state_with(&redis.url(), &["--overrides-refresh-ms", "600000"]);
    let short = admin_state_with(&redis.url(), &["--overrides-refresh-ms", "200"]);
    let v = version(&put(&a, "/admin/v1/overrides/bypass", json!({"enabled": true})).await);
    for replica in [&long, &short] {
        let answer = sync(replica, 0).await;
        assert_eq!(hinted(&answer)["live"]["version"], v);
        // the same version again: answered from memory
        assert_eq!(hinted(&sync(replica, v).await), &json!({"bypass": true}));
        // a proxy that lags gets the set this replica holds, from memory too
        assert_eq!(hinted(&sync(replica, 0).await)["live"]["version"], v);
    }
    let calls = |text: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix("sluice_overrides_reads_shared_total "))
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    assert!(calls(&metrics(&long).await) >= 2);

    // changed through another replica: the long refresh still answers the old version...
    let off = put(&a, "/admin/v1/overrides/bypass", json!({"enabled": false})).await;
    assert_eq!(version(&off), v + 1);
    assert_eq!(hinted(&sync(&long, v).await), &json!({"bypass": true}));
    // ...the short one reads again once its refresh is over
    tokio::time::sleep(Duration::from_millis(250)).await;
    let answer = sync(&short, v).await;
    assert_eq!(hinted(&answer)["bypass"], false);
    assert_eq!(hinted(&answer)["live"]["version"], v + 1);

    // changed through this replica: its next sync reads, whatever the refresh
    let on = put(
        &long,
        "/admin/v1/overrides/bypass",
        json!({"enabled": true}),
    )
    .await;
    assert_eq!(version(&on), v + 2);
    let answer = sync(&long, v).await;
    assert_eq!(hinted(&answer)["bypass"], true);
    assert_eq!(hinted(&answer)["live"]["version"], v + 2);
}

fn key_change(key: &str, ttl_s: Option<u64>) -> Change {
    Change::SetKey {
        rule: "api".into(),
        key: vec![key.into()],
        action: KeyAction::Block,
        note: Note {
            ttl_s,
            reason: None,
        },
    }
}

/// With the tests' clock: an entry is answered until its ttl runs out, and from then on never;
/// its expiry changes the version, so every proxy's next sync drops it.
#[tokio::test]
async fn an_expiry_changes_what_the_next_sync_sees() {
    let redis = Redis::start().unwrap();
    let state = admin_state(&redis.url());
    let at = |ms: u64| T0_US + ms * 1_000;
    let write = |change: Change, ms: u64| {
        let state = state.clone();
        async move {
            overrides::write(&state, "alice", &change, at(ms))
                .await
                .unwrap()
        }
    };
    let bypass = Change::SetBypass {
        enabled: true,
        note: Note {
            ttl_s: Some(3),
            reason: Some("drill".into()),
        },
    };
    let first = write(bypass, 0).await;
    assert_eq!(first.version, T0_MS + 1);
    assert_eq!(first.expires_at_ms, Some(T0_MS + 3_000));
    write(key_change("short", Some(2)), 0).await;
    let v = write(key_change("kept", None), 0).await.version;

    let sync_at = |version: u64, ms: u64| {
        let state = state.clone();
        async move {
            let answer = overrides::for_sync(&state, version, false, at(ms)).await;
            (answer.bypass, answer.live)
        }
    };
    let keys = |live: &sluice_protocol::LiveOverrides| -> Vec<String> {
        live.keys["api"].keys().cloned().collect()
    };
    let (on, live) = sync_at(0, 1_999).await;
    let live = live.unwrap();
    assert!(on);
    assert_eq!(
        (live.version, keys(&live)),
        (v, vec!["kept".into(), "short".into()])
    );
    let (on, live) = sync_at(v, 1_999).await;
    assert!(on && live.is_none());

    // 2 s: the key expires; a proxy at v gets the set without it
    let (on, live) = sync_at(v, 2_000).await;
    let live = live.unwrap();
    assert!(on);
    assert_eq!((live.version, keys(&live)), (v + 1, vec!["kept".into()]));
    let (on, live) = sync_at(v + 1, 2_500).await;
    assert!(on && live.is_none(), "no more change");
    // 3 s: the bypass expires
    let (on, live) = sync_at(v + 1, 3_000).await;
    assert!(!on);
    assert_eq!(live.unwrap().version, v + 2);

    let view = overrides::view(&state, at(3_000)).await.unwrap();
    assert_eq!(view["version"], v + 2);
    assert_eq!(view["bypass"], Value::Null);
    assert_eq!(view["keys"]["api"].as_object().unwrap().len(), 1);
    let log = audit_log(&redis);
    assert_eq!(
        log[0],
        json!({"at_ms": T0_MS + 3_000, "version": v + 2, "who": "(ttl)", "action": "expire bypass",
               "target": "bypass", "value": null})
    );
    assert_eq!(
        log[1],
        json!({"at_ms": T0_MS + 2_000, "version": v + 1, "who": "(ttl)", "action": "expire key",
               "target": "api", "value": {"key": ["short"]}})
    );
    assert_eq!(log.len(), 5);
    assert_eq!(redis.text(&["ZCARD", overrides::EXPIRY_KEY]).unwrap(), "0");
    let text = metrics(&state).await;
    assert!(text.contains("sluice_overrides_expired_total 2"), "{text}");
}

/// A sync answer says when each key set with a ttl expires (the whole set, and a delta for the
/// keys it sets), so a proxy tells a blocked client the time left. Whoever holds an admin
/// credential may give every key a ttl: the expiries count in the set's size, so the set a proxy
/// receives stays within what the service counted (and the proxies' bound).
#[tokio::test]
async fn a_sync_carries_when_each_key_expires() {
    let redis = Redis::start().unwrap();
    let state = admin_state(&redis.url());
    let at = |ms: u64| T0_US + ms * 1_000;
    let write = |change: Change, ms: u64| {
        let state = state.clone();
        async move {
            overrides::write(&state, "alice", &change, at(ms))
                .await
                .unwrap()
        }
    };
    write(key_change("short", Some(2)), 0).await;
    let v = write(key_change("kept", None), 0).await.version;
    let whole = overrides::for_sync(&state, 0, false, at(1))
        .await
        .live
        .unwrap();
    assert_eq!(whole.version, v);
    assert_eq!(
        whole.expires,
        [(
            "api".to_string(),
            [("short".to_string(), T0_MS + 2_000)].into()
        )]
        .into()
    );
    let counted: usize = redis
        .text(&["HGET", overrides::SIZES_KEY, "set_bytes"])
        .unwrap()
        .parse()
        .unwrap();
    let sent = serde_json::to_string(&whole).unwrap().len();
    assert!(
        sent <= counted + sluice_protocol::OVERRIDES_FRAME_BYTES,
        "{sent} bytes sent, {counted} counted"
    );
    // a delta: the key it sets with a ttl, with its expiry; one set again without, with none
    write(key_change("later", Some(10)), 500).await;
    let w = write(key_change("short", None), 500).await.version;
    let delta = overrides::for_sync(&state, v, true, at(600))
        .await
        .delta
        .unwrap();
    assert_eq!((delta.from, delta.version), (v, w));
    assert_eq!(delta.keys["api"].len(), 2);
    assert_eq!(
        delta.expires,
        [(
            "api".to_string(),
            [("later".to_string(), T0_MS + 10_500)].into()
        )]
        .into()
    );
    // every entry gone, its expiry's bytes with it
    for key in ["short", "kept", "later"] {
        let change = Change::DeleteKey {
            rule: "api".into(),
            key: vec![key.into()],
        };
        write(change, 700).await;
    }
    assert_eq!(
        redis
            .text(&["HGET", overrides::SIZES_KEY, "set_bytes"])
            .unwrap(),
        "0"
    );
}

/// The same on the real clock, through the HTTP API: a 1 s ttl is gone from the sync answers
/// within a few seconds (polled, bounded).
#[tokio::test]
async fn a_short_ttl_expires_on_the_real_clock() {
    let redis = Redis::start().unwrap();
    let state = admin_state(&redis.url());
    let set = put(
        &state,
        "/admin/v1/overrides/keys/api",
        json!({"key": "brief", "action": "block", "ttl_s": 1}),
    )
    .await;
    let v = version(&set);
    assert_eq!(
        set["expires_at_ms"],
        set["set_at_ms"].as_u64().unwrap() + 1_000
    );
    let answer = sync(&state, 0).await;
    assert_eq!(
        hinted(&answer)["live"]["keys"],
        json!({"api": {"brief": "block"}})
    );
    let started = Instant::now();
    loop {
        let answer = sync(&state, v).await;
        if let Some(live) = hinted(&answer).get("live") {
            assert_eq!(live, &json!({"version": v + 1}), "{answer:?}");
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(5), "never expired");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let view = admin(&state, "GET", "/admin/v1/overrides", None).await;
    assert_eq!(view.body["keys"], json!({}));
}

#[tokio::test]
async fn overrides_survive_a_service_restart() {
    let redis = Redis::start().unwrap();
    let first = admin_state(&redis.url());
    put(
        &first,
        "/admin/v1/overrides/bypass",
        json!({"enabled": true, "ttl_s": 3600}),
    )
    .await;
    let v = version(
        &put(
            &first,
            "/admin/v1/overrides/keys/api",
            json!({"key": "mallory", "action": "block"}),
        )
        .await,
    );
    let before = admin(&first, "GET", "/admin/v1/overrides", None).await.body;
    drop(first);

    let second = admin_state(&redis.url());
    let after = admin(&second, "GET", "/admin/v1/overrides", None)
        .await
        .body;
    assert_eq!(after, before);
    let answer = sync(&second, 0).await;
    assert_eq!(
        hinted(&answer),
        &json!({"bypass": true, "live": {"version": v, "keys": {"api": {"mallory": "block"}}}})
    );
    let answer = sync(&second, v).await;
    assert_eq!(hinted(&answer), &json!({"bypass": true}));
}

/// When Redis fails for the overrides (here the version key holds a hash, so the script errors),
/// the sync is answered its grants, no set (the proxy keeps its own), and the last bypass read.
#[tokio::test]
async fn a_failed_overrides_read_keeps_the_grants_and_the_last_bypass() {
    let redis = Redis::start().unwrap();
    // every sync reads (the failure is what this test is about)
    let state = admin_state_with(&redis.url(), &["--overrides-refresh-ms", "0"]);
    let v = version(
        &put(
            &state,
            "/admin/v1/overrides/bypass",
            json!({"enabled": true}),
        )
        .await,
    );
    let answer = sync(&state, 0).await;
    assert_eq!(hinted(&answer)["bypass"], true);

    redis.query(&["DEL", VERSION_KEY]).unwrap();
    redis
        .query(&["HSET", VERSION_KEY, "not", "a string"])
        .unwrap();
    for proxy_version in [0, v] {
        let answer = sync(&state, proxy_version).await;
        assert_eq!(hinted(&answer), &json!({"bypass": true}), "{answer:?}");
    }
    // a replica that never read the set answers no bypass
    let fresh = admin_state(&redis.url());
    let answer = sync(&fresh, 0).await;
    assert_eq!(hinted(&answer), &json!({"bypass": false}));
    // the admin API says Redis failed
    let answer = admin(&state, "GET", "/admin/v1/overrides", None).await;
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE, "{answer:?}");
    let text = metrics(&state).await;
    assert!(
        text.contains("sluice_redis_seconds_count{op=\"overrides\",outcome=\"error\"} 3"),
        "{text}"
    );

    redis.query(&["DEL", VERSION_KEY]).unwrap();
    redis.query(&["SET", VERSION_KEY, &v.to_string()]).unwrap();
    let answer = sync(&state, 0).await;
    assert_eq!(
        hinted(&answer),
        &json!({"bypass": true, "live": {"version": v}})
    );
}

/// At most MAX_KEY_OVERRIDES keys and MAX_LIMIT_OVERRIDES limits: a new entry past them is
/// refused naming the bound; an entry already set is still replaced, and a delete makes room.
#[tokio::test]
async fn the_set_is_bounded() {
    let redis = Redis::start().unwrap();
    let state = admin_state(&redis.url());
    let fill = |hash: &str, count: u64, field: &dyn Fn(u64) -> String, value: &str| {
        let fields: Vec<String> = (0..count).map(field).collect();
        let mut command = vec!["HSET", hash];
        for field in &fields {
            command.push(field);
            command.push(value);
        }
        redis.query(&command).unwrap();
    };
    fill(
        KEYS_KEY,
        MAX_KEY_OVERRIDES - 1,
        &|i| format!("api\u{1f}user-{i}"),
        "block",
    );
    fill(
        LIMITS_KEY,
        MAX_LIMIT_OVERRIDES - 1,
        &|i| format!("rule-{i}"),
        r#"[{"requests":1,"per":"second"}]"#,
    );

    let key = |name: &str| json!({"key": name, "action": "block"});
    put(&state, "/admin/v1/overrides/keys/api", key("last")).await;
    let answer = admin(
        &state,
        "PUT",
        "/admin/v1/overrides/keys/other",
        Some(key("one-more")),
    )
    .await;
    assert_error(
        &answer,
        StatusCode::BAD_REQUEST,
        "invalid_request",
        "key: at most 10000 key overrides are kept: delete one first",
    );
    put(
        &state,
        "/admin/v1/overrides/keys/api",
        json!({"key": "user-7", "action": "allow"}),
    )
    .await;
    admin(
        &state,
        "DELETE",
        "/admin/v1/overrides/keys/api?key=user-8",
        None,
    )
    .await;
    put(&state, "/admin/v1/overrides/keys/other", key("one-more")).await;
    assert_eq!(
        redis.text(&["HLEN", KEYS_KEY]).unwrap(),
        MAX_KEY_OVERRIDES.to_string()
    );

    let limits = json!({"limits": [{"requests": 1, "per": "second"}]});
    put(&state, "/admin/v1/overrides/limits/last", limits.clone()).await;
    let answer = admin(
        &state,
        "PUT",
        "/admin/v1/overrides/limits/one-more",
        Some(limits.clone()),
    )
    .await;
    assert_error(
        &answer,
        StatusCode::BAD_REQUEST,
        "invalid_request",
        "target: at most 1000 limit and bulkhead overrides are kept: delete one first",
    );
    put(&state, "/admin/v1/overrides/limits/rule-3", limits).await;

    // the whole set still travels in one answer
    let answer = sync(&state, 0).await;
    let live = &hinted(&answer)["live"];
    assert_eq!(live["keys"]["api"].as_object().unwrap().len(), 9_999);
    assert_eq!(live["limits"].as_object().unwrap().len(), 1_000);
}

/// On a Redis Cluster every overrides key lives on one node (one hash tag), so one script call
/// changes and reads the set; a sync whose entries span the slots is answered it.
#[tokio::test]
async fn live_overrides_on_a_cluster() {
    let cluster = RedisCluster::start(3).unwrap();
    let state = admin_state(&cluster.url_list());
    assert!(state.backend.is_cluster());
    put(
        &state,
        "/admin/v1/overrides/bypass",
        json!({"enabled": true, "ttl_s": 600}),
    )
    .await;
    put(
        &state,
        "/admin/v1/overrides/limits/api/gold",
        json!({"limits": [{"requests": 100, "per": "minute"}]}),
    )
    .await;
    let v = version(
        &put(
            &state,
            "/admin/v1/overrides/keys/api",
            json!({"key": ["alice", "GET"], "action": "block"}),
        )
        .await,
    );

    let entries: Vec<Value> = (0..20)
        .map(|i| json!({"key": format!("user:{i}"), "limits": [{"requests": 10, "period_ms": 1000, "burst": 10}], "spent": 0, "denied": 0}))
        .collect();
    let body =
        json!({"proxy": "p1", "interval_ms": 100, "entries": entries, "overrides_version": 0});
    let answer = post(&state, "/v1/sync", &body).await;
    assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
    assert_eq!(answer.body["grants"].as_array().unwrap().len(), 20);
    assert_eq!(
        hinted(&answer),
        &json!({"bypass": true, "live": {
            "version": v,
            "limits": {"api/gold": [{"requests": 100, "per": "minute"}]},
            "keys": {"api": {"alice\u{1f}GET": "block"}},
        }})
    );

    let slot = cluster.slot(VERSION_KEY).unwrap();
    for key in KEYS {
        assert_eq!(cluster.slot(key).unwrap(), slot, "{key}");
    }
    let holding: Vec<usize> = cluster
        .nodes()
        .iter()
        .map(
            |node| match node.query(&["KEYS", "sluice:{overrides}:*"]).unwrap() {
                Reply::Array(keys) => keys.len(),
                other => panic!("{other:?}"),
            },
        )
        .collect();
    assert_eq!(holding.iter().filter(|&&n| n > 0).count(), 1, "{holding:?}");
    assert_eq!(
        holding.iter().sum::<usize>(),
        9,
        "every key of the set: {holding:?}"
    );

    let answer = admin(
        &state,
        "DELETE",
        "/admin/v1/overrides/keys/api",
        Some(json!({"key": ["alice", "GET"]})),
    )
    .await;
    assert_eq!(answer.body, json!({"version": v + 1}));
    let answer = admin(&state, "GET", "/admin/v1/audit?limit=1", None).await;
    assert_eq!(answer.body["entries"][0]["action"], "delete key");
}

/// The text without its terminal colors (`ESC [ … m`).
fn without_colors(text: &str) -> String {
    let mut plain = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            plain.push(c);
        }
    }
    plain
}

/// One HTTP/1.1 request on a new connection (`Connection: close`): the status and the body.
fn http(address: SocketAddr, method: &str, path: &str, token: &str, body: &str) -> (u16, Value) {
    let mut stream = TcpStream::connect(address).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: sluice\r\nAuthorization: Bearer {token}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).unwrap();
    let status = text[9..12].parse().unwrap();
    let (_, body) = text.split_once("\r\n\r\n").unwrap();
    (status, serde_json::from_str(body).unwrap_or(Value::Null))
}

/// The real binary: `--admin-tokens-file`, a PUT over TCP, the sync answer, the audit line in
/// its log, and the set again after a restart.
#[test]
fn the_binary_serves_the_admin_api() {
    let redis = Redis::start().unwrap();
    let file = TextFile::new(ADMINS);
    let options = ServiceOptions::new(redis.url())
        .arg("--admin-tokens-file")
        .arg(file.path());
    let mut service = Service::start_with(options).unwrap();
    let address = service.address().unwrap();
    let body = json!({"key": ["mallory"], "action": "block", "reason": "abuse"}).to_string();
    let (status, set) = http(address, "PUT", "/admin/v1/overrides/keys/api", ALICE, &body);
    assert_eq!(status, 200, "{set} {}", service.log());
    let v = version(&set);
    let (status, _) = http(
        address,
        "PUT",
        "/admin/v1/overrides/keys/api",
        service.token(),
        &body,
    );
    assert_eq!(status, 401);

    let sync = json!({"proxy": "p1", "interval_ms": 100, "entries": []}).to_string();
    let reply = service.post("/v1/sync", &sync).unwrap();
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(
        reply.json().unwrap()["hints"]["overrides"],
        json!({"bypass": false, "live": {"version": v, "keys": {"api": {"mallory": "block"}}}})
    );
    let reply = service
        .post_with_token("/v1/sync", &sync, Some(ALICE))
        .unwrap();
    assert_eq!(reply.status, 401);
    let log = without_colors(&service.log());
    assert!(
        log.lines().any(|line| line.contains("override changed")
            && line.contains("who=\"alice\"")
            && line.contains("action=\"set key\"")
            && line.contains("target=\"api\"")),
        "{log}"
    );

    service.restart().unwrap();
    let (status, view) = http(address, "GET", "/admin/v1/overrides", BOB, "");
    assert_eq!(status, 200, "{view}");
    assert_eq!(view["version"], v);
    assert_eq!(view["keys"]["api"]["mallory"]["reason"], "abuse");
    let status = service.terminate(Duration::from_secs(10)).unwrap();
    assert!(status.success(), "{status:?}");
}

/// SIGHUP to the service: its credentials files are read again.
fn hang_up(service: &Service) {
    let status = std::process::Command::new("kill")
        .args(["-HUP", &service.pid().unwrap().to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill -HUP: {status:?}");
}

/// The real binary's tokens files, read again on SIGHUP: a file that gives one token to two names
/// (or holds the same line twice) is refused naming its flag and line, with an error in the log,
/// and the set in use stays, for `--tokens-file` and `--admin-tokens-file` alike. An admin token
/// rotates as a proxy's does: the new one beside the old, both valid; the old one removed and
/// refused from that reload on, while the new one still reads and changes overrides.
#[test]
fn a_token_given_twice_is_refused_on_reload_and_an_admin_token_rotates() {
    let redis = Redis::start().unwrap();
    let tokens = TextFile::new("fleet proxy-old\n");
    let admins = TextFile::new("oncall admin-old\n");
    let mut options = ServiceOptions::new(redis.url())
        .arg("--tokens-file")
        .arg(tokens.path())
        .arg("--admin-tokens-file")
        .arg(admins.path());
    // No shared token: the files are the only credentials.
    options.token = String::new();
    let service = Service::start_with(options).unwrap();
    let lines = |what: &str, flag: &str| -> Vec<String> {
        without_colors(&service.log())
            .lines()
            .filter(|line| line.contains(what) && line.contains(flag))
            .map(str::to_owned)
            .collect()
    };
    let refusals = |flag: &str| lines("credentials: reload refused", &format!("{flag} "));
    let reloads = |flag: &str| lines("credentials: reloaded", &format!("flag=\"{flag}\"")).len();
    let sync = json!({"proxy": "p1", "interval_ms": 100, "entries": []}).to_string();
    let sync_as = |token: &str| {
        service
            .post_with_token("/v1/sync", &sync, Some(token))
            .unwrap()
            .status
    };
    let admin_as = |token: &str| {
        service
            .request("GET", "/admin/v1/overrides", Some(token), None)
            .unwrap()
            .status
    };
    assert_eq!((sync_as("proxy-old"), admin_as("admin-old")), (200, 200));

    // (the file, its flag, the reason named); `proxy-new`, of the refused files, must never work
    let cases = [
        (
            "fleet proxy-old\nfleet proxy-new\nrogue proxy-new\n",
            "--tokens-file",
            "line 3: this token is already given to a name",
        ),
        (
            "fleet proxy-old\nfleet proxy-old\n",
            "--tokens-file",
            "line 2: this token is already given to a name",
        ),
    ];
    for (text, flag, reason) in cases {
        let before = refusals(flag).len();
        std::fs::write(tokens.path(), text).unwrap();
        hang_up(&service);
        assert!(
            eventually(Duration::from_secs(10), || refusals(flag).len() > before),
            "{text:?}: no refusal logged\n{}",
            service.log()
        );
        let refused = refusals(flag);
        let line = refused.last().unwrap();
        assert!(
            line.contains("ERROR") && line.contains(&format!("{flag} {}: {reason}", tokens.path())),
            "{text:?}: {line}"
        );
        assert_eq!(
            sync_as("proxy-old"),
            200,
            "{text:?}: the set in use was dropped"
        );
        assert_eq!(
            sync_as("proxy-new"),
            401,
            "{text:?}: the refused file was taken"
        );
    }
    std::fs::write(tokens.path(), "fleet proxy-old\n").unwrap();

    // 1. The new admin token beside the old one: both open the admin API.
    std::fs::write(admins.path(), "oncall admin-old\noncall admin-new\n").unwrap();
    hang_up(&service);
    assert!(
        eventually(Duration::from_secs(10), || reloads("--admin-tokens-file")
            == 1),
        "{}",
        service.log()
    );
    assert_eq!((admin_as("admin-old"), admin_as("admin-new")), (200, 200));
    // 2. The new token given to a second name as well: refused naming the line, both still valid.
    let before = refusals("--admin-tokens-file").len();
    std::fs::write(
        admins.path(),
        "oncall admin-old\noncall admin-new\nintruder admin-new\n",
    )
    .unwrap();
    hang_up(&service);
    assert!(
        eventually(Duration::from_secs(10), || {
            refusals("--admin-tokens-file").len() > before
        }),
        "{}",
        service.log()
    );
    let refused = refusals("--admin-tokens-file");
    assert!(
        refused.last().unwrap().contains(&format!(
            "--admin-tokens-file {}: line 3: this token is already given to a name",
            admins.path()
        )),
        "{refused:?}"
    );
    assert_eq!((admin_as("admin-old"), admin_as("admin-new")), (200, 200));
    // 3. The old token removed: refused from that reload on; the new one still changes overrides.
    std::fs::write(admins.path(), "oncall admin-new\n").unwrap();
    hang_up(&service);
    assert!(
        eventually(Duration::from_secs(10), || reloads("--admin-tokens-file")
            == 2),
        "{}",
        service.log()
    );
    assert_eq!(admin_as("admin-old"), 401);
    let bypass = json!({"enabled": true, "ttl_s": 60, "reason": "rotation"}).to_string();
    let set = service
        .request(
            "PUT",
            "/admin/v1/overrides/bypass",
            Some("admin-new"),
            Some(&bypass),
        )
        .unwrap();
    assert_eq!(set.status, 200, "{set:?}");
    let audit = service
        .request("GET", "/admin/v1/audit", Some("admin-new"), None)
        .unwrap();
    assert_eq!(audit.status, 200, "{audit:?}");
    let entries = audit.json().unwrap()["entries"].clone();
    let entries = entries.as_array().unwrap();
    assert!(
        entries
            .iter()
            .any(|e| e["who"] == "oncall" && e["action"] == "set bypass"),
        "{entries:?}"
    );
    // Two admin reloads and none of the proxies' (their set never changed); no token recorded.
    let reloaded: Vec<&Value> = entries
        .iter()
        .filter(|e| e["action"] == "reload credentials")
        .collect();
    assert_eq!(reloaded.len(), 2, "{entries:?}");
    assert!(reloaded
        .iter()
        .all(|e| e["target"] == "--admin-tokens-file"));
    assert!(!audit.body.contains("admin-old") && !audit.body.contains("admin-new"));
    assert_eq!(sync_as("proxy-old"), 200);
}

/// The proxies' configuration for `--policy`: a local sliding log keyed on the user or the
/// address, a cached rule with tiers, and one keyed on the user or the client's network.
const POLICY: &str = r#"{"service": {"cluster": "sluice_service"}, "rules": [
    {"name": "api", "key": ["header:x-user|client_ip"], "consistency": "local",
     "limits": [{"requests": 5, "per": "minute", "algorithm": "sliding_log"}]},
    {"name": "plans", "key": ["header:x-user"], "tiers": {"from": "header:x-plan", "default": "free",
     "limits": {"free": [{"requests": 5, "per": "minute"}], "pro": [{"requests": 50, "per": "minute"}]}}},
    {"name": "net", "key": ["jwt:sub|client_ip/24", "method"], "limits": [{"requests": 5, "per": "minute"}]}
]}"#;

/// With `--policy`, a limit or key override is checked as the proxies check it, with their
/// configuration's own messages: what would be refused by every proxy (or match nothing) is
/// refused here, 400 naming the field, and never stored.
#[tokio::test]
async fn with_the_proxies_configuration_an_override_is_checked_as_they_check_it() {
    let redis = Redis::start().unwrap();
    let policy = TextFile::new(POLICY);
    let state = admin_state_with(&redis.url(), &["--policy", policy.path()]);
    let refused = |path: &'static str, body: Value| {
        let state = state.clone();
        async move { admin(&state, "PUT", path, Some(body)).await }
    };

    // The memory bound: the same message as the configuration's for the same limits.
    let big = json!({"requests": 1000, "per": "minute", "algorithm": "sliding_log"});
    let configured = sluice_core::parse(
        POLICY
            .replace(
                r#""requests": 5, "per": "minute", "algorithm": "sliding_log""#,
                r#""requests": 1000, "per": "minute", "algorithm": "sliding_log""#,
            )
            .as_bytes(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        configured.starts_with("rules[0].limits[0].requests: its sliding logs keep 1000"),
        "{configured}"
    );
    let answer = refused("/admin/v1/overrides/limits/api", json!({"limits": [big]})).await;
    assert_error(
        &answer,
        StatusCode::BAD_REQUEST,
        "invalid_request",
        "limits[0].requests: its sliding logs keep 1000 timestamps per key: 500 MiB for max_keys 65536",
    );
    assert_eq!(
        answer.body["message"],
        configured.replacen("rules[0].", "", 1)
    );
    // Every tier of a whole rule, and the cost, as the configuration checks them.
    let answer = refused(
        "/admin/v1/overrides/limits/plans",
        json!({"limits": [{"requests": 2, "per": "second", "algorithm": "sliding_log"}]}),
    )
    .await;
    assert_error(
        &answer,
        StatusCode::BAD_REQUEST,
        "invalid_request",
        "limits[0].algorithm: sliding_log is exact, so it is decided per request",
    );
    // Unknown targets.
    for path in [
        "/admin/v1/overrides/limits/nope",
        "/admin/v1/overrides/limits/plans/gold",
        "/admin/v1/overrides/limits/api/pro",
    ] {
        let answer = refused(path, json!({"limits": [{"requests": 1, "per": "second"}]})).await;
        assert_error(
            &answer,
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "target: no rule or tier named",
        );
    }
    // Keys that can match nothing, with the form they need.
    let keys = "/admin/v1/overrides/keys/api";
    let cases = [
        (
            json!(["127.0.0.1", "GET"]),
            "key: rule \"api\" is keyed by 1 part(s), [header:x-user|client_ip]",
        ),
        (
            json!(["client_ip=localhost"]),
            "key[0]: client_ip: the part is client_ip: expected a client address",
        ),
        (
            json!("client_ip=localhost"),
            "key: client_ip: the part is client_ip: expected a client address",
        ),
    ];
    for (key, message) in cases {
        let answer = refused(keys, json!({"key": key, "action": "block"})).await;
        assert_error(&answer, StatusCode::BAD_REQUEST, "invalid_request", message);
    }
    let answer = refused(
        "/admin/v1/overrides/keys/net",
        json!({"key": ["198.51.100.7", "GET"], "action": "block"}),
    )
    .await;
    assert_error(
        &answer,
        StatusCode::BAD_REQUEST,
        "invalid_request",
        "key[0]: the part is client_ip/24/64, the client's network: expected \"198.51.100.0/24\"",
    );
    let answer = refused(
        "/admin/v1/overrides/keys/net",
        json!({"key": ["alice", "get it"], "action": "block"}),
    )
    .await;
    assert_error(
        &answer,
        StatusCode::BAD_REQUEST,
        "invalid_request",
        "key[1]: the part is the method",
    );
    let answer = refused(
        "/admin/v1/overrides/keys/nope",
        json!({"key": "alice", "action": "block"}),
    )
    .await;
    assert_error(
        &answer,
        StatusCode::BAD_REQUEST,
        "invalid_request",
        "rule: no rule named \"nope\"",
    );
    // Hostile bodies: as many parts as the body holds; nine limits; a tier's name as a rule.
    let many: Vec<String> = (0..5_000).map(|i| format!("{i}")).collect();
    let answer = refused(keys, json!({"key": many, "action": "block"})).await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{answer:?}");
    let nine: Vec<Value> = (0..9)
        .map(|_| json!({"requests": 1, "per": "second"}))
        .collect();
    let answer = refused("/admin/v1/overrides/limits/api", json!({"limits": nine})).await;
    assert_error(
        &answer,
        StatusCode::BAD_REQUEST,
        "invalid_request",
        "limits: must hold at most 8 limits",
    );
    let answer = refused(
        "/admin/v1/overrides/keys/plans",
        json!({"key": ["alice"], "action": "block", "ttl_s": 0}),
    )
    .await;
    assert_error(
        &answer,
        StatusCode::BAD_REQUEST,
        "invalid_request",
        "ttl_s: must be between 1",
    );
    // Nothing refused was stored, nor audited.
    let view = admin(&state, "GET", "/admin/v1/overrides", None).await;
    assert_eq!(view.body["version"], 0, "{view:?}");
    assert!(audit_log(&redis).is_empty());

    // What can match is set: the value a client sends, or the alternative named.
    for (path, key) in [
        (keys, json!(["127.0.0.1"])),
        (keys, json!("client_ip=127.0.0.2")),
        (keys, json!(["header:x-user=mallory"])),
        (
            "/admin/v1/overrides/keys/net",
            json!(["198.51.100.0/24", "GET"]),
        ),
        (
            "/admin/v1/overrides/keys/net",
            json!(["jwt:sub=198.51.100.7", "GET"]),
        ),
        ("/admin/v1/overrides/keys/plans", json!("alice")),
    ] {
        put(&state, path, json!({"key": key, "action": "block"})).await;
    }
    put(
        &state,
        "/admin/v1/overrides/limits/plans/pro",
        json!({"limits": [{"requests": 500, "per": "minute"}]}),
    )
    .await;
    put(
        &state,
        "/admin/v1/overrides/limits/api",
        json!({"limits": [{"requests": 100, "per": "minute", "algorithm": "sliding_log"}]}),
    )
    .await;
    // A delete is not checked: what was set before the policy changed can always go.
    let answer = admin(
        &state,
        "DELETE",
        "/admin/v1/overrides/keys/nope?key=alice",
        None,
    )
    .await;
    assert_eq!(answer.status, StatusCode::NOT_FOUND, "{answer:?}");
}

/// A rule whose limit is read from the identity (`limits_from`) keeps its one limit, within its
/// `max`, under an override too: with `--policy` the service refuses an hourly cap added beside
/// it (a caller with a value would be counted under the value's limit alone, escaping the cap)
/// and requests above `max`, 400 naming the limit, and stores nothing; one limit within `max` is
/// taken.
#[tokio::test]
async fn an_override_of_a_limits_from_rule_is_checked_as_its_configuration_is() {
    let redis = Redis::start().unwrap();
    let policy = TextFile::new(
        r#"{"service": {"cluster": "sluice_service"}, "rules": [
        {"name": "rated", "key": ["jwt:sub"], "consistency": "local",
         "limits": [{"requests": 2, "per": "minute"}],
         "limits_from": {"from": "jwt:rate_per_minute", "max": 100}}]}"#,
    );
    let state = admin_state_with(&redis.url(), &["--policy", policy.path()]);
    let path = "/admin/v1/overrides/limits/rated";
    let cases = [
        (
            json!([{"requests": 2, "per": "minute"}, {"requests": 10, "per": "hour"}]),
            "limits[1]: limits_from replaces the requests of one limit",
        ),
        (
            json!([{"requests": 500, "per": "minute"}]),
            "limits[0].requests: limits_from.max (100) is less than limits[0].requests (500)",
        ),
    ];
    for (limits, message) in cases {
        let answer = admin(&state, "PUT", path, Some(json!({ "limits": limits }))).await;
        assert_error(&answer, StatusCode::BAD_REQUEST, "invalid_request", message);
    }
    let listed = admin(&state, "GET", "/admin/v1/overrides", None).await;
    assert!(
        !listed.body.to_string().contains("rated"),
        "nothing stored: {}",
        listed.body
    );
    let taken = admin(
        &state,
        "PUT",
        path,
        Some(json!({"limits": [{"requests": 50, "per": "minute"}]})),
    )
    .await;
    assert_eq!(taken.status, StatusCode::OK, "{:?}", taken.body);
}

/// Without `--policy` the service checks what needs no configuration: a key longer than the
/// filter ever matches is refused all the same.
#[tokio::test]
async fn without_the_proxies_configuration_a_key_too_long_to_match_is_refused() {
    let redis = Redis::start().unwrap();
    let state = admin_state(&redis.url());
    // "api" + U+001F + 252 bytes = 256: the longest key the filter keeps whole.
    let answer = admin(
        &state,
        "PUT",
        "/admin/v1/overrides/keys/api",
        Some(json!({"key": "k".repeat(253), "action": "block"})),
    )
    .await;
    assert_error(
        &answer,
        StatusCode::BAD_REQUEST,
        "invalid_request",
        "key: the rule's key would be 257 bytes",
    );
    put(
        &state,
        "/admin/v1/overrides/keys/api",
        json!({"key": "k".repeat(252), "action": "block"}),
    )
    .await;
    // With no configuration to check against, the value is taken as given: the proxy checks it.
    put(
        &state,
        "/admin/v1/overrides/keys/api",
        json!({"key": ["127.0.0.1"], "action": "block"}),
    )
    .await;
}

/// A `--policy` that does not parse stops the service at start, naming the flag and the field.
#[test]
fn a_policy_that_does_not_parse_stops_the_service_at_start() {
    let bad = TextFile::new(
        r#"{"rules": [{"name": "api", "key": ["client_ip"], "limits": [{"requests": 5, "per": "fortnight"}]}]}"#,
    );
    let settings = common::settings("redis://127.0.0.1:1", &["--policy", bad.path()]);
    let Err(error) = AppState::new(settings) else {
        panic!("a bad --policy was accepted")
    };
    assert_eq!(
        error.to_string(),
        format!(
            "--policy {}: rules[0].limits[0].per: expected one of second, minute, hour, day, week, month, or a duration (\"15m\", \"6h\", 900), got \"fortnight\"",
            bad.path()
        )
    );
    let settings = common::settings(
        "redis://127.0.0.1:1",
        &["--policy", "/nonexistent/policy.json"],
    );
    let Err(error) = AppState::new(settings) else {
        panic!("a missing --policy was accepted")
    };
    assert!(
        error
            .to_string()
            .starts_with("--policy /nonexistent/policy.json: "),
        "{error}"
    );
    // The binary: exit status 2 and the reason on stderr, before it listens.
    let binary = sluice_tests::service::service_binary().unwrap();
    let output = std::process::Command::new(binary)
        .args([
            "--token",
            "t",
            "--bind",
            "127.0.0.1:0",
            "--policy",
            bad.path(),
        ])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(&format!(
            "--policy {}: rules[0].limits[0].per: ",
            bad.path()
        )),
        "{stderr}"
    );
}

/// A sync of one entry from a proxy that holds `overrides_version` and takes deltas.
async fn sync_delta(state: &AppState, overrides_version: u64) -> Answer {
    let body = json!({
        "proxy": "p1",
        "interval_ms": 100,
        "entries": [],
        "overrides_version": overrides_version,
        "overrides_delta": true,
    });
    let answer = post(state, "/v1/sync", &body).await;
    assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
    answer
}

/// A metric's value in the text of `/metrics` (0 if absent).
fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

fn block(key: &str) -> Value {
    json!({"key": key, "action": "block"})
}

/// The set is bounded in bytes as proxies receive it (JSON-escaped), atomically in the script: a
/// PUT that would take it past `--overrides-max-bytes` is refused naming the field and the bound,
/// and nothing of it is written (no entry, no version, no audit or log entry); a replacement that
/// does not grow and a delete are taken; one entry past its own bound is refused. Replicas racing
/// on one Redis cannot pass the bound together.
#[tokio::test]
async fn the_set_is_bounded_in_bytes_atomically() {
    let redis = Redis::start().unwrap();
    let bound = ["--overrides-max-bytes", "2000", "--max-key-bytes", "8192"];
    let state = admin_state_with(&redis.url(), &bound);
    // "api" U+001F "user-NN" escaped: 2 quotes + 3 + 6 (\u001f) + 7, then "block" + 4: 27 bytes
    let mut v = 0;
    for i in 0..74 {
        v = version(
            &put(
                &state,
                "/admin/v1/overrides/keys/api",
                block(&format!("user-{i:02}")),
            )
            .await,
        );
    }
    assert_eq!(
        redis
            .text(&["HGET", overrides::SIZES_KEY, "set_bytes"])
            .unwrap(),
        "1998"
    );
    let stored = |redis: &Redis| {
        (
            redis.text(&["HLEN", KEYS_KEY]).unwrap(),
            redis.text(&["GET", VERSION_KEY]).unwrap(),
            redis.text(&["LLEN", AUDIT_KEY]).unwrap(),
            redis.text(&["LLEN", overrides::LOG_KEY]).unwrap(),
            redis
                .text(&["HGET", overrides::SIZES_KEY, "set_bytes"])
                .unwrap(),
        )
    };
    let before = stored(&redis);
    let answer = admin(
        &state,
        "PUT",
        "/admin/v1/overrides/keys/api",
        Some(block("user-74")),
    )
    .await;
    assert_error(
        &answer,
        StatusCode::BAD_REQUEST,
        "invalid_request",
        "key: the live overrides would take 2025 bytes as proxies receive them, more than \
         --overrides-max-bytes 2000: delete some first",
    );
    // a control character is counted escaped: 6 bytes
    let answer = admin(
        &state,
        "PUT",
        "/admin/v1/overrides/keys/api",
        Some(block("\u{1}")),
    )
    .await;
    assert_error(
        &answer,
        StatusCode::BAD_REQUEST,
        "invalid_request",
        "key: the live overrides would take 2024 bytes",
    );
    let answer = admin(
        &state,
        "PUT",
        "/admin/v1/overrides/limits/api",
        Some(json!({"limits": [{"requests": 1, "per": "second"}]})),
    )
    .await;
    assert_error(
        &answer,
        StatusCode::BAD_REQUEST,
        "invalid_request",
        "target: the live overrides would take",
    );
    assert_eq!(
        stored(&redis),
        before,
        "nothing of a refused PUT is written"
    );
    // the same size again: taken; a delete makes room
    let changed = put(
        &state,
        "/admin/v1/overrides/keys/api",
        json!({"key": "user-00", "action": "allow"}),
    )
    .await;
    assert_eq!(version(&changed), v + 1);
    admin(
        &state,
        "DELETE",
        "/admin/v1/overrides/keys/api?key=user-01",
        None,
    )
    .await;
    put(&state, "/admin/v1/overrides/keys/api", block("user-74")).await;
    // what a proxy receives is within what the service counts
    let answer = sync(&state, 0).await;
    let sent = hinted(&answer)["live"].to_string().len();
    assert!(sent <= 1998 + 64, "{sent}");
    // one entry past its own bound (4 KiB), whatever the set's: a key that long cannot be named
    // (the filter digests keys over 256 bytes), so it is refused as such before its size counts
    let roomy = admin_state_with(
        &redis.url(),
        &[
            "--overrides-max-bytes",
            "4194304",
            "--max-key-bytes",
            "8192",
        ],
    );
    let answer = admin(
        &roomy,
        "PUT",
        "/admin/v1/overrides/keys/api",
        Some(block(&"\u{1}".repeat(700))),
    )
    .await;
    assert_error(
        &answer,
        StatusCode::BAD_REQUEST,
        "invalid_request",
        "key: the rule's key would be 704 bytes",
    );

    // two replicas racing: exactly the entries that fit are taken
    redis.query(&["FLUSHALL"]).unwrap();
    let a = admin_state_with(&redis.url(), &bound);
    let b = admin_state_with(&redis.url(), &bound);
    let puts = (0..120).map(|i| {
        let state = if i % 2 == 0 { a.clone() } else { b.clone() };
        async move {
            admin(
                &state,
                "PUT",
                "/admin/v1/overrides/keys/api",
                Some(block(&format!("user-{i:03}"))),
            )
            .await
            .status
        }
    });
    let statuses = futures_util::future::join_all(puts).await;
    let taken = statuses.iter().filter(|s| **s == StatusCode::OK).count();
    let refused = statuses
        .iter()
        .filter(|s| **s == StatusCode::BAD_REQUEST)
        .count();
    // 28 bytes a key (three digits): 71 fit in 2000
    assert_eq!((taken, refused), (71, 49), "{statuses:?}");
    assert_eq!(redis.text(&["HLEN", KEYS_KEY]).unwrap(), "71");
    assert_eq!(
        redis
            .text(&["HGET", overrides::SIZES_KEY, "set_bytes"])
            .unwrap(),
        "1988"
    );
}

/// A proxy that takes deltas and is one version behind is answered exactly the change since its
/// version; a few versions behind, the changes merged (an entry set then removed is removed); a
/// proxy that does not announce deltas (an older one) is answered the whole set at the same
/// version. Within --overrides-refresh-ms a replica answers the same delta from memory.
#[tokio::test]
async fn a_proxy_one_version_behind_gets_a_delta_of_that_change() {
    let redis = Redis::start().unwrap();
    let state = admin_state_with(&redis.url(), &["--overrides-refresh-ms", "0"]);
    put(&state, "/admin/v1/overrides/keys/api", block("alice")).await;
    put(
        &state,
        "/admin/v1/overrides/limits/api",
        json!({"limits": [{"requests": 5, "per": "second"}]}),
    )
    .await;
    let v = version(&put(&state, "/admin/v1/overrides/keys/api", block("bob")).await);
    assert_eq!(
        hinted(&sync_delta(&state, v).await),
        &json!({"bypass": false})
    );

    let v1 = version(
        &put(
            &state,
            "/admin/v1/overrides/keys/login",
            json!({"key": ["10.0.0.1", "GET"], "action": "allow"}),
        )
        .await,
    );
    assert_eq!(v1, v + 1);
    assert_eq!(
        hinted(&sync_delta(&state, v).await),
        &json!({"bypass": false, "delta": {"from": v, "version": v1,
            "keys": {"login": {"10.0.0.1\u{1f}GET": "allow"}}}})
    );
    // an older proxy at the same version: the whole set
    assert_eq!(
        hinted(&sync(&state, v).await),
        &json!({"bypass": false, "live": {"version": v1,
            "limits": {"api": [{"requests": 5, "per": "second"}]},
            "keys": {"api": {"alice": "block", "bob": "block"}, "login": {"10.0.0.1\u{1f}GET": "allow"}}}})
    );
    let v2 = version(
        &admin(
            &state,
            "DELETE",
            "/admin/v1/overrides/keys/api?key=alice",
            None,
        )
        .await
        .body,
    );
    let v3 = version(
        &admin(&state, "DELETE", "/admin/v1/overrides/limits/api", None)
            .await
            .body,
    );
    let v4 = version(
        &put(
            &state,
            "/admin/v1/overrides/bypass",
            json!({"enabled": true}),
        )
        .await,
    );
    let v5 = version(
        &admin(
            &state,
            "DELETE",
            "/admin/v1/overrides/keys/login",
            Some(json!({"key": ["10.0.0.1", "GET"]})),
        )
        .await
        .body,
    );
    assert_eq!(v5, v + 5);
    assert_eq!(
        hinted(&sync_delta(&state, v1).await),
        &json!({"bypass": true, "delta": {"from": v1, "version": v5,
            "removed_limits": ["api"],
            "removed_keys": {"api": ["alice"], "login": ["10.0.0.1\u{1f}GET"]}}})
    );
    // the bypass alone: a delta of no entry
    assert_eq!(
        hinted(&sync_delta(&state, v3).await),
        &json!({"bypass": true, "delta": {"from": v3, "version": v5,
            "removed_keys": {"login": ["10.0.0.1\u{1f}GET"]}}})
    );
    let _ = (v2, v4);
    // set, then removed, then set again: as it is now
    put(&state, "/admin/v1/overrides/keys/api", block("carol")).await;
    admin(
        &state,
        "DELETE",
        "/admin/v1/overrides/keys/api?key=carol",
        None,
    )
    .await;
    let v8 = version(
        &put(
            &state,
            "/admin/v1/overrides/keys/api",
            json!({"key": "carol", "action": "allow"}),
        )
        .await,
    );
    assert_eq!(
        hinted(&sync_delta(&state, v5).await)["delta"],
        json!({"from": v5, "version": v8, "keys": {"api": {"carol": "allow"}}})
    );
    let text = metrics(&state).await;
    assert_eq!(
        metric(&text, "sluice_overrides_deltas_sent_total"),
        4,
        "{text}"
    );
    assert_eq!(metric(&text, "sluice_overrides_sent_total"), 1, "{text}");
    let delta_bytes = metric(
        &text,
        "sluice_overrides_answered_bytes_total{kind=\"delta\"}",
    );
    assert!((100..1_000).contains(&delta_bytes), "{text}");

    // a replica that shares reads answers the same delta from memory
    let shared = admin_state_with(&redis.url(), &["--overrides-refresh-ms", "600000"]);
    let first = sync_delta(&shared, v5).await;
    let second = sync_delta(&shared, v5).await;
    assert_eq!(hinted(&first), hinted(&second));
    assert_eq!(hinted(&second)["delta"]["version"], v8);
    let text = metrics(&shared).await;
    assert_eq!(
        metric(&text, "sluice_overrides_reads_shared_total"),
        1,
        "{text}"
    );
    assert_eq!(
        metric(&text, "sluice_overrides_deltas_sent_total"),
        2,
        "{text}"
    );
}

/// A proxy the change log cannot serve is answered the whole set: a new one (version 0), one
/// further behind than the log keeps (here after more than LOG_CAP changes), one whose version
/// predates the log (a set written before the service kept one), and one claiming a version
/// the service never had (the worst a proxy can send).
#[tokio::test]
async fn a_proxy_too_far_behind_or_new_gets_the_whole_set() {
    let redis = Redis::start().unwrap();
    let state = admin_state_with(&redis.url(), &["--overrides-refresh-ms", "0"]);
    let v = version(&put(&state, "/admin/v1/overrides/keys/api", block("alice")).await);
    let whole = |answer: &Answer| hinted(answer).get("live").cloned();
    assert!(whole(&sync_delta(&state, 0).await).is_some());
    assert!(whole(&sync_delta(&state, v + 1).await).is_some());
    assert!(whole(&sync_delta(&state, u64::MAX).await).is_some());
    // the log holds every change after the version before the first (the empty set): a proxy
    // there gets a delta, one before it the whole set
    assert_eq!(
        hinted(&sync_delta(&state, v - 1).await)["delta"],
        json!({"from": v - 1, "version": v, "keys": {"api": {"alice": "block"}}})
    );
    assert_eq!(
        whole(&sync_delta(&state, v - 2).await).unwrap()["version"],
        v
    );

    // a set from a service that kept no log: the log starts at the next change
    redis
        .query(&["DEL", overrides::LOG_KEY, overrides::SIZES_KEY])
        .unwrap();
    let v1 = version(&put(&state, "/admin/v1/overrides/keys/api", block("bob")).await);
    assert_eq!(
        hinted(&sync_delta(&state, v).await)["delta"],
        json!({"from": v, "version": v1, "keys": {"api": {"bob": "block"}}})
    );
    redis
        .query(&["DEL", overrides::LOG_KEY, overrides::SIZES_KEY])
        .unwrap();
    redis
        .query(&["SET", VERSION_KEY, &(v1 + 10).to_string()])
        .unwrap();
    let v2 = version(&put(&state, "/admin/v1/overrides/keys/api", block("carol")).await);
    assert_eq!(v2, v1 + 11);
    let answer = sync_delta(&state, v1).await;
    let live = whole(&answer).expect("the whole set");
    assert_eq!(live["keys"]["api"].as_object().unwrap().len(), 3);
    assert_eq!(
        redis
            .text(&["HGET", overrides::SIZES_KEY, "set_bytes"])
            .unwrap(),
        "73"
    );

    // more changes than the log keeps: the oldest are trimmed
    for i in 0..=overrides::LOG_CAP {
        let change = key_change(&format!("k{}", i % 10), None);
        overrides::write(&state, "alice", &change, 0).await.unwrap();
    }
    let last = v2 + overrides::LOG_CAP + 1;
    assert_eq!(
        redis.text(&["LLEN", overrides::LOG_KEY]).unwrap(),
        overrides::LOG_CAP.to_string()
    );
    assert!(whole(&sync_delta(&state, v2).await).is_some());
    let answer = sync_delta(&state, v2 + 1).await;
    assert_eq!(
        hinted(&answer)["delta"]["keys"]["api"]
            .as_object()
            .unwrap()
            .len(),
        10
    );
    assert_eq!(hinted(&answer)["delta"]["version"], last);
}

/// An expiry is a change like any other: a proxy at the version before it is answered a delta
/// that removes the expired entry (the proxy does not need to know the ttl).
#[tokio::test]
async fn an_expiry_is_answered_as_a_delta() {
    let redis = Redis::start().unwrap();
    let state = admin_state(&redis.url());
    let at = |ms: u64| T0_US + ms * 1_000;
    overrides::write(&state, "alice", &key_change("short", Some(2)), at(0))
        .await
        .unwrap();
    let v = overrides::write(&state, "alice", &key_change("kept", None), at(0))
        .await
        .unwrap()
        .version;
    let answer = overrides::for_sync(&state, v, true, at(1_999)).await;
    assert_eq!((answer.live, answer.delta), (None, None));
    let answer = overrides::for_sync(&state, v, true, at(2_000)).await;
    assert_eq!(answer.live, None);
    assert_eq!(
        serde_json::to_value(answer.delta.unwrap()).unwrap(),
        json!({"from": v, "version": v + 1, "removed_keys": {"api": ["short"]}})
    );
    // the version before both: the two changes merged
    let answer = overrides::for_sync(&state, v - 2, true, at(2_500)).await;
    assert_eq!(
        serde_json::to_value(answer.delta.unwrap()).unwrap(),
        json!({"from": v - 2, "version": v + 1, "keys": {"api": {"kept": "block"}},
               "removed_keys": {"api": ["short"]}})
    );
}
