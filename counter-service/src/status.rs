//! `GET /v1/status`: what a status page or a client may know of the limiter, without credentials.
//!
//! ```json
//! {"status": "operational", "limiter": "up", "bypass": false,
//!  "fleet": {"utilization": 0.42, "proxies": 3}, "as_of_ms": 1764633600000}
//! ```
//!
//! - `status`: `operational`; `degraded` when Redis does not answer (rules fall back as configured:
//!   `fail_closed` rules answer 503) or the fleet's utilization is at least
//!   [`DEGRADED_UTILIZATION`] (bulkheads shed); `bypassed` when the emergency bypass is on (no limit
//!   is enforced).
//! - `limiter`: `up` when Redis answered the read this status was built from, else `down`.
//! - `bypass`: the emergency bypass override is on (`null` when Redis did not say).
//! - `fleet`: the load level this replica last answered a proxy, while fresh
//!   (`--fleet-report-max-age-ms`); `null` otherwise.
//!
//! Whoever can reach the service can call it, so it costs them nothing to ask and the service
//! little to answer: one status is built at most every [`STATUS_TTL`] (one Redis read) and shared
//! by every caller meanwhile (`Cache-Control: public, max-age=2`), and the endpoint answers at most
//! `--status-rate-per-s` a second (a token bucket as deep as one second), past which it answers 429
//! with `Retry-After`. It says nothing a proxy's answers do not already tell a client: no rule, no
//! key, no token, no proxy id.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::header::{HeaderValue, CACHE_CONTROL};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::error::AppError;
use crate::state::AppState;
pub use crate::status_cache::StatusCache;

/// How long one built status answers every caller.
pub const STATUS_TTL: Duration = Duration::from_secs(2);
/// The fleet utilization from which the status says `degraded`: bulkheads shed at `high`.
pub const DEGRADED_UTILIZATION: f64 = 0.85;

/// `GET /v1/status`.
pub async fn status(State(state): State<AppState>) -> Result<Response, AppError> {
    let now = Instant::now();
    if !state.status.admit(state.settings.status_rate_per_s, now) {
        return Err(AppError::TooManyRequests);
    }
    let body = {
        let mut built = state.status.built.lock().await;
        match &*built {
            Some((at, body)) if now.saturating_duration_since(*at) < STATUS_TTL => body.clone(),
            _ => {
                let body = build(&state).await;
                *built = Some((Instant::now(), body.clone()));
                body
            }
        }
    };
    let mut response = Json(body).into_response();
    response
        .headers_mut()
        .insert(CACHE_CONTROL, HeaderValue::from_static("public, max-age=2"));
    Ok(response)
}

/// A status from one read of the overrides' head (Redis up, the bypass) and the fleet level
/// this replica last answered.
async fn build(state: &AppState) -> Value {
    let bypass = match crate::overrides::bypass_now(state).await {
        Ok(bypass) => Some(bypass),
        Err(error) => {
            tracing::warn!("status: Redis did not answer: {error}");
            None
        }
    };
    let max_age = Duration::from_millis(state.settings.fleet_report_max_age_ms);
    let fleet = state.status.fleet_within(max_age, Instant::now());
    let status = match (bypass, fleet) {
        (Some(true), _) => "bypassed",
        (None, _) => "degraded",
        (_, Some(fleet)) if fleet.utilization >= DEGRADED_UTILIZATION => "degraded",
        _ => "operational",
    };
    let as_of_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    json!({
        "status": status,
        "limiter": if bypass.is_some() { "up" } else { "down" },
        "bypass": bypass,
        "fleet": fleet.map(|f| json!({"utilization": f.utilization, "proxies": f.proxies})),
        "as_of_ms": as_of_ms,
    })
}
