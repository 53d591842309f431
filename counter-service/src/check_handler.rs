//! `POST /v1/check`: one strict decision for one key, for rules that choose exactness over
//! latency: `lua/check.lua` for token buckets (the proxies' outstanding leases are set aside
//! first), `lua/window.lua` for windows (`fixed_window`, `sliding_window`; the limits of one
//! check share one algorithm, see `validate`).

use axum::extract::State;
use axum::Json;
use sluice_protocol::{CheckRequest, CheckResponse};

use crate::backend::BackendError;
use crate::body::JsonBody;
use crate::error::AppError;
use crate::keys;
use crate::state::AppState;
use crate::validate;

pub async fn handle(
    State(state): State<AppState>,
    JsonBody(request): JsonBody<CheckRequest>,
) -> Result<Json<CheckResponse>, AppError> {
    let _in_flight = state.enter();
    validate::check_request(&request, &state.settings)?;
    let response = decide(&state, &request, 0).await?;
    state.metrics.checked(response.allowed);
    Ok(Json(response))
}

/// Decides a (validated) check. `now_override_us` is 0 in service (Redis `TIME`); tests pass
/// a fake time.
pub async fn decide(
    state: &AppState,
    request: &CheckRequest,
    now_override_us: u64,
) -> Result<CheckResponse, BackendError> {
    let windowed = request.limits.iter().any(|l| l.algorithm.windowed());
    let script = if windowed {
        &state.scripts.window
    } else {
        &state.scripts.check
    };
    let mut invocation = script.prepare_invoke();
    invocation
        .arg(now_override_us)
        .arg(request.cost)
        .arg(request.limits.len());
    if windowed {
        keys::add_windows(&mut invocation, &request.key, &request.limits);
    } else {
        keys::add_limits(&mut invocation, &request.key, &request.limits);
    }
    state.metrics.script_called("check", 1);
    let reply: Vec<i64> = state.backend.invoke("check", &invocation).await?;
    match reply[..] {
        [allowed, remaining, retry_after_ms, reset_ms] => Ok(CheckResponse {
            allowed: allowed == 1,
            remaining: u64::try_from(remaining).unwrap_or(0),
            retry_after_ms: u64::try_from(retry_after_ms).unwrap_or(0),
            reset_ms: u64::try_from(reset_ms).unwrap_or(0),
        }),
        _ => Err(BackendError::Reply(format!(
            "the check script answered {} numbers, not 4",
            reply.len()
        ))),
    }
}
