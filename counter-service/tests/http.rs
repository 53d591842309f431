//! The HTTP surface, through `app()` without a socket, on a real Redis; and once through the
//! built binary.

mod common;

use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::StatusCode;
use common::{call, get, post, state, TOKEN};
use serde_json::{json, Value};
use sluice_counter_service::AppState;
use sluice_tests::redis::Redis;
use sluice_tests::service::Service;

fn sync_body(entries: Value) -> Value {
    json!({"proxy": "p1", "interval_ms": 100, "entries": entries})
}

/// A 10/s limit with burst 10, and 100 denied over the (first) 100 ms interval: 1000/s of demand.
/// On a new key, alone, the grant is the whole free bucket plus the refill due before the next
/// sync (1.5 intervals): floor(10 - 0 + 10 × 0.1 × 1.5 × 1) = 11.
fn ten_per_second(key: &str) -> Value {
    json!({"key": key, "limits": [{"requests": 10, "period_ms": 1000, "burst": 10}], "spent": 0, "denied": 100})
}

fn assert_error(answer: &common::Answer, status: StatusCode, error: &str) {
    assert_eq!(answer.status, status, "{answer:?}");
    assert_eq!(answer.body["error"], error, "{answer:?}");
    assert!(answer.body["message"].is_string(), "{answer:?}");
}

#[tokio::test]
async fn sync_answers_grants_in_order_with_hints() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let body = sync_body(json!([ten_per_second("a"), ten_per_second("b")]));
    let answer = post(&state, "/v1/sync", &body).await;
    assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
    assert_eq!(
        answer.body,
        json!({
            "grants": [
                {"tokens": 11, "ttl_ms": 300, "remaining": 10, "reset_ms": 0},
                {"tokens": 11, "ttl_ms": 300, "remaining": 10, "reset_ms": 0}
            ],
            "hints": {"next_sync_ms": 100, "overrides": {"bypass": false}}
        })
    );
    let metrics = get(&state, "/metrics").await;
    let text = metrics.body.as_str().unwrap();
    assert!(text.contains("sluice_syncs_total 1"), "{text}");
    assert!(text.contains("sluice_sync_entries_total 2"), "{text}");
    assert!(
        text.contains("sluice_script_calls_total{script=\"sync\"} 1"),
        "{text}"
    );
    assert!(text.contains("sluice_redis_seconds_bucket"), "{text}");
}

#[tokio::test]
async fn a_missing_or_wrong_token_is_401() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let body = || Body::from(sync_body(json!([])).to_string());
    let answer = call(&state, "POST", "/v1/sync", None, body()).await;
    assert_error(&answer, StatusCode::UNAUTHORIZED, "unauthorized");
    let answer = call(&state, "POST", "/v1/sync", Some("wrong"), body()).await;
    assert_error(&answer, StatusCode::UNAUTHORIZED, "unauthorized");
    let answer = call(
        &state,
        "POST",
        "/v1/check",
        Some(&format!("{TOKEN}x")),
        body(),
    )
    .await;
    assert_error(&answer, StatusCode::UNAUTHORIZED, "unauthorized");
    let answer = call(&state, "POST", "/v1/sync", Some(TOKEN), body()).await;
    assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
}

#[tokio::test]
async fn malformed_json_is_400_with_the_reason() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let answer = call(
        &state,
        "POST",
        "/v1/sync",
        Some(TOKEN),
        Body::from("{\"proxy\":"),
    )
    .await;
    assert_error(&answer, StatusCode::BAD_REQUEST, "malformed_json");
    let body = json!({"proxy": "p", "interval_ms": "soon", "entries": []});
    let answer = post(&state, "/v1/sync", &body).await;
    assert_error(&answer, StatusCode::BAD_REQUEST, "malformed_json");
    let message = answer.body["message"].as_str().unwrap();
    assert!(
        message.starts_with("malformed JSON: interval_ms: invalid type"),
        "{message}"
    );
}

#[tokio::test]
async fn a_body_over_the_limit_is_413() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let big = format!("{{\"proxy\":\"{}\"}}", "x".repeat(2 << 20));
    let answer = call(&state, "POST", "/v1/sync", Some(TOKEN), Body::from(big)).await;
    assert_error(&answer, StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large");
}

#[tokio::test]
async fn out_of_bounds_values_are_400_naming_the_field() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let long = "k".repeat(513);
    let body = sync_body(json!([ten_per_second("ok"), ten_per_second(&long)]));
    let answer = post(&state, "/v1/sync", &body).await;
    assert_error(&answer, StatusCode::BAD_REQUEST, "invalid_request");
    assert_eq!(
        answer.body["message"],
        "entries[1].key: longer than 512 bytes"
    );

    let zero = json!({"key": "k", "limits": [{"requests": 0, "period_ms": 1000, "burst": 1}], "spent": 0, "denied": 0});
    let answer = post(&state, "/v1/sync", &sync_body(json!([zero]))).await;
    assert_eq!(
        answer.body["message"],
        "entries[0].limits[0].requests: must be between 1 and 2147483648"
    );
    let answer = post(&state, "/v1/check", &json!({"key": "k", "limits": []})).await;
    assert_error(&answer, StatusCode::BAD_REQUEST, "invalid_request");
    assert_eq!(
        answer.body["message"],
        "limits: must have at least one limit"
    );

    let state = AppState::new(common::settings(&redis.url(), &["--max-batch", "2"])).unwrap();
    let body = sync_body(json!([
        ten_per_second("a"),
        ten_per_second("b"),
        ten_per_second("c")
    ]));
    let answer = post(&state, "/v1/sync", &body).await;
    assert_eq!(
        answer.body["message"],
        "entries: more than 2 entries in one batch"
    );
}

