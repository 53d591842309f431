//! The endpoints for operators: liveness, readiness, metrics, and the JSON 404.

use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::response::IntoResponse;
use axum::Json;
use serde_json::{json, Value};

use crate::error::AppError;
use crate::state::AppState;

/// `GET /healthz`: the process answers.
pub async fn healthz() -> Json<Value> {
    Json(json!({"status": "alive"}))
}

/// `GET /readyz`: Redis answers `PING` within the Redis timeout.
pub async fn readyz(State(state): State<AppState>) -> Result<Json<Value>, AppError> {
    state.backend.ping().await?;
    Ok(Json(json!({"status": "ready"})))
}

/// `GET /metrics`: OpenMetrics text.
pub async fn metrics(State(state): State<AppState>) -> Result<impl IntoResponse, AppError> {
    let text = state
        .metrics
        .render()
        .map_err(|error| AppError::Internal(error.to_string()))?;
    Ok((
        [(
            CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    ))
}

pub async fn not_found() -> AppError {
    AppError::NotFound
}
