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

use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::header::{HeaderValue, CACHE_CONTROL};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::error::AppError;
use crate::state::AppState;

/// How long one built status answers every caller.
pub const STATUS_TTL: Duration = Duration::from_secs(2);
/// The fleet utilization from which the status says `degraded`: bulkheads shed at `high`.
pub const DEGRADED_UTILIZATION: f64 = 0.85;

/// The endpoint's memory: the last status built, the fleet level last answered, and its bucket.
#[derive(Debug, Default)]
pub struct StatusCache {
    built: tokio::sync::Mutex<Option<(Instant, Value)>>,
    fleet: Mutex<Option<FleetSeen>>,
    bucket: Mutex<Option<(f64, Instant)>>,
}

#[derive(Debug, Clone, Copy)]
struct FleetSeen {
    utilization: f64,
    proxies: u64,
    at: Instant,
}

impl StatusCache {
    /// Notes the fleet level this replica answered a proxy (`crate::fleet::level`).
    pub fn fleet_answered(&self, utilization: f64, proxies: u64, at: Instant) {
        if let Ok(mut fleet) = self.fleet.lock() {
            *fleet = Some(FleetSeen {
                utilization,
                proxies,
                at,
            });
        }
    }

    /// Takes one token from the bucket (`rate` a second, as deep as `rate`) at `now`: false when
    /// it is empty.
    pub fn admit(&self, rate: u64, now: Instant) -> bool {
        let Ok(mut bucket) = self.bucket.lock() else {
            return false;
        };
        let rate = rate as f64;
        let (tokens, at) = bucket.unwrap_or((rate, now));
        let refilled = (tokens + now.saturating_duration_since(at).as_secs_f64() * rate).min(rate);
        if refilled < 1.0 {
            *bucket = Some((refilled, now));
            return false;
        }
        *bucket = Some((refilled - 1.0, now));
        true
    }

    fn fleet_within(&self, max_age: Duration, now: Instant) -> Option<FleetSeen> {
        let fleet = self.fleet.lock().ok().and_then(|fleet| *fleet)?;
        (now.saturating_duration_since(fleet.at) < max_age).then_some(fleet)
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bucket_answers_its_rate_and_refills() {
        let cache = StatusCache::default();
        let t0 = Instant::now();
        let admitted = (0..25).filter(|_| cache.admit(20, t0)).count();
        assert_eq!(admitted, 20, "as deep as one second");
        assert!(
            !cache.admit(20, t0 + Duration::from_millis(10)),
            "0.2 token"
        );
        assert!(
            cache.admit(20, t0 + Duration::from_millis(60)),
            "1.2 tokens"
        );
        let later = t0 + Duration::from_secs(60);
        let admitted = (0..25).filter(|_| cache.admit(20, later)).count();
        assert_eq!(admitted, 20, "never deeper than one second");
    }

    #[test]
    fn a_fleet_level_counts_while_fresh() {
        let cache = StatusCache::default();
        let t0 = Instant::now();
        assert!(cache.fleet_within(Duration::from_secs(5), t0).is_none());
        cache.fleet_answered(0.9, 3, t0);
        let seen = cache.fleet_within(Duration::from_secs(5), t0 + Duration::from_secs(4));
        assert_eq!(seen.map(|f| (f.utilization, f.proxies)), Some((0.9, 3)));
        assert!(cache
            .fleet_within(Duration::from_secs(5), t0 + Duration::from_secs(5))
            .is_none());
    }
}