#[tokio::test]
async fn check_allows_up_to_the_limit_then_denies() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let body =
        json!({"key": "login:alice", "limits": [{"requests": 3, "period_ms": 60000, "burst": 3}]});
    for left in [2, 1, 0] {
        let answer = post(&state, "/v1/check", &body).await;
        assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
        assert_eq!(answer.body["allowed"], true, "{answer:?}");
        assert_eq!(answer.body["remaining"], left, "{answer:?}");
    }
    let answer = post(&state, "/v1/check", &body).await;
    assert_eq!(answer.body["allowed"], false, "{answer:?}");
    assert_eq!(answer.body["remaining"], 0);
    let retry = answer.body["retry_after_ms"].as_u64().unwrap();
    assert!(
        (19_000..=20_000).contains(&retry),
        "one token every 20 s: {retry}"
    );
    let text = get(&state, "/metrics")
        .await
        .body
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        text.contains("sluice_checks_total{decision=\"denied\"} 1"),
        "{text}"
    );
}

#[tokio::test]
async fn check_respects_the_proxies_leases() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let synced = post(&state, "/v1/sync", &sync_body(json!([ten_per_second("k")]))).await;
    assert_eq!(synced.body["grants"][0]["tokens"], 11);
    let check = json!({"key": "k", "limits": [{"requests": 10, "period_ms": 1000, "burst": 10}]});
    let answer = post(&state, "/v1/check", &check).await;
    assert_eq!(
        answer.body["allowed"], false,
        "the proxy holds the whole bucket and more: {answer:?}"
    );
}

#[tokio::test]
async fn redis_down_is_503_with_retry_after_and_recovers() {
    let mut redis = Redis::start().unwrap();
    let state = AppState::new(common::settings(
        &redis.url(),
        &["--redis-timeout-ms", "200"],
    ))
    .unwrap();
    let body = sync_body(json!([ten_per_second("k")]));
    assert_eq!(post(&state, "/v1/sync", &body).await.status, StatusCode::OK);
    assert_eq!(get(&state, "/readyz").await.status, StatusCode::OK);

    redis.stop();
    let started = Instant::now();
    let answer = post(&state, "/v1/sync", &body).await;
    assert_error(
        &answer,
        StatusCode::SERVICE_UNAVAILABLE,
        "redis_unavailable",
    );
    assert_eq!(answer.retry_after.as_deref(), Some("1"));
    assert!(started.elapsed() < Duration::from_secs(2), "never a hang");
    let message = answer.body["message"].as_str().unwrap();
    assert!(
        !message.contains("127.0.0.1"),
        "internals stay out: {message}"
    );
    let check = json!({"key": "k", "limits": [{"requests": 1, "period_ms": 1000, "burst": 1}]});
    let answer = post(&state, "/v1/check", &check).await;
    assert_error(
        &answer,
        StatusCode::SERVICE_UNAVAILABLE,
        "redis_unavailable",
    );
    let ready = get(&state, "/readyz").await;
    assert_error(&ready, StatusCode::SERVICE_UNAVAILABLE, "redis_unavailable");
    assert_eq!(
        get(&state, "/healthz").await.status,
        StatusCode::OK,
        "alive all the same"
    );

    redis.restart().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while get(&state, "/readyz").await.status != StatusCode::OK {
        assert!(Instant::now() < deadline, "readyz did not recover");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let answer = post(&state, "/v1/sync", &body).await;
    assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
    let text = get(&state, "/metrics")
        .await
        .body
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        text.contains("sluice_errors_total{kind=\"redis_unavailable\"}"),
        "{text}"
    );
}

#[tokio::test]
async fn unknown_paths_are_json_404() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let answer = get(&state, "/v2/nothing").await;
    assert_error(&answer, StatusCode::NOT_FOUND, "not_found");
}

/// The real binary: listens, syncs over TCP, refuses a wrong token, drains on SIGTERM.
#[test]
fn the_binary_serves_and_stops_on_sigterm() {
    let redis = Redis::start().unwrap();
    let mut service = Service::start(&redis.url()).unwrap();
    let body = sync_body(json!([ten_per_second("a")])).to_string();
    let reply = service.post("/v1/sync", &body).unwrap();
    assert_eq!(reply.status, 200, "{reply:?} {}", service.log());
    assert_eq!(reply.json().unwrap()["grants"][0]["tokens"], 11);
    let reply = service
        .post_with_token("/v1/sync", &body, Some("nope"))
        .unwrap();
    assert_eq!(reply.status, 401);
    assert_eq!(reply.json().unwrap()["error"], "unauthorized");
    assert_eq!(service.get("/readyz").unwrap().status, 200);
    let status = service.terminate(Duration::from_secs(10)).unwrap();
    assert!(status.success(), "{status:?}: {}", service.log());
}
