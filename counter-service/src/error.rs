//! Every way a request can fail, as one enum that answers with a JSON [`ErrorBody`].
//!
//! The body names the problem for the caller; internals (Redis errors, addresses) stay in the
//! logs: the response carries an [`ErrorReport`] extension that the logging middleware reads.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use sluice_protocol::ErrorBody;

use crate::backend::BackendError;

#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// No bearer token, or a wrong one.
    #[error("missing or invalid bearer token")]
    Unauthorized,
    /// The client certificate and the bearer token name different credentials.
    #[error(
        "the client certificate and the bearer token name different credentials: send one, or \
         both of the same credential"
    )]
    CredentialsDisagree,
    /// The client certificate's names map to more than one credential.
    #[error("the client certificate's names map to more than one credential")]
    CertificateAmbiguous,
    /// The body is not the JSON the endpoint takes.
    #[error("malformed JSON: {0}")]
    MalformedJson(String),
    /// The body is larger than `--max-body-bytes`.
    #[error("request body larger than {0} bytes")]
    PayloadTooLarge(usize),
    /// The JSON is well formed, but a value is out of bounds.
    #[error("{field}: {reason}")]
    Invalid { field: String, reason: String },
    /// Too many requests in flight: shed.
    #[error("the service is overloaded, retry later")]
    Overloaded,
    /// The request did not finish within `--request-timeout-ms`.
    #[error("the request timed out, retry later")]
    Timeout,
    /// Redis did not answer in time, or at all.
    #[error("the counter store is unavailable, retry later")]
    Unavailable(#[source] BackendError),
    /// Redis answered something the service does not understand.
    #[error("internal error")]
    Internal(String),
    /// No such route.
    #[error("no such endpoint")]
    NotFound,
    /// The admin API was not enabled (neither `--admin-tokens-file` nor `--admin-client-certs-file`).
    #[error("the admin API is disabled: start the service with --admin-tokens-file or --admin-client-certs-file")]
    AdminDisabled,
    /// The override to delete is not set (what it names).
    #[error("no {0} is set")]
    NoOverride(String),
    /// The route exists, not for this method (the method); `Allow` lists the right ones.
    #[error("method {0} not allowed on this endpoint (see the Allow header)")]
    MethodNotAllowed(String),
    /// Past an endpoint's own rate bound (`/v1/status`).
    #[error("too many requests, retry later")]
    TooManyRequests,
    /// Any other error status the framework answered without a body of ours.
    #[error("{}", .0.canonical_reason().unwrap_or("error").to_ascii_lowercase())]
    Status(StatusCode),
}

/// What the logging middleware learns about an error response (never sent to the client).
#[derive(Debug, Clone)]
pub struct ErrorReport {
    pub kind: &'static str,
    pub detail: String,
}

impl AppError {
    pub fn invalid(field: impl Into<String>, reason: impl Into<String>) -> AppError {
        AppError::Invalid {
            field: field.into(),
            reason: reason.into(),
        }
    }

    /// The stable name of this error: the `error` field of the body and the metrics label.
    pub fn kind(&self) -> &'static str {
        match self {
            AppError::Unauthorized => "unauthorized",
            AppError::CredentialsDisagree => "credentials_disagree",
            AppError::CertificateAmbiguous => "certificate_ambiguous",
            AppError::MalformedJson(_) => "malformed_json",
            AppError::PayloadTooLarge(_) => "payload_too_large",
            AppError::Invalid { .. } => "invalid_request",
            AppError::Overloaded => "overloaded",
            AppError::Timeout => "timeout",
            AppError::Unavailable(_) => "redis_unavailable",
            AppError::Internal(_) => "internal",
            AppError::NotFound | AppError::NoOverride(_) => "not_found",
            AppError::AdminDisabled => "admin_disabled",
            AppError::MethodNotAllowed(_) => "method_not_allowed",
            AppError::TooManyRequests => "rate_limited",
            AppError::Status(status) if status.is_server_error() => "internal",
            AppError::Status(_) => "bad_request",
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            AppError::Unauthorized => StatusCode::UNAUTHORIZED,
            AppError::CredentialsDisagree | AppError::CertificateAmbiguous => StatusCode::FORBIDDEN,
            AppError::MalformedJson(_) | AppError::Invalid { .. } => StatusCode::BAD_REQUEST,
            AppError::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            AppError::Overloaded | AppError::Timeout | AppError::Unavailable(_) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            AppError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            AppError::NotFound | AppError::AdminDisabled | AppError::NoOverride(_) => {
                StatusCode::NOT_FOUND
            }
            AppError::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            AppError::TooManyRequests => StatusCode::TOO_MANY_REQUESTS,
            AppError::Status(status) => *status,
        }
    }

    /// What goes to the logs: the public message plus any internal cause.
    fn detail(&self) -> String {
        match self {
            AppError::Unavailable(cause) => format!("{self}: {cause}"),
            AppError::Internal(cause) => format!("{self}: {cause}"),
            _ => self.to_string(),
        }
    }
}

impl From<BackendError> for AppError {
    fn from(error: BackendError) -> AppError {
        match error {
            BackendError::Reply(detail) => AppError::Internal(detail),
            other => AppError::Unavailable(other),
        }
    }
}

impl IntoResponse for AppError {
    fn into_response(self) -> Response {
        let status = self.status();
        let body = ErrorBody {
            error: self.kind().to_owned(),
            message: self.to_string(),
        };
        let mut response = (status, Json(body)).into_response();
        if status == StatusCode::SERVICE_UNAVAILABLE || status == StatusCode::TOO_MANY_REQUESTS {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response.extensions_mut().insert(ErrorReport {
            kind: self.kind(),
            detail: loggable(&self.detail()),
        });
        response
    }
}

/// Most characters of client-controlled text one log line carries.
const MAX_LOGGED_CHARS: usize = 512;

/// Text as it may go into a log line: control characters escaped (a client cannot start a
/// line of its own) and at most [`MAX_LOGGED_CHARS`] characters (nor fill the log).
pub fn loggable(text: &str) -> String {
    let mut out = String::with_capacity(text.len().min(MAX_LOGGED_CHARS));
    for (i, c) in text.chars().enumerate() {
        if i == MAX_LOGGED_CHARS {
            out.push_str("...");
            break;
        }
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_text_is_one_bounded_log_line() {
        let forged = "bad\nWARN forged line\r\u{1b}[31m";
        let logged = loggable(forged);
        assert!(!logged.chars().any(char::is_control), "{logged}");
        assert!(
            logged.contains("\\n") && logged.contains("\\u{1b}"),
            "{logged}"
        );

        let long = "x".repeat(10 * MAX_LOGGED_CHARS);
        assert_eq!(loggable(&long).chars().count(), MAX_LOGGED_CHARS + 3);
        assert_eq!(loggable("plain text"), "plain text");
    }

    #[test]
    fn an_error_response_reports_its_detail_escaped() {
        let error = AppError::invalid("entries[0].key", "line\nbreak");
        let response = error.into_response();
        let report = response.extensions().get::<ErrorReport>().cloned();
        let detail = report.map(|r| r.detail).unwrap_or_default();
        assert!(detail.contains("entries[0].key"), "{detail}");
        assert!(!detail.contains('\n'), "{detail}");
    }
}
