//! What the service's tests share: a state for a real Redis, and one-shot HTTP calls on `app()`.

#![allow(dead_code)]

use axum::body::Body;
use axum::http::{Request, StatusCode};
use clap::Parser;
use http_body_util::BodyExt;
use serde_json::Value;
use sluice_core::protocol::{LimitSpec, SyncEntry, SyncRequest};
use sluice_counter_service::{app, AppState, Settings};
use tower::ServiceExt;

pub const TOKEN: &str = "test-token";

/// Settings for the Redis at `redis_url`, with more flags.
pub fn settings(redis_url: &str, more: &[&str]) -> Settings {
    let mut args = vec![
        "sluice-counter-service",
        "--redis-url",
        redis_url,
        "--token",
        TOKEN,
        // generous: the test machine is small and shared
        "--redis-timeout-ms",
        "1000",
    ];
    args.extend_from_slice(more);
    Settings::parse_from(args)
}

pub fn state(redis_url: &str) -> AppState {
    AppState::new(settings(redis_url, &[])).unwrap()
}

/// A response: status, `Retry-After` if any, and the body as JSON (or a string).
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub retry_after: Option<String>,
    pub body: Value,
}

/// One request through the whole router, without a socket.
pub async fn call(
    state: &AppState,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Body,
) -> Answer {
    let mut request = Request::builder().method(method).uri(path);
    if let Some(token) = token {
        request = request.header("authorization", format!("Bearer {token}"));
    }
    let request = request
        .header("content-type", "application/json")
        .body(body)
        .unwrap();
    let response = app(state.clone()).oneshot(request).await.unwrap();
    let status = response.status();
    let retry_after = response
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_owned());
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let body = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    Answer {
        status,
        retry_after,
        body,
    }
}

pub async fn post(state: &AppState, path: &str, json: &Value) -> Answer {
    call(
        state,
        "POST",
        path,
        Some(TOKEN),
        Body::from(json.to_string()),
    )
    .await
}

pub async fn get(state: &AppState, path: &str) -> Answer {
    call(state, "GET", path, None, Body::empty()).await
}

pub const TEN_PER_SECOND: LimitSpec = LimitSpec {
    requests: 10,
    period_ms: 1_000,
    burst: 10,
};

pub fn entry(key: &str, limits: &[LimitSpec], spent: u64, denied: u64) -> SyncEntry {
    SyncEntry {
        key: key.into(),
        limits: limits.to_vec(),
        spent,
        denied,
    }
}

pub fn batch(proxy: &str, interval_ms: u64, entries: Vec<SyncEntry>) -> SyncRequest {
    SyncRequest {
        proxy: proxy.into(),
        interval_ms,
        entries,
    }
}
