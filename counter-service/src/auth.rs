//! The shared bearer token on `/v1`, compared in constant time.

use axum::extract::{Request, State};
use axum::http::header::AUTHORIZATION;
use axum::middleware::Next;
use axum::response::Response;
use subtle::ConstantTimeEq;

use crate::error::AppError;
use crate::state::AppState;

/// Lets the request through only with `Authorization: Bearer <token>` (or with no token set).
pub async fn require_token(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Result<Response, AppError> {
    if let Some(expected) = state.settings.token.as_deref().filter(|t| !t.is_empty()) {
        let given = request
            .headers()
            .get(AUTHORIZATION)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.strip_prefix("Bearer "))
            .unwrap_or("");
        if !token_matches(expected.as_bytes(), given.trim().as_bytes()) {
            return Err(AppError::Unauthorized);
        }
    }
    Ok(next.run(request).await)
}

/// Whether `given` is `expected`, in a time that depends on `expected`'s length only.
pub fn token_matches(expected: &[u8], given: &[u8]) -> bool {
    let mut same = (expected.len() as u64).ct_eq(&(given.len() as u64));
    for (i, byte) in expected.iter().enumerate() {
        same &= byte.ct_eq(given.get(i).unwrap_or(&!*byte));
    }
    same.into()
}

#[cfg(test)]
mod tests {
    use super::token_matches;

    #[test]
    fn only_the_exact_token_matches() {
        assert!(token_matches(b"secret", b"secret"));
        assert!(!token_matches(b"secret", b"secreT"));
        assert!(!token_matches(b"secret", b"secret2"));
        assert!(!token_matches(b"secret", b"secre"));
        assert!(!token_matches(b"secret", b""));
    }
}
