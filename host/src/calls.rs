//! HTTP callouts (`proxy_http_call`) waiting for the test to answer them.

use std::time::Duration;

use super::abi::Headers;

/// A callout the filter dispatched and nobody has answered yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpCall {
    /// Worker VM that made the call; the answer is delivered there.
    pub worker: usize,
    /// Context that made the call (a stream's, or the root's); receives `on_http_call_response`.
    pub context_id: u32,
    /// Unique within the proxy (Envoy's tokens are per VM; the harness never reuses one).
    pub token: u32,
    /// The cluster name the filter called.
    pub upstream: String,
    pub headers: Headers,
    pub body: Vec<u8>,
    pub trailers: Headers,
    /// `None` when the filter passed 0 (no timeout).
    pub timeout: Option<Duration>,
    /// Monotonic deadline in ns, if any.
    pub(crate) deadline: Option<u64>,
}

impl HttpCall {
    /// The first value of request header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        super::abi::header(&self.headers, name)
    }
}

/// What the calling VM sees while `proxy_on_http_call_response` runs.
#[derive(Debug, Clone, Default)]
pub(crate) struct CallResponse {
    /// `None` on a failure (reset): Envoy then has no response message at all, so the
    /// response maps and body are unavailable.
    pub message: Option<CallMessage>,
    /// `proxy_get_status` during the callback.
    pub status_code: u32,
    pub status_message: String,
    /// `ngx_wasm_module`'s failure: the callback gets 0 headers, 0 body bytes, 0 trailers, and
    /// the response headers hold only `:dispatch_status` with this reason.
    pub dispatch_status: Option<&'static str>,
}

impl CallResponse {
    /// A callout failed as `ngx_wasm_module` reports it (`timeout`, `broken connection`,
    /// `resolver failure`, ...).
    pub(crate) fn dispatch_failure(reason: &'static str) -> CallResponse {
        CallResponse {
            message: Some(CallMessage {
                headers: vec![(":dispatch_status".to_string(), reason.to_string())],
                ..CallMessage::default()
            }),
            dispatch_status: Some(reason),
            ..CallResponse::default()
        }
    }
}

#[derive(Debug, Clone, Default)]
pub(crate) struct CallMessage {
    pub headers: Headers,
    pub body: Vec<u8>,
    pub trailers: Headers,
}

/// Envoy's answer when a callout's timeout elapses: the async client's router sends a local
/// reply, delivered as a successful response.
pub(crate) fn timeout_reply() -> CallMessage {
    let body = b"upstream request timeout".to_vec();
    CallMessage {
        headers: vec![
            (":status".to_string(), "504".to_string()),
            ("content-length".to_string(), body.len().to_string()),
            ("content-type".to_string(), "text/plain".to_string()),
        ],
        body,
        trailers: Vec::new(),
    }
}
