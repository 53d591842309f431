//! `POST /v1/check`: one strict decision for one key, for rules that choose exactness over
//! latency: `lua/check.lua` for token buckets (the proxies' outstanding leases are set aside
//! first), `lua/window.lua` for windows (`fixed_window`, `sliding_window`), `lua/sliding_log.lua`
//! for sliding logs (the limits of one check share one algorithm, see `validate`).

use axum::extract::State;
use axum::Json;
use sluice_protocol::{AlgorithmSpec, CheckRequest, CheckResponse};

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
    // The limits of one check share one algorithm (`validate`).
    let algorithm = request.limits.first().map(|l| l.algorithm);
    let script = match algorithm {
        Some(AlgorithmSpec::SlidingLog) => &state.scripts.sliding_log,
        Some(a) if a.windowed() => &state.scripts.window,
        _ => &state.scripts.check,
    };
    let mut invocation = script.prepare_invoke();
    invocation
        .arg(now_override_us)
        .arg(request.cost)
        .arg(request.limits.len());
    match algorithm {
        Some(AlgorithmSpec::SlidingLog) => {
            keys::add_logs(&mut invocation, &request.key, &request.limits)
        }
        Some(a) if a.windowed() => {
            keys::add_windows(&mut invocation, &request.key, &request.limits)
        }
        _ => keys::add_limits(&mut invocation, &request.key, &request.limits),
    }
    keys::add_penalty(
        &mut invocation,
        &request.key,
        &request.limits,
        request.penalty_ms,
    );
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
