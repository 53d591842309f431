//! The router: `/v1` behind the token, shed past the concurrency limit, bounded in time and body
//! size; the operator endpoints beside it, always answering.

use axum::error_handling::HandleErrorLayer;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{get, post};
use axum::{BoxError, Router};
use tower::ServiceBuilder;

use crate::error::{AppError, ErrorReport};
use crate::state::AppState;
use crate::{auth, check, probes, sync};

/// The whole service as a `Router`, testable without a socket (`tower::ServiceExt::oneshot`).
pub fn app(state: AppState) -> Router {
    let settings = state.settings.clone();
    let v1 = Router::new()
        .route("/v1/sync", post(sync::handle))
        .route("/v1/check", post(check::handle))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            auth::require_token,
        ))
        .layer(
            ServiceBuilder::new()
                .layer(HandleErrorLayer::new(overloaded))
                .load_shed()
                .concurrency_limit(settings.max_concurrency)
                .timeout(settings.request_timeout()),
        )
        .layer(DefaultBodyLimit::max(settings.max_body_bytes));
    let operators = Router::new()
        .route("/healthz", get(probes::healthz))
        .route("/readyz", get(probes::readyz))
        .route("/metrics", get(probes::metrics));
    Router::new()
        .merge(v1)
        .merge(operators)
        .fallback(probes::not_found)
        .layer(middleware::from_fn_with_state(state.clone(), report_errors))
        .with_state(state)
}

/// What the load shedder and the timeout answer.
async fn overloaded(error: BoxError) -> AppError {
    if error.is::<tower::timeout::error::Elapsed>() {
        AppError::Timeout
    } else if error.is::<tower::load_shed::error::Overloaded>() {
        AppError::Overloaded
    } else {
        AppError::Internal(error.to_string())
    }
}

/// Logs every error response with its internal detail, and counts it by kind.
async fn report_errors(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let method = request.method().clone();
    let path = request.uri().path().to_owned();
    let response = next.run(request).await;
    if let Some(report) = response.extensions().get::<ErrorReport>() {
        state.metrics.error(report.kind);
        let status = response.status().as_u16();
        if response.status().is_server_error() {
            tracing::warn!(%method, %path, status, kind = report.kind, "{}", report.detail);
        } else {
            tracing::debug!(%method, %path, status, kind = report.kind, "{}", report.detail);
        }
    }
    response
}
