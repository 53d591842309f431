//! The host, seen through core's narrow interfaces: shared data as a [`Store`], request
//! headers as a [`RequestView`], the clock as microseconds.

use std::cell::OnceCell;

use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType, Status};
use sluice_core::request::claims::Payload;
use sluice_core::{limiter::key, RequestView, Store, StoreError};

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
        // the root context creates every set before the first request (see `shared::prepare`).
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
    // The ABI's nanoseconds divided, rather than the SDK's `SystemTime` turned back into a
    // `Duration` and 128-bit microseconds: the same number, read on every request.
    #[link(wasm_import_module = "env")]
    extern "C" {
        fn proxy_get_current_time_nanoseconds(return_time: *mut u64) -> Status;
    }
    let mut nanos: u64 = 0;
    // SAFETY: the host writes one u64 to a live local, during the call only.
    match unsafe { proxy_get_current_time_nanoseconds(&mut nanos) } {
        Status::Ok => nanos / 1_000,
        _ => 0,
    }
}

/// A uniform draw in [0, 1): the time the caller read and a per-VM counter, hashed.
pub fn draw(now_us: u64) -> f64 {
    thread_local! {
        static COUNT: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    }
    let n = COUNT.with(|c| {
        c.set(c.get().wrapping_add(1));
        c.get()
    });
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&now_us.to_le_bytes());
    bytes[8..].copy_from_slice(&n.to_le_bytes());
    let h = sluice_core::limit::table::fnv1a(&bytes);
    // fnv1a mixes the high bits poorly: fold them in.
    let h = h ^ (h >> 29) ^ (h >> 47);
    (h % 1_000_003) as f64 / 1_000_003.0
}

/// A number in [0.5, 1.5) that spreads the breaker's cool-down over the proxies, from the time.
pub fn jitter(now_us: u64) -> f64 {
    0.5 + (sluice_core::limit::table::fnv1a(&now_us.to_le_bytes()) % 1_000) as f64 / 1_000.0
}

/// A request header. Read as bytes: the SDK's string getter panics on a value that is not
/// UTF-8, and HTTP allows such values.
pub fn request_header(name: &str) -> Option<String> {
    hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name)
        .ok()
        .flatten()
        .map(text)
}

/// Bytes as text: taken over when UTF-8 (the common case, no copy), else made lossy.
fn text(bytes: Vec<u8>) -> String {
    String::from_utf8(bytes)
        .unwrap_or_else(|invalid| String::from_utf8_lossy(invalid.as_bytes()).into_owned())
}

/// A response header of the request's own response.
pub fn response_header(name: &str) -> Option<String> {
    hostcalls::get_map_value_bytes(MapType::HttpResponseHeaders, name)
        .ok()
        .flatten()
        .map(text)
}

