//! The host, seen through core's narrow interfaces: shared data as a [`Store`], request
//! headers as a [`RequestView`], the clock as microseconds.

use std::cell::OnceCell;

use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType, Status};
use sluice_core::{RequestView, Store, StoreError};

/// proxy-wasm shared data: one map per VM id, shared by every worker of the proxy.
pub struct SharedData;

impl Store for SharedData {
    fn get(&mut self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
        match hostcalls::get_shared_data(key) {
            Ok((value, Some(cas))) => Ok(Some((value.unwrap_or_default(), cas))),
            Ok((_, None)) => Ok(None),
            Err(_) => Err(StoreError::Unavailable),
        }
    }

    fn set(&mut self, key: &str, value: &[u8], version: u32) -> Result<bool, StoreError> {
        // Version 0 asks to create; proxy-wasm treats cas 0 as "unconditional", which is why
        // the root context creates every set before the first request (see `Root::prepare`).
        let cas = (version != 0).then_some(version);
        match hostcalls::set_shared_data(key, Some(value), cas) {
            Ok(()) => Ok(true),
            Err(Status::CasMismatch) => Ok(false),
            Err(_) => Err(StoreError::Unavailable),
        }
    }
}

/// Microseconds since the Unix epoch, by the host's clock (0 if the host will not say).
pub fn now_us() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_micros() as u64)
}

/// A request header. Read as bytes: the SDK's string getter panics on a value that is not
/// UTF-8, and HTTP allows such values.
pub fn request_header(name: &str) -> Option<String> {
    hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name)
        .ok()
        .flatten()
        .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
}

/// The `:status` of a callout's answer, or `None` when the call failed without one.
///
/// With no headers (a reset), the host has no response map and answers `BadArgument`, which
/// the SDK's getter turns into a panic: so headers are read only when there are some.
pub fn call_status(num_headers: usize) -> Option<String> {
    if num_headers == 0 {
        return None;
    }
    hostcalls::get_map_value_bytes(MapType::HttpCallResponseHeaders, ":status")
        .ok()
        .flatten()
        .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
}

/// The body of a callout's answer.
pub fn call_body(body_size: usize) -> Option<Vec<u8>> {
    if body_size == 0 {
        return None;
    }
    hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
        .ok()
        .flatten()
}

pub fn property(path: Vec<&str>) -> Option<String> {
    hostcalls::get_property(path)
        .ok()
        .flatten()
        .and_then(|bytes| String::from_utf8(bytes).ok())
}

/// The request being decided, read lazily: the method and headers cost a host call only if a
/// rule asks.
pub struct HostRequest {
    pub method: OnceCell<String>,
    pub path: String,
    pub client_ip: Option<String>,
}

impl RequestView for HostRequest {
    fn method(&self) -> &str {
        self.method
            .get_or_init(|| request_header(":method").unwrap_or_default())
    }

    fn path(&self) -> &str {
        &self.path
    }

    fn client_ip(&mut self) -> Option<&str> {
        self.client_ip.as_deref()
    }

    fn header(&mut self, name: &str) -> Option<String> {
        request_header(name)
    }
}
