//! The JSON body extractor: 413 past the body limit, 400 naming the field that does not parse,
//! 400 for a body nested deeper than [`MAX_DEPTH`].

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use serde::de::DeserializeOwned;

use crate::error::AppError;
use crate::state::AppState;

/// Deepest nesting of arrays and objects a body may have. The protocol needs 4 (a limit in an
/// entry in a batch); unknown fields are skipped by the parser, at a cost that grows with their
/// size, so a deep one is refused before parsing.
pub const MAX_DEPTH: usize = 32;

/// A JSON body, parsed whatever its content type; errors are [`AppError`]s.
pub struct JsonBody<T>(pub T);

impl<T: DeserializeOwned> FromRequest<AppState> for JsonBody<T> {
    type Rejection = AppError;

    async fn from_request(request: Request, state: &AppState) -> Result<Self, AppError> {
        let bytes = bytes(request, state).await?;
        parse(&bytes).map(JsonBody)
    }
}

/// A JSON body that may be absent (empty, or only whitespace): `None` then.
pub struct OptionalJsonBody<T>(pub Option<T>);

impl<T: DeserializeOwned> FromRequest<AppState> for OptionalJsonBody<T> {
    type Rejection = AppError;

    async fn from_request(request: Request, state: &AppState) -> Result<Self, AppError> {
        let bytes = bytes(request, state).await?;
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(OptionalJsonBody(None));
        }
        parse(&bytes).map(|value| OptionalJsonBody(Some(value)))
    }
}

/// The body's bytes, within the route's body limit (the admin API's is smaller than
/// `--max-body-bytes`: [`crate::settings::ADMIN_MAX_BODY_BYTES`]).
async fn bytes(request: Request, state: &AppState) -> Result<Bytes, AppError> {
    let admin = request.uri().path().starts_with("/admin/");
    Bytes::from_request(request, state)
        .await
        .map_err(|rejection| {
            if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                let limit = if admin {
                    state.settings.admin_body_limit()
                } else {
                    state.settings.max_body_bytes
                };
                AppError::PayloadTooLarge(limit)
            } else {
                AppError::MalformedJson(rejection.body_text())
            }
        })
}

/// Parses JSON; the error names the path of the bad value (`entries[3].spent: ...`).
pub fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, AppError> {
    if too_deep(bytes, MAX_DEPTH) {
        return Err(AppError::MalformedJson(format!(
            "body: nested deeper than {MAX_DEPTH} levels"
        )));
    }
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

/// Whether the JSON text nests arrays and objects deeper than `max`: one pass over the bytes,
/// brackets inside strings not counted. Malformed text is left to the parser.
pub fn too_deep(bytes: &[u8], max: usize) -> bool {
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    for &byte in bytes {
        if in_string {
            match byte {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match byte {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                if depth > max {
                    return true;
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_protocol::{LoadReport, SyncRequest};

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

    /// `load` is optional both ways: an older proxy's sync reads as one without a report, and is
    /// written without the field; an older service (whose request type had no `load`) ignores it.
    #[test]
    fn the_load_report_is_optional_on_the_wire() {
        let old = r#"{"proxy":"p","interval_ms":100,"entries":[]}"#;
        let request: SyncRequest = parse(old.as_bytes()).unwrap();
        assert_eq!(request.load, None);
        assert_eq!(serde_json::to_string(&request).unwrap(), old);

        let new = r#"{"proxy":"p","interval_ms":100,"entries":[],"load":{"utilization":0.5,"shed_rate":0.0,"latency_ms":12.5}}"#;
        let request: SyncRequest = parse(new.as_bytes()).unwrap();
        let load = LoadReport {
            utilization: 0.5,
            shed_rate: 0.0,
            latency_ms: 12.5,
        };
        assert_eq!(request.load, Some(load));
        assert_eq!(serde_json::to_string(&request).unwrap(), new);

        #[derive(serde::Deserialize)]
        #[allow(dead_code)]
        struct OlderSyncRequest {
            proxy: String,
            interval_ms: u64,
            entries: Vec<sluice_protocol::SyncEntry>,
        }
        assert!(parse::<OlderSyncRequest>(new.as_bytes()).is_ok());

        let partial = r#"{"proxy":"p","interval_ms":100,"entries":[],"load":{"utilization":0.5}}"#;
        assert!(
            message(partial).starts_with("malformed JSON: load: missing field `shed_rate`"),
            "{}",
            message(partial)
        );
    }

    #[test]
    fn depth_counts_brackets_outside_strings() {
        assert!(!too_deep(b"[[[]]]", 3));
        assert!(too_deep(b"[[[[]]]]", 3));
        assert!(!too_deep(br#"{"a":"[[[[[[","b":[{}]}"#, 3));
        assert!(!too_deep(br#"["\"[[[[[["]"#, 1));
        assert!(too_deep(br#"["\\",[[[]]]]"#, 3));
        let deep = format!("{{\"x\":{}{}}}", "[".repeat(40), "]".repeat(40));
        assert_eq!(
            message(&deep),
            "malformed JSON: body: nested deeper than 32 levels"
        );
    }
}