/// A response trailer (`grpc-status`), if the response has it.
pub fn response_trailer(name: &str) -> Option<String> {
    hostcalls::get_map_value_bytes(MapType::HttpResponseTrailers, name)
        .ok()
        .flatten()
        .map(text)
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

/// An informational line in Envoy's log.
pub fn log_info(message: &str) {
    let _ = hostcalls::log(proxy_wasm::types::LogLevel::Info, message);
}

/// A warning in Envoy's log.
pub fn log_warn(message: &str) {
    let _ = hostcalls::log(proxy_wasm::types::LogLevel::Warn, message);
}

/// The peer's address (`source.address`), read with a path serialized once, not per request.
pub fn source_address() -> Option<String> {
    // The SDK's getter takes the path as a vector and serializes it: two allocations.
    String::from_utf8(property_bytes(b"source\0address")?).ok()
}

/// A property by its path, already serialized (segments joined by NUL), as the host's bytes.
fn property_bytes(path: &[u8]) -> Option<Vec<u8>> {
    #[link(wasm_import_module = "env")]
    extern "C" {
        fn proxy_get_property(
            path_data: *const u8,
            path_size: usize,
            return_value_data: *mut *mut u8,
            return_value_size: *mut usize,
        ) -> Status;
    }
    // SAFETY: `proxy_get_property` writes a buffer the host allocated, or nothing.
    unsafe {
        take_host_buffer(|data, size| proxy_get_property(path.as_ptr(), path.len(), data, size))
    }
}

/// A local reply (a 429, a 503), its headers handed over as the reply holds them, already
/// serialized as the host reads them (the SDK's sender collects them into a vector first,
/// then serializes). First, what the access log may print of it: each of core's facts set as a
/// property (Envoy: filter state `wasm.sluice.*`; nginx answers `NotFound` for a name outside
/// its namespaces, which changes nothing).
pub fn respond(reply: &sluice_core::Reply, policy: &sluice_core::Policy) {
    reply.facts.each(policy, &mut |name, value| {
        set_property(name.as_bytes(), value)
    });
    #[link(wasm_import_module = "env")]
    extern "C" {
        fn proxy_send_local_response(
            status_code: u32,
            status_code_details_data: *const u8,
            status_code_details_size: usize,
            body_data: *const u8,
            body_size: usize,
            headers_data: *const u8,
            headers_size: usize,
            grpc_status: i32,
        ) -> Status;
    }
    let headers = reply.headers.serialized();
    let body = reply.body.as_bytes();
    let details = reply.details.as_bytes();
    // SAFETY: every pointer is to a live buffer of the given size, read during the call only.
    let _ = unsafe {
        proxy_send_local_response(
            reply.status,
            details.as_ptr(),
            details.len(),
            body.as_ptr(),
            body.len(),
            headers.as_ptr(),
            headers.len(),
            // A gRPC request's status (Envoy answers trailers-only); -1: none.
            reply
                .grpc_status
                .map_or(-1, |s| s.min(i32::MAX as u32) as i32),
        )
    };
}

/// Sets a property of the request, by its path (one segment here), ignoring the host's answer.
fn set_property(path: &[u8], value: &[u8]) {
    #[link(wasm_import_module = "env")]
    extern "C" {
        fn proxy_set_property(
            path_data: *const u8,
            path_size: usize,
            value_data: *const u8,
            value_size: usize,
        ) -> Status;
    }
    // SAFETY: both pointers are to live buffers of the given sizes, read during the call only.
    let _ = unsafe { proxy_set_property(path.as_ptr(), path.len(), value.as_ptr(), value.len()) };
}

/// The request's dynamic metadata (the property `metadata`), as Envoy serializes it: the
/// `envoy.config.core.v3.Metadata` message, every filter's entry with its values' JSON types
/// (a claim read by its own path comes as bare bytes: see `sluice_core::request::claims`).
pub fn dynamic_metadata() -> Option<Vec<u8>> {
    property_bytes(b"metadata")
}

/// Every request header as (name, value) pairs, in order.
///
/// Read through the ABI directly: the SDK's map getters panic on a name that is not UTF-8, and
/// Envoy's single-value getter returns only the first of a repeated header.
pub fn request_headers() -> Vec<(Vec<u8>, Vec<u8>)> {
    #[link(wasm_import_module = "env")]
    extern "C" {
        fn proxy_get_header_map_pairs(
            map_type: MapType,
            return_map_data: *mut *mut u8,
            return_map_size: *mut usize,
        ) -> Status;
    }
    // SAFETY: `proxy_get_header_map_pairs` writes a buffer the host allocated, or nothing.
    let bytes = unsafe {
        take_host_buffer(|data, size| {
            proxy_get_header_map_pairs(MapType::HttpRequestHeaders, data, size)
        })
    };
    bytes
        .and_then(|bytes| decode_pairs(&bytes))
        .unwrap_or_default()
}

/// Makes an ABI call that answers with a buffer, and takes the buffer over: no copy.
///
/// # Safety
///
/// `call` must be a proxy-wasm ABI call that, when it answers `Ok` with a pointer that is not
/// null, has written a buffer of `size` bytes that the host allocated through this module's
/// allocator (the SDK's `proxy_on_memory_allocate`, a `Vec<u8>` of exactly `size` bytes) and
/// hands over to the caller.
unsafe fn take_host_buffer(
    call: impl FnOnce(*mut *mut u8, *mut usize) -> Status,
) -> Option<Vec<u8>> {
    let mut data: *mut u8 = std::ptr::null_mut();
    let mut size: usize = 0;
    match call(&mut data, &mut size) {
        // SAFETY: by the caller's promise, `data` is an allocation of `size` bytes, now ours.
        Status::Ok if !data.is_null() => Some(unsafe { Vec::from_raw_parts(data, size, size) }),
        _ => None,
    }
}

/// The request being decided, read lazily: the method and headers cost a host call only if a
/// rule asks.
pub struct HostRequest<'a> {
    pub method: OnceCell<String>,
    /// The path as sent, without its query string.
    pub path: String,
    pub normal: OnceCell<String>,
    pub client_ip: Option<String>,
    pub headers: OnceCell<Vec<(Vec<u8>, Vec<u8>)>>,
    /// The query string as sent (after `?`), if any.
    pub query: Option<String>,
    pub host: OnceCell<Option<String>>,
    /// Where `jwt_authn` writes the verified payload (`payload_in_metadata`).
    pub jwt_payload: &'a str,
    /// The verified payload, read and decoded once, when a rule first asks for a claim.
    pub claims: OnceCell<Option<Payload>>,
}

