//! The host, seen through core's narrow interfaces: shared data as a [`Store`], request
//! headers as a [`RequestView`], the clock as microseconds.

use proxy_wasm::hostcalls;
use proxy_wasm::types::{MapType, Status};
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

pub fn request_header(name: &str) -> Option<String> {
    hostcalls::get_map_value(MapType::HttpRequestHeaders, name)
        .ok()
        .flatten()
}

pub fn property(path: Vec<&str>) -> Option<String> {
    hostcalls::get_property(path)
        .ok()
        .flatten()
        .and_then(|bytes| String::from_utf8(bytes).ok())
}

/// The request being decided, read lazily: a header costs a host call only if a rule asks.
pub struct HostRequest {
    pub method: String,
    pub path: String,
    pub client_ip: Option<String>,
}

impl RequestView for HostRequest {
    fn method(&self) -> &str {
        &self.method
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
