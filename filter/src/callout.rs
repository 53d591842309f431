//! The one way the filter calls the counter service: a JSON `POST` with the token, and its
//! answer read back safely.

use std::time::Duration;

use proxy_wasm::hostcalls;
use proxy_wasm::types::Status;
use serde::de::DeserializeOwned;
use serde::Serialize;
use sluice_core::policy::Service;

use crate::host;

pub use sluice_core::sync::round::Failure;

/// Posts `body` as JSON to `path` on the service (its Envoy cluster, or its address in nginx);
/// the callout's token.
pub fn post(service: &Service, path: &str, body: &impl Serialize) -> Result<u32, Failure> {
    let body = serde_json::to_vec(body).map_err(|_| Failure::NotSent)?;
    let auth = format!("Bearer {}", service.token);
    let mut headers = vec![
        (":method", "POST"),
        (":path", path),
        (":authority", service.authority.as_str()),
        ("content-type", "application/json"),
        ("authorization", auth.as_str()),
    ];
    // nginx: ngx_wasm_module dispatches over TLS when asked so (`service.tls`, refused in Envoy, where TLS is the
    // cluster's), checking the certificate against the authority, also its SNI.
    if service.tls {
        headers.push((":scheme", "https"));
    }
    let timeout = Duration::from_millis(service.timeout_ms);
    hostcalls::dispatch_http_call(
        service.upstream.target(),
        headers,
        Some(&body),
        vec![],
        timeout,
    )
    .map_err(|_: Status| Failure::NotSent)
}

/// The answer of a callout (in `on_http_call_response`): the decoded 200 body, or why not.
pub fn answer<T: DeserializeOwned>(num_headers: usize, body_size: usize) -> Result<T, Failure> {
    answer_within(num_headers, body_size, usize::MAX)
}

/// [`answer`], a 200 body longer than `max_bytes` refused unread ([`Failure::Malformed`]).
pub fn answer_within<T: DeserializeOwned>(
    num_headers: usize,
    body_size: usize,
    max_bytes: usize,
) -> Result<T, Failure> {
    let status = host::call_status(num_headers);
    if status.as_deref() != Some("200") {
        return Err(Failure::of(status.as_deref()));
    }
    if body_size > max_bytes {
        return Err(Failure::Malformed);
    }
    host::call_body(body_size)
        .and_then(|body| serde_json::from_slice(&body).ok())
        .ok_or(Failure::Malformed)
}