impl RequestView for HostRequest<'_> {
    fn method(&self) -> &str {
        self.method
            .get_or_init(|| request_header(":method").unwrap_or_default())
    }

    fn path(&self) -> &str {
        &self.path
    }

    fn normal_path(&self) -> &str {
        self.normal
            .get_or_init(|| sluice_core::request::path::normalize(&self.path).into_owned())
    }

    fn client_ip(&mut self) -> Option<&str> {
        self.client_ip.as_deref()
    }

    fn header(&mut self, name: &str) -> Vec<String> {
        self.headers
            .get_or_init(request_headers)
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name.as_bytes()))
            .map(|(_, value)| key::header_value(value))
            .collect()
    }

    fn first_header(&mut self, name: &str) -> Option<String> {
        // One value through the host: reading every header's would cost a denial (which reads
        // `content-type` for the answer's shape) a copy of them all.
        match self.headers.get() {
            Some(_) => self.header(name).into_iter().next(),
            None => hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name)
                .ok()
                .flatten()
                .map(|value| key::header_value(&value)),
        }
    }

    fn host(&mut self) -> Option<&str> {
        self.host
            .get_or_init(|| request_header(":authority"))
            .as_deref()
    }

    fn query_string(&self) -> Option<&str> {
        self.query.as_deref()
    }

    fn claim(&mut self, name: &str) -> Option<String> {
        // Only what jwt_authn wrote after verifying the token's signature: dynamic metadata,
        // which no client can set. Read whole, once: a claim of any JSON type keys by its text.
        let jwt_payload = self.jwt_payload;
        self.claims
            .get_or_init(|| {
                dynamic_metadata().and_then(|bytes| Payload::from_metadata(&bytes, jwt_payload))
            })
            .as_ref()?
            .claim(name)
    }
}

/// Decodes proxy-wasm's serialized header map: a count, then each pair's name and value sizes,
/// then the names and values, each followed by a NUL. `None` if it does not add up.
fn decode_pairs(bytes: &[u8]) -> Option<Vec<(Vec<u8>, Vec<u8>)>> {
    let u32_at = |at: usize| -> Option<usize> {
        let b: [u8; 4] = bytes.get(at..at.checked_add(4)?)?.try_into().ok()?;
        Some(u32::from_le_bytes(b) as usize)
    };
    if bytes.is_empty() {
        return Some(Vec::new());
    }
    let count = u32_at(0)?;
    let mut data = count.checked_mul(8)?.checked_add(4)?;
    let mut pairs = Vec::with_capacity(count.min(256));
    for n in 0..count {
        let name_len = u32_at(4 + n * 8)?;
        let value_len = u32_at(8 + n * 8)?;
        let name = bytes.get(data..data.checked_add(name_len)?)?.to_vec();
        data += name_len + 1;
        let value = bytes.get(data..data.checked_add(value_len)?)?.to_vec();
        data += value_len + 1;
        pairs.push((name, value));
    }
    Some(pairs)
}

#[cfg(test)]
mod tests {
    use super::decode_pairs;
    use sluice_core::reply::headers::ReplyHeaders;

    fn encode(pairs: &[(&[u8], &[u8])]) -> Vec<u8> {
        let mut out = (pairs.len() as u32).to_le_bytes().to_vec();
        for (name, value) in pairs {
            out.extend_from_slice(&(name.len() as u32).to_le_bytes());
            out.extend_from_slice(&(value.len() as u32).to_le_bytes());
        }
        for (name, value) in pairs {
            out.extend_from_slice(name);
            out.push(0);
            out.extend_from_slice(value);
            out.push(0);
        }
        out
    }

    #[test]
    fn pairs_round_trip_and_garbage_is_refused() {
        let pairs: &[(&[u8], &[u8])] = &[(b"x-a", b"1"), (b"x-a", b"\xff"), (b"\xfe", b"")];
        let bytes = encode(pairs);
        let decoded = decode_pairs(&bytes).unwrap_or_default();
        assert_eq!(decoded.len(), 3);
        assert_eq!(decoded[1], (b"x-a".to_vec(), b"\xff".to_vec()));
        for cut in 1..bytes.len() {
            let _ = decode_pairs(&bytes[..cut]);
        }
        assert_eq!(decode_pairs(&[0xff, 0xff, 0xff, 0xff]), None);
    }

    #[test]
    fn a_reply_is_serialized_as_the_sdk_would() {
        let mut headers = ReplyHeaders::default();
        assert_eq!(headers.serialized(), encode(&[]));
        let pairs: &[(&'static str, &str)] = &[
            ("retry-after", "1"),
            ("x-a", ""),
            ("content-type", "text/plain"),
        ];
        for (name, value) in pairs {
            headers.push(name, value);
        }
        let expected: Vec<(&[u8], &[u8])> = pairs
            .iter()
            .map(|(n, v)| (n.as_bytes(), v.as_bytes()))
            .collect();
        let encoded = headers.serialized();
        assert_eq!(encoded, encode(&expected));
        let decoded = decode_pairs(encoded).unwrap_or_default();
        assert_eq!(decoded.len(), 3);
        assert_eq!(
            decoded[2],
            (b"content-type".to_vec(), b"text/plain".to_vec())
        );
    }
}
