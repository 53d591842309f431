//! Live overrides of a bulkhead (its mode, ramp, limit and class thresholds) through the admin
//! API, on a real Redis: checked as the proxies' configuration checks a bulkhead (with
//! `--policy`, every check; without, those that need no configuration), refused 400 naming the
//! field; set, shown, synced to proxies, audited and deleted; and bounded as every entry is.

mod common;

use axum::body::Body;
use axum::http::StatusCode;
use common::{call, post, Answer};
use serde_json::{json, Value};
use sluice_counter_service::overrides::AUDIT_KEY;
use sluice_counter_service::AppState;
use sluice_tests::redis::{Redis, Reply};

const ADMIN: &str = "alice-admin-token";

const POLICY: &str = r#"{"service": {"cluster": "sluice_service"}, "shedding": {"mode": "monitor",
    "bulkheads": [{"name": "api", "limit": {"static": 10}}, {"name": "search", "limit": {"static": 4}, "mode": "enforce"}]}}"#;

use common::TextFile;

fn state(redis_url: &str, policy: bool) -> AppState {
    let admins = TextFile::new(&format!("alice {ADMIN}\n"));
    let file = TextFile::new(POLICY);
    let mut args = vec!["--admin-tokens-file", admins.path()];
    if policy {
        args.extend(["--policy", file.path()]);
    }
    AppState::new(common::settings(redis_url, &args)).unwrap()
}

async fn admin(state: &AppState, method: &str, path: &str, body: Option<Value>) -> Answer {
    let body = body.map_or_else(Body::empty, |json| Body::from(json.to_string()));
    call(state, method, path, Some(ADMIN), body).await
}

#[track_caller]
fn assert_refused(answer: &Answer, message: &str) {
    assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{answer:?}");
    let text = answer.body["message"].as_str().unwrap_or_default();
    assert!(
        text.starts_with(message),
        "{text:?} should start with {message:?}"
    );
}

/// The attacker holds an admin token: each worst value is refused, naming its field, and
/// nothing is stored.
#[tokio::test]
async fn an_override_is_checked_as_the_proxies_check_a_bulkhead() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url(), true);
    let api = "/admin/v1/overrides/bulkheads/api";
    let cases = [
        (
            api,
            json!({"limit": {"static": 0}}),
            "limit.static: must be between 1 and 1000000, got 0",
        ),
        (
            api,
            json!({"limit": {"static": 1e12}}),
            "limit.static: invalid type",
        ),
        (
            api,
            json!({"limit": {"static": 4294967296u64}}),
            "limit.static: invalid value",
        ),
        (
            api,
            json!({"classes": {"free": -1}}),
            "classes.free: must be between 0.01 and 1, got -1",
        ),
        (
            api,
            json!({"classes": {"free": 1e300}}),
            "classes.free: must be between 0.01 and 1",
        ),
        (
            api,
            json!({"classes": {"gold": 0.5}}),
            "classes.gold: \"gold\" is not a class of shedding.classes",
        ),
        (
            api,
            json!({"mode": "panic"}),
            "mode: expected one of monitor, warn, enforce, got \"panic\"",
        ),
        // `api` monitors (the shedding's mode): a ramp needs enforce.
        (
            api,
            json!({"ramp_percent": 50}),
            "ramp_percent: ramps an enforce bulkhead",
        ),
        (
            api,
            json!({"ramp_percent": 300}),
            "ramp_percent: invalid value",
        ),
        (
            api,
            json!({"queue": {"size": 1000000, "max_wait_ms": 1}}),
            "queue: unknown field `queue`",
        ),
        (
            api,
            json!({}),
            "bulkhead: give at least one of mode, ramp_percent, limit, classes",
        ),
        (
            api,
            json!({"mode": "enforce", "ttl_s": 0}),
            "ttl_s: must be between 1 and",
        ),
        (
            api,
            json!({"mode": "enforce", "ttl_s": -5}),
            "ttl_s: must be a whole number of seconds",
        ),
        (
            api,
            json!({"mode": "enforce", "reason": 7}),
            "reason: must be a string",
        ),
        (
            "/admin/v1/overrides/bulkheads/nowhere",
            json!({"mode": "monitor"}),
            "bulkhead: no bulkhead named \"nowhere\"; the bulkheads are api, search",
        ),
        (
            "/admin/v1/overrides/bulkheads/a%20b",
            json!({"mode": "monitor"}),
            "bulkhead: must be a bulkhead's name",
        ),
        (
            "/admin/v1/overrides/bulkheads/api/x",
            json!({"mode": "monitor"}),
            "bulkhead: must be a bulkhead's name",
        ),
    ];
    for (path, body, message) in cases {
        let answer = admin(&state, "PUT", path, Some(body.clone())).await;
        assert_refused(&answer, message);
    }
    let view = admin(&state, "GET", "/admin/v1/overrides", None).await;
    assert_eq!(view.body["version"], 0, "nothing stored: {view:?}");
    // A body that is not an object.
    let answer = admin(&state, "PUT", api, Some(json!([1]))).await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{answer:?}");
}

