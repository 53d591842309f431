//! The `/v1` gate: a request goes on only with a token the service knows (see
//! [`crate::credentials`]), and the handlers learn who sent it.

use axum::extract::{Request, State};
use axum::http::header::AUTHORIZATION;
use axum::middleware::Next;
use axum::response::Response;

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
        .credentials
        .authenticate(authorization)
        .ok_or(AppError::Unauthorized)?;
    request.extensions_mut().insert(caller);
    Ok(next.run(request).await)
}
