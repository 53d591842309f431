//! One HTTP stream's host-side state: its header maps, phase and what the filter asked for.

use super::abi::Headers;
use super::http::{ExchangeState, ResponseView};
use super::properties::Properties;

/// A local reply the filter asked for (`proxy_send_local_response`).
#[derive(Debug, Clone)]
pub(crate) struct LocalReply {
    pub status: u32,
    pub headers: Headers,
    pub body: Vec<u8>,
    /// The response code details (Envoy's `%RESPONSE_CODE_DETAILS%`).
    pub details: String,
}

/// What a filter asked for during a VM call; like Envoy, the host acts on it once the VM call
/// has returned ("after VM call actions").
#[derive(Debug, Clone)]
pub(crate) enum Deferred {
    Continue { context_id: u32, response: bool },
    LocalReply { context_id: u32, reply: LocalReply },
    Reset { context_id: u32 },
}

/// The host's view of one HTTP stream.
#[derive(Debug, Clone)]
pub(crate) struct Stream {
    pub request_headers: Headers,
    /// Envoy keeps the request header map writable until `on_request_headers` returns Continue.
    pub request_writable: bool,
    pub request_body: Option<Vec<u8>>,
    pub response_headers: Option<Headers>,
    /// The response map is readable and writable while `on_response_headers` runs or has paused.
    pub response_active: bool,
    /// `on_log` is running: both header maps are readable, none writable.
    pub access_log: bool,
    pub properties: Properties,
    /// The properties the filter set and the host kept, by dotted name, in order.
    pub set_properties: Vec<(String, String)>,
    pub state: ExchangeState,
    /// The upstream response reached the filter (`respond` was called).
    pub responding: bool,
    pub response: Option<ResponseView>,
    pub finished: bool,
}

impl Stream {
    pub(crate) fn new(request_headers: Headers, properties: Properties) -> Stream {
        Stream {
            request_headers,
            request_writable: true,
            request_body: None,
            response_headers: None,
            response_active: false,
            access_log: false,
            properties,
            set_properties: Vec::new(),
            state: ExchangeState::Paused,
            responding: false,
            response: None,
            finished: false,
        }
    }

    pub(crate) fn live(&self) -> bool {
        !self.finished
    }
}
