//! HTTP exchanges: the request a test sends through a worker, and what the filter made of it.

use super::abi::{header, Headers};
use super::properties::Properties;

/// A downstream request, as Envoy's connection manager hands it to the filter chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestSpec {
    pub method: String,
    pub path: String,
    pub authority: String,
    pub scheme: String,
    /// Regular headers (keys are lower-cased, as Envoy's codecs do).
    pub headers: Headers,
    /// Downstream peer, `ip:port` (property `source.address`).
    pub source_address: String,
    /// `Some` sends a body after the headers (`end_of_stream` false on the headers, then
    /// `on_request_body` with the whole body and `end_of_stream` true).
    pub body: Option<Vec<u8>>,
    /// Per-request properties (override the request's and the proxy's).
    pub properties: Properties,
}

impl Default for RequestSpec {
    fn default() -> Self {
        RequestSpec {
            method: "GET".to_string(),
            path: "/".to_string(),
            authority: "example.com".to_string(),
            scheme: "http".to_string(),
            headers: Vec::new(),
            source_address: "1.2.3.4:5678".to_string(),
            body: None,
            properties: Properties::new(),
        }
    }
}

impl RequestSpec {
    /// `GET path` from 1.2.3.4:5678 to example.com.
    pub fn get(path: &str) -> RequestSpec {
        RequestSpec {
            path: path.to_string(),
            ..RequestSpec::default()
        }
    }

    /// `POST path` with `body`.
    pub fn post(path: &str, body: impl Into<Vec<u8>>) -> RequestSpec {
        RequestSpec {
            method: "POST".to_string(),
            body: Some(body.into()),
            ..RequestSpec::get(path)
        }
    }

    /// Adds a header.
    pub fn header(mut self, name: &str, value: &str) -> RequestSpec {
        self.headers.push((name.to_string(), value.to_string()));
        self
    }

    /// Sets the downstream peer address (`ip:port`).
    pub fn from(mut self, source_address: &str) -> RequestSpec {
        self.source_address = source_address.to_string();
        self
    }

    /// Sets `:authority`.
    pub fn authority(mut self, authority: &str) -> RequestSpec {
        self.authority = authority.to_string();
        self
    }
}

/// Names one exchange: the worker it runs on and its context id there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExchangeId {
    pub worker: usize,
    pub context_id: u32,
}

/// Where the filter left a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExchangeState {
    /// The filter paused the request without answering it (e.g. waiting for a callout).
    Paused,
    /// The request went upstream with these headers (pseudo headers included), as the filter
    /// left them when it continued.
    Continued { request_headers: Headers },
    /// The filter answered locally (`send_http_response`); the stream is over. The headers are
    /// as the downstream client gets them: Envoy's local reply (`:status`, `content-length`,
    /// `content-type` for a body) plus the filter's, after the filter's own
    /// `on_http_response_headers` has run on them.
    LocalResponse {
        status: u32,
        headers: Headers,
        body: Vec<u8>,
        /// The response code details the filter gave (Envoy logs them as
        /// `%RESPONSE_CODE_DETAILS%`); empty when it gave none.
        details: String,
        /// The properties the filter set on the stream and the host kept, in order (Envoy keeps
        /// them as filter state `wasm.<name>`, which its access log prints; nginx keeps none
        /// outside its own namespaces).
        properties: Vec<(String, String)>,
    },
    /// The filter reset the stream (`proxy_close_stream`).
    Reset,
}

impl ExchangeState {
    /// A short name for messages.
    pub fn name(&self) -> &'static str {
        match self {
            ExchangeState::Paused => "paused",
            ExchangeState::Continued { .. } => "continued",
            ExchangeState::LocalResponse { .. } => "answered locally",
            ExchangeState::Reset => "reset",
        }
    }

    /// A header of the continued request, or of the local response.
    pub fn header(&self, name: &str) -> Option<&str> {
        match self {
            ExchangeState::Continued { request_headers } => header(request_headers, name),
            ExchangeState::LocalResponse { headers, .. } => header(headers, name),
            _ => None,
        }
    }

    /// The local response's status, if the filter answered locally.
    /// A property the filter set on a stream it answered locally (the last value set).
    pub fn property(&self, name: &str) -> Option<&str> {
        match self {
            ExchangeState::LocalResponse { properties, .. } => properties
                .iter()
                .rev()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.as_str()),
            _ => None,
        }
    }

    pub fn local_status(&self) -> Option<u32> {
        match self {
            ExchangeState::LocalResponse { status, .. } => Some(*status),
            _ => None,
        }
    }

    pub fn is_continued(&self) -> bool {
        matches!(self, ExchangeState::Continued { .. })
    }
}

/// The response as the filter left it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseView {
    /// `:status` as the filter left it (0 if it removed or garbled it).
    pub status: u32,
    /// All response headers, `:status` included.
    pub headers: Headers,
    /// Empty unless the filter replaced the response with a local reply.
    pub body: Vec<u8>,
    /// The filter paused the response (`on_http_response_headers` returned Pause).
    pub paused: bool,
    /// The filter replaced the upstream response with a local reply.
    pub local: bool,
}

impl ResponseView {
    pub fn header(&self, name: &str) -> Option<&str> {
        header(&self.headers, name)
    }
}