#[tokio::test]
async fn an_override_is_set_shown_synced_audited_and_deleted() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url(), true);
    let path = "/admin/v1/overrides/bulkheads/search";
    let body = json!({"mode": "enforce", "ramp_percent": 25, "limit": {"static": 8},
                      "classes": {"free": 0.5}, "ttl_s": 600, "reason": "rollout"});
    let set = admin(&state, "PUT", path, Some(body)).await;
    assert_eq!(set.status, StatusCode::OK, "{set:?}");
    let version = set.body["version"].as_u64().unwrap();
    let value = json!({"mode": "enforce", "ramp_percent": 25, "limit": {"static": 8}, "classes": {"free": 0.5}});
    assert_eq!(set.body["bulkhead"], "search");
    assert_eq!(set.body["override"], value);
    assert_eq!(set.body["reason"], "rollout");

    let view = admin(&state, "GET", "/admin/v1/overrides", None).await;
    assert_eq!(
        view.body["bulkheads"]["search"]["bulkhead"], value,
        "{view:?}"
    );
    assert_eq!(
        view.body["limits"],
        json!({}),
        "not shown as a rule's limits"
    );

    // A proxy gets it in its set, as the filter reads it.
    let sync = post(
        &state,
        "/v1/sync",
        &json!({"proxy": "p1", "interval_ms": 100, "entries": [], "overrides_version": 0}),
    )
    .await;
    assert_eq!(sync.status, StatusCode::OK, "{sync:?}");
    let live = &sync.body["hints"]["overrides"]["live"];
    assert_eq!(live["version"], version, "{sync:?}");
    assert_eq!(
        live["limits"]["bulkhead:search"],
        json!([value]),
        "{sync:?}"
    );
    let policy = sluice_core::parse(POLICY.as_bytes()).unwrap();
    let set: sluice_core::protocol::LiveOverrides = serde_json::from_value(live.clone()).unwrap();
    let (applied, problems) = sluice_core::overrides::apply(&policy, &set);
    assert!(problems.is_empty(), "{problems:?}");
    assert_eq!(applied.shedding.unwrap().bulkheads[1].ramp_percent, 25);

    let Reply::Array(entries) = redis.query(&["LRANGE", AUDIT_KEY, "0", "0"]).unwrap() else {
        panic!("the audit log is not a list")
    };
    let newest: Value = serde_json::from_str(entries[0].text().unwrap()).unwrap();
    assert_eq!(
        (&newest["action"], &newest["target"]),
        (&json!("set bulkhead"), &json!("search"))
    );
    assert_eq!(newest["value"]["bulkhead"], value);

    let deleted = admin(&state, "DELETE", path, None).await;
    assert_eq!(deleted.status, StatusCode::OK, "{deleted:?}");
    assert_eq!(deleted.body["version"], version + 1);
    let again = admin(&state, "DELETE", path, None).await;
    assert_eq!(again.status, StatusCode::NOT_FOUND, "{again:?}");
}

/// Without the proxies' configuration the service cannot know the bulkheads or their classes
/// (each proxy checks those and leaves out what fails), but refuses whatever needs no
/// configuration, and bounds every entry's bytes as any override's.
#[tokio::test]
async fn without_the_configuration_the_form_and_the_bounds_are_still_checked() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url(), false);
    let api = "/admin/v1/overrides/bulkheads/api";
    for (body, message) in [
        (
            json!({"limit": {"static": 0}}),
            "limit.static: must be between 1 and 1000000, got 0",
        ),
        (
            json!({"mode": "loud"}),
            "mode: expected one of monitor, warn, enforce",
        ),
        (
            json!({"mode": "monitor", "ramp_percent": 5}),
            "ramp_percent: ramps an enforce bulkhead",
        ),
        (
            json!({"classes": {"free": 2}}),
            "classes.free: must be between 0.01 and 1, got 2",
        ),
        (
            json!({"classes": {"no good": 0.5}}),
            "classes.no good: a class name must be",
        ),
        (json!({}), "bulkhead: give at least one of"),
    ] {
        let answer = admin(&state, "PUT", api, Some(body)).await;
        assert_refused(&answer, message);
    }
    // 100 classes of 60-byte names: past the 4 KiB an entry may take.
    let classes: serde_json::Map<String, Value> = (0..100)
        .map(|i| (format!("{i:0>60}"), json!(0.5)))
        .collect();
    let answer = admin(&state, "PUT", api, Some(json!({"classes": classes}))).await;
    assert_refused(&answer, "bulkhead: the entry takes");
    let fine = admin(
        &state,
        "PUT",
        "/admin/v1/overrides/bulkheads/unknown",
        Some(json!({"mode": "warn"})),
    )
    .await;
    assert_eq!(
        fine.status,
        StatusCode::OK,
        "the name is the proxies' to check: {fine:?}"
    );
}
