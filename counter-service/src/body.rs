//! The JSON body extractor: 413 past the body limit, 400 naming the field that does not parse.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use serde::de::DeserializeOwned;

use crate::error::AppError;
use crate::state::AppState;

/// A JSON body, parsed whatever its content type; errors are [`AppError`]s.
pub struct JsonBody<T>(pub T);

impl<T: DeserializeOwned> FromRequest<AppState> for JsonBody<T> {
    type Rejection = AppError;

    async fn from_request(request: Request, state: &AppState) -> Result<Self, AppError> {
        let bytes = Bytes::from_request(request, state)
            .await
            .map_err(|rejection| {
                if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                    AppError::PayloadTooLarge(state.settings.max_body_bytes)
                } else {
                    AppError::MalformedJson(rejection.body_text())
                }
            })?;
        parse(&bytes).map(JsonBody)
    }
}

/// Parses JSON; the error names the path of the bad value (`entries[3].spent: ...`).
pub fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, AppError> {
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut deserializer).map_err(|error| {
        let path = error.path().to_string();
        let inner = error.into_inner();
        if path.is_empty() || path == "." || path == "?" {
            AppError::MalformedJson(inner.to_string())
        } else {
            AppError::MalformedJson(format!("{path}: {inner}"))
        }
    })?;
    deserializer
        .end()
        .map_err(|error| AppError::MalformedJson(error.to_string()))?;
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_core::protocol::SyncRequest;

    fn message(json: &str) -> String {
        parse::<SyncRequest>(json.as_bytes())
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    }

    #[test]
    fn errors_name_the_bad_field() {
        let json = r#"{"proxy":"p","interval_ms":100,"entries":[{"key":"k","limits":[],"spent":"x","denied":0}]}"#;
        assert_eq!(
            message(json),
            "malformed JSON: entries[0].spent: invalid type: string \"x\", expected u64 at line 1 column 76"
        );
        assert_eq!(
            message("{"),
            "malformed JSON: EOF while parsing an object at line 1 column 1"
        );
        assert!(message("{} x").starts_with("malformed JSON: "));
    }
}
