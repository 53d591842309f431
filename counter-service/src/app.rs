//! The router: `/v1` behind the token, shed past the concurrency limit, bounded in time and body
//! size; the admin API (`/admin/v1`) behind an admin token, bounded likewise; the operator
//! endpoints beside them, always answering.

use axum::error_handling::HandleErrorLayer;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use axum::http::{Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{BoxError, Router};
use tower::ServiceBuilder;

use crate::error::{AppError, ErrorReport};
use crate::state::AppState;
use crate::{admin, auth, check_handler, key_admin, probes, status, sync_handler};

/// The whole service as a `Router`, testable without a socket (`tower::ServiceExt::oneshot`).
pub fn app(state: AppState) -> Router {
    let settings = state.settings.clone();
    let v1 = Router::new()
        .route("/v1/sync", post(sync_handler::handle))
        .route("/v1/check", post(check_handler::handle))
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
    let admin = Router::new()
        .route("/admin/v1/overrides", get(admin::get_overrides))
        .route(
            "/admin/v1/overrides/bypass",
            put(admin::put_bypass).delete(admin::delete_bypass),
        )
        .route(
            "/admin/v1/overrides/limits/{*target}",
            put(admin::put_limits).delete(admin::delete_limits),
        )
        .route(
            "/admin/v1/overrides/bulkheads/{*name}",
            put(admin::put_bulkhead).delete(admin::delete_bulkhead),
        )
        .route(
            "/admin/v1/overrides/keys/{*rule}",
            put(admin::put_key).delete(admin::delete_key),
        )
        .route("/admin/v1/audit", get(admin::audit))
        .route("/admin/v1/top", get(admin::top))
        .route(
            "/admin/v1/keys/{*rule}",
            get(key_admin::show).delete(key_admin::reset),
        )
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            auth::require_admin,
        ))
        .layer(
            ServiceBuilder::new()
                .layer(HandleErrorLayer::new(overloaded))
                .load_shed()
                .concurrency_limit(admin::MAX_CONCURRENCY)
                .timeout(settings.request_timeout()),
        )
        .layer(DefaultBodyLimit::max(admin::body_limit(&settings)));
    let operators = Router::new()
        .route("/healthz", get(probes::healthz))
        .route("/readyz", get(probes::readyz))
        .route("/metrics", get(probes::metrics))
        // Without credentials, for status pages and clients: bounded in rate and cached.
        .route("/v1/status", get(status::status));
    Router::new()
        .merge(v1)
        .merge(admin)
        .merge(operators)
        .fallback(probes::not_found)
        .layer(middleware::from_fn_with_state(state.clone(), report_errors))
        .with_state(state)
}

/// The same error as a JSON body, keeping the original's headers. (The router adds `Allow` to
/// a 405 after this layer.)
fn as_json_error(original: Response, method: &Method) -> Response {
    let status = original.status();
    let error = if status == StatusCode::METHOD_NOT_ALLOWED {
        AppError::MethodNotAllowed(method.to_string())
    } else if status == StatusCode::NOT_FOUND {
        AppError::NotFound
    } else {
        AppError::Status(status)
    };
    let mut response = error.into_response();
    let kept: Vec<_> = original
        .headers()
        .iter()
        .filter(|(name, _)| {
            **name != CONTENT_TYPE
                && **name != CONTENT_LENGTH
                && !response.headers().contains_key(*name)
        })
        .map(|(name, value)| (name.clone(), value.clone()))
        .collect();
    for (name, value) in kept {
        response.headers_mut().append(name, value);
    }
    response
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

/// Logs every error response with its internal detail, and counts it by kind. An error the
/// framework answered itself (405 on a known route) gets the JSON body of every other error.
async fn report_errors(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let method = request.method().clone();
    let path = crate::error::loggable(request.uri().path());
    let mut response = next.run(request).await;
    let status = response.status();
    if (status.is_client_error() || status.is_server_error())
        && response.extensions().get::<ErrorReport>().is_none()
    {
        response = as_json_error(response, &method);
    }
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
