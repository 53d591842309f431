//! `POST /v1/check`: one strict decision for one key, for rules that choose exactness over
//! latency: `lua/check.lua` for token buckets (the proxies' outstanding leases are set aside
//! first), `lua/window.lua` for windows (`fixed_window`, `sliding_window`), `lua/sliding_log.lua`
//! for sliding logs (the limits of one check share one algorithm, see `validate`).

use axum::extract::State;
use axum::{Extension, Json};
use sluice_protocol::{AlgorithmSpec, CheckLease, CheckRequest, CheckResponse};

use crate::credentials::Caller;

use crate::backend::BackendError;
use crate::body::JsonBody;
use crate::error::AppError;
use crate::keys;
use crate::state::AppState;
use crate::validate;

pub async fn handle(
    State(state): State<AppState>,
    caller: Option<Extension<Caller>>,
    JsonBody(request): JsonBody<CheckRequest>,
) -> Result<Json<CheckResponse>, AppError> {
    let _in_flight = state.enter();
    validate::check_request(&request, &state.settings)?;
    let caller = caller.map(|Extension(caller)| caller).unwrap_or_default();
    // The asking proxy's id under its credential, as its syncs' leases are kept: a caller
    // reads only the leases of its own credential's proxies.
    let asker = request.proxy.as_deref().map(|proxy| caller.proxy_id(proxy));
    let response = decide(&state, &request, asker.as_deref(), 0).await?;
    state.metrics.checked(response.allowed);
    Ok(Json(response))
}

/// Decides a (validated) check for the proxy `asker` (its id as its leases are kept, if it
/// named one: a denial its own lease covers answers that lease, token buckets only).
/// `now_override_us` is 0 in service (Redis `TIME`); tests pass a fake time.
pub async fn decide(
    state: &AppState,
    request: &CheckRequest,
    asker: Option<&str>,
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
    invocation.arg(asker.unwrap_or(""));
    state.metrics.script_called("check", 1);
    let reply: Vec<i64> = state.backend.invoke("check", &invocation).await?;
    let whole = |n: i64| u64::try_from(n).unwrap_or(0);
    let (decision, lease) = match reply[..] {
        [a, b, c, d] => ([a, b, c, d], None),
        [a, b, c, d, tokens, ttl_ms] => (
            [a, b, c, d],
            Some(CheckLease {
                tokens: whole(tokens),
                ttl_ms: whole(ttl_ms),
            }),
        ),
        _ => {
            return Err(BackendError::Reply(format!(
                "the check script answered {} numbers, not 4 or 6",
                reply.len()
            )))
        }
    };
    let [allowed, remaining, retry_after_ms, reset_ms] = decision;
    Ok(CheckResponse {
        allowed: allowed == 1,
        remaining: whole(remaining),
        retry_after_ms: whole(retry_after_ms),
        reset_ms: whole(reset_ms),
        lease: lease.filter(|_| allowed != 1),
    })
}
