//! The gates: `/v1` lets a request go on only with a proxy token the service knows, the admin
//! API only with an admin token (see [`crate::credentials`]); the handlers learn who sent it.

use axum::extract::{Request, State};
use axum::http::header::AUTHORIZATION;
use axum::middleware::Next;
use axum::response::Response;
use std::sync::Arc;

use crate::error::AppError;
use crate::state::AppState;

/// Lets the request through only with a token the service knows, and tells the handlers who
/// sent it (a [`Caller`] extension).
pub async fn require_token(
    State(state): State<AppState>,
    mut request: Request,
    next: Next,
) -> Result<Response, AppError> {
    let authorization = request
        .headers()
        .get(AUTHORIZATION)
        .map(|value| value.as_bytes());
    let caller = state
        .proxies()
        .authenticate(authorization)
        .ok_or(AppError::Unauthorized)?;
    request.extensions_mut().insert(caller);
    Ok(next.run(request).await)
}

/// The caller of an admin request: its credential's name (a request extension), who the audit
/// log records.
#[derive(Debug, Clone)]
pub struct Admin {
    pub name: Arc<str>,
}

/// Lets an admin request through only with an admin token (`--admin-tokens-file`), and tells
/// the handlers whose ([`Admin`]). Without `--admin-tokens-file` the admin API is disabled:
/// 404 `admin_disabled`, whatever the token.
pub async fn require_admin(
    State(state): State<AppState>,
    mut request: Request,
    next: Next,
) -> Result<Response, AppError> {
    let admins = state.admins().ok_or(AppError::AdminDisabled)?;
    let authorization = request
        .headers()
        .get(AUTHORIZATION)
        .map(|value| value.as_bytes());
    let caller = admins
        .authenticate(authorization)
        .ok_or(AppError::Unauthorized)?;
    let name = caller.name.unwrap_or_else(|| "admin".into());
    request.extensions_mut().insert(Admin { name });
    Ok(next.run(request).await)
}
