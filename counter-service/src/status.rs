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
//! little to answer: one status is built at most every [`STATUS_TTL`] (one Redis read), one at a
//! time, and shared by every caller meanwhile (`Cache-Control: public, max-age=2`). At most
//! `--status-rate-per-s` calls a second (a token bucket as deep as one second) may build a new
//! one; past it, a call is answered the last status built, however old, so that a flood makes the
//! answer at most one token's refill older and refuses no status page. A call answered a status
//! built before it carries `Age` (whole seconds). Only a call past the rate before any status was
//! built is answered 429 with `Retry-After`. It says nothing a proxy's answers do not already
//! tell a client: no rule, no key, no token, no proxy id.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::header::{HeaderValue, AGE, CACHE_CONTROL};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::error::AppError;
use crate::state::AppState;
use crate::status_cache::{Built, Serve};
pub use crate::status_cache::{StatusCache, STATUS_TTL};

/// The fleet utilization from which the status says `degraded`: bulkheads shed at `high`.
pub const DEGRADED_UTILIZATION: f64 = 0.85;

/// `GET /v1/status`.
pub async fn status(State(state): State<AppState>) -> Result<Response, AppError> {
    let cache = &state.status;
    match cache.serve(state.settings.status_rate_per_s, Instant::now()) {
        Serve::Cached(built) => return Ok(answer(built, true)),
        Serve::Refuse => return Err(AppError::TooManyRequests),
        Serve::Build => {}
    }
    // One build at a time: a call that finds one under way answers the last status built (it
    // waits for the one under way only when there is none).
    let _building = match cache.building.try_lock() {
        Ok(building) => building,
        Err(_) => match cache.last() {
            Some(built) => return Ok(answer(built, true)),
            None => cache.building.lock().await,
        },
    };
    if let Some(built) = cache.last() {
        if Instant::now().saturating_duration_since(built.at) < STATUS_TTL {
            return Ok(answer(built, true));
        }
    }
    let body = build(&state).await;
    Ok(answer(cache.store(body, Instant::now()), false))
}

/// The answer of `built`, said to be `cached` (built before this call: with its `Age`) or not.
fn answer(built: Built, cached: bool) -> Response {
    let age = cached.then(|| Instant::now().saturating_duration_since(built.at).as_secs());
    let mut response = Json(built.body).into_response();
    let headers = response.headers_mut();
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("public, max-age=2"));
    if let Some(age) = age {
        headers.insert(AGE, HeaderValue::from(age));
    }
    response
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
