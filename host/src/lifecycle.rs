//! The sequence of callbacks Envoy drives on one VM: stream open, response, local reply,
//! deferred actions, stream end, ticks, callout answers, queue notifications.

use super::abi::{header, Action, Headers, LogLevel};
use super::calls::{CallResponse, HttpCall};
use super::error::HostError;
use super::http::{ExchangeState, RequestSpec, ResponseView};
use super::profile::HostProfile;
use super::properties::Properties;
use super::stream::{Deferred, LocalReply, Stream};
use super::vm::{Vm, ROOT_CONTEXT_ID};

fn action(raw: Option<u32>) -> Action {
    raw.map(Action::from_raw).unwrap_or(Action::Continue)
}

fn live_stream(vm: &mut Vm, context_id: u32) -> Option<&mut Stream> {
    vm.state_mut()
        .streams
        .get_mut(&context_id)
        .filter(|s| s.live())
}

/// Request headers as Envoy's connection manager passes them to the first filter.
fn request_headers(spec: &RequestSpec, request_id: u64, profile: HostProfile) -> Headers {
    let mut headers: Headers = vec![
        (":authority".to_string(), spec.authority.clone()),
        (":path".to_string(), spec.path.clone()),
        (":method".to_string(), spec.method.clone()),
        (":scheme".to_string(), spec.scheme.clone()),
    ];
    headers.extend(
        spec.headers
            .iter()
            .map(|(k, v)| (k.to_ascii_lowercase(), v.clone())),
    );
    // nginx passes the client's headers as they came: it adds neither.
    if profile.is_nginx() {
        return headers;
    }
    if header(&headers, "x-forwarded-proto").is_none() {
        headers.push(("x-forwarded-proto".to_string(), spec.scheme.clone()));
    }
    if header(&headers, "x-request-id").is_none() {
        let id = format!("00000000-0000-4000-8000-{request_id:012x}");
        headers.push(("x-request-id".to_string(), id));
    }
    headers
}

/// The request's attributes (Envoy's `source.*`, `request.*`, or nginx's mapping of them).
fn request_properties(spec: &RequestSpec, headers: &Headers, profile: HostProfile) -> Properties {
    if profile.is_nginx() {
        return nginx_request_properties(spec, headers);
    }
    let port = spec
        .source_address
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse::<i64>().ok());
    let (url_path, query) = spec.path.split_once('?').unwrap_or((&spec.path, ""));
    let mut properties = Properties::new()
        .with_str("source.address", &spec.source_address)
        .with_str("request.path", &spec.path)
        .with_str("request.url_path", url_path)
        .with_str("request.query", query)
        .with_str("request.host", &spec.authority)
        .with_str("request.method", &spec.method)
        .with_str("request.scheme", &spec.scheme)
        .with_str("request.protocol", "HTTP/1.1")
        .with_str(
            "request.id",
            header(headers, "x-request-id").unwrap_or_default(),
        );
    if let Some(port) = port {
        properties = properties.with_int("source.port", port);
    }
    properties.overlaid(&spec.properties)
}

/// `ngx_wasm_module`'s request properties: nginx variables, every value a string.
/// `source.address` is `$remote_addr` (no port), `request.path` `$request_uri`, `request.host`
/// `$hostname` (the server's name, not the request's), `request.id` the `x-request-id` header
/// if the client sent one.
fn nginx_request_properties(spec: &RequestSpec, headers: &Headers) -> Properties {
    let (address, port) = match spec.source_address.rsplit_once(':') {
        // `[::1]:80` or `1.2.3.4:80`; a bare IPv6 address has colons but no brackets.
        Some((address, port))
            if port.bytes().all(|b| b.is_ascii_digit())
                && (address.starts_with('[') || !address.contains(':')) =>
        {
            (
                address.trim_start_matches('[').trim_end_matches(']'),
                Some(port),
            )
        }
        _ => (spec.source_address.as_str(), None),
    };
    let (url_path, query) = spec.path.split_once('?').unwrap_or((&spec.path, ""));
    let mut properties = Properties::new()
        .with_str("source.address", address)
        .with_str("request.path", &spec.path)
        .with_str("request.url_path", url_path)
        .with_str("request.query", query)
        .with_str("request.host", "sluice-harness")
        .with_str("request.method", &spec.method)
        .with_str("request.scheme", &spec.scheme)
        .with_str("request.protocol", "HTTP/1.1");
    if let Some(port) = port {
        properties = properties.with_str("source.port", port);
    }
    if let Some(id) = header(headers, "x-request-id") {
        properties = properties.with_str("request.id", id);
    }
    properties.overlaid(&spec.properties)
}

/// Opens a stream and runs the request callbacks; returns its context id.
pub(crate) fn open(vm: &mut Vm, spec: &RequestSpec, request_id: u64) -> Result<u32, HostError> {
    let state = vm.state_mut();
    let context_id = state.next_context_id;
    state.next_context_id += 1;
    let profile = state.profile;
    let headers = request_headers(spec, request_id, profile);
    let count = headers.len() as u32;
    let properties = request_properties(spec, &headers, profile);
    state
        .streams
        .insert(context_id, Stream::new(headers, properties));

    vm.call::<(u32, u32), ()>(
        "proxy_on_context_create",
        context_id,
        (context_id, ROOT_CONTEXT_ID),
    )?;
    let end_of_stream = spec.body.is_none() as u32;
    let raw = vm.call(
        "proxy_on_request_headers",
        context_id,
        (context_id, count, end_of_stream),
    )?;
    if action(raw) == Action::Continue {
        if let Some(stream) = live_stream(vm, context_id) {
            stream.request_writable = false;
            stream.state = ExchangeState::Continued {
                request_headers: stream.request_headers.clone(),
            };
        }
    }
    settle(vm)?;
    if let Some(body) = &spec.body {
        if let Some(stream) = live_stream(vm, context_id) {
            stream.request_body = Some(body.clone());
            let size = body.len() as u32;
            vm.call::<(u32, u32, u32), u32>(
                "proxy_on_request_body",
                context_id,
                (context_id, size, 1),
            )?;
            settle(vm)?;
        }
    }
    Ok(context_id)
}

/// The upstream's response headers reach the filter.
pub(crate) fn respond(
    vm: &mut Vm,
    context_id: u32,
    headers: Headers,
) -> Result<ResponseView, HostError> {
    let count = headers.len() as u32;
    if let Some(stream) = live_stream(vm, context_id) {
        stream.response_headers = Some(headers);
        stream.response_active = true;
        stream.responding = true;
    }
    let raw = vm.call(
        "proxy_on_response_headers",
        context_id,
        (context_id, count, 1u32),
    )?;
    let mut paused = action(raw) == Action::Pause;
    if paused && vm.state().profile.is_nginx() {
        // ngx_wasm_module cannot pause a response phase: it expects a local response, warns
        // when none came, and sends the response on.
        paused = false;
        let replied = vm
            .state()
            .deferred
            .iter()
            .any(|d| matches!(d, Deferred::LocalReply { .. }));
        if !replied {
            vm.state_mut().log(
                LogLevel::Warn,
                "\"ResponseHeaders\" returned \"PAUSE\": local response expected but none produced"
                    .to_string(),
            );
        }
    }
    if let Some(stream) = live_stream(vm, context_id) {
        let headers = stream.response_headers.clone().unwrap_or_default();
        stream.response = Some(view(headers, Vec::new(), paused, false));
        stream.response_active = paused;
    }
    settle(vm)?;
    if !paused {
        finish(vm, context_id)?;
    }
    let stream = vm.state().streams.get(&context_id);
    Ok(stream
        .and_then(|s| s.response.clone())
        .unwrap_or_else(|| view(Vec::new(), Vec::new(), paused, false)))
}

fn view(headers: Headers, body: Vec<u8>, paused: bool, local: bool) -> ResponseView {
    let status = header(&headers, ":status")
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    ResponseView {
        status,
        headers,
        body,
        paused,
        local,
    }
}

/// Envoy's local reply headers: `:status`, the filter's headers, then `content-length` and
/// (unless the filter set one) `content-type: text/plain` for a non-empty body.
fn local_reply_headers(reply: &LocalReply) -> Headers {
    let mut headers = vec![(":status".to_string(), reply.status.to_string())];
    headers.extend(reply.headers.iter().cloned());
    if !reply.body.is_empty() {
        headers.push(("content-length".to_string(), reply.body.len().to_string()));
        if header(&headers, "content-type").is_none() {
            headers.push(("content-type".to_string(), "text/plain".to_string()));
        }
    }
    headers
}

/// Runs the actions the filter asked for during VM calls (Envoy's after-VM-call actions) until
/// none are left.
pub(crate) fn settle(vm: &mut Vm) -> Result<(), HostError> {
    loop {
        let actions = std::mem::take(&mut vm.state_mut().deferred);
        if actions.is_empty() {
            return Ok(());
        }
        for deferred in actions {
            match deferred {
                Deferred::Continue {
                    context_id,
                    response: false,
                } => {
                    if let Some(stream) = live_stream(vm, context_id) {
                        if stream.state == ExchangeState::Paused {
                            let request_headers = stream.request_headers.clone();
                            stream.state = ExchangeState::Continued { request_headers };
                        }
                    }
                }
                Deferred::Continue {
                    context_id,
                    response: true,
                } => {
                    let resumed = match live_stream(vm, context_id) {
                        Some(stream) if stream.responding && stream.response_active => {
                            stream.response_active = false;
                            let headers = stream.response_headers.clone().unwrap_or_default();
                            stream.response = Some(view(headers, Vec::new(), false, false));
                            true
                        }
                        _ => false,
                    };
                    if resumed {
                        finish(vm, context_id)?;
                    }
                }
                Deferred::LocalReply { context_id, reply } => local_reply(vm, context_id, reply)?,
                Deferred::Reset { context_id } => {
                    if let Some(stream) = live_stream(vm, context_id) {
                        stream.state = ExchangeState::Reset;
                        finish(vm, context_id)?;
                    }
                }
            }
        }
    }
}

/// Sends a local reply: through the filter's own `on_http_response_headers` when it replaces
/// the request (Envoy encodes local replies through the filter chain), directly when it
/// replaces an upstream response the filter is already processing.
fn local_reply(vm: &mut Vm, context_id: u32, reply: LocalReply) -> Result<(), HostError> {
    let headers = local_reply_headers(&reply);
    let Some(stream) = live_stream(vm, context_id) else {
        return Ok(());
    };
    if stream.responding {
        stream.response_active = false;
        stream.response = Some(view(headers, reply.body, false, true));
        return finish(vm, context_id);
    }
    let count = headers.len() as u32;
    stream.request_writable = false;
    stream.response_headers = Some(headers);
    stream.response_active = true;
    let end_of_stream = reply.body.is_empty() as u32;
    vm.call::<(u32, u32, u32), u32>(
        "proxy_on_response_headers",
        context_id,
        (context_id, count, end_of_stream),
    )?;
    if let Some(stream) = live_stream(vm, context_id) {
        stream.response_active = false;
        let headers = stream.response_headers.clone().unwrap_or_default();
        let local = view(headers, reply.body, false, true);
        stream.state = ExchangeState::LocalResponse {
            status: local.status,
            headers: local.headers.clone(),
            body: local.body.clone(),
            details: reply.details,
            properties: stream.set_properties.clone(),
        };
        stream.response = Some(local);
    }
    finish(vm, context_id)
}

/// Ends a stream: cancels its callouts, then `on_done`, `on_log` (access-log phase: both
/// header maps readable) and `on_delete`.
pub(crate) fn finish(vm: &mut Vm, context_id: u32) -> Result<(), HostError> {
    if live_stream(vm, context_id).is_none() {
        return Ok(());
    }
    let worker = vm.worker;
    vm.state()
        .process()
        .calls
        .retain(|_, c| !(c.worker == worker && c.context_id == context_id));
    vm.call::<u32, u32>("proxy_on_done", context_id, context_id)?;
    if let Some(stream) = live_stream(vm, context_id) {
        stream.access_log = true;
        stream.request_writable = false;
        stream.response_active = false;
    }
    vm.call::<u32, ()>("proxy_on_log", context_id, context_id)?;
    vm.call::<u32, ()>("proxy_on_delete", context_id, context_id)?;
    if let Some(stream) = vm.state_mut().streams.get_mut(&context_id) {
        stream.finished = true;
        stream.access_log = false;
        stream.request_body = None;
        stream.properties = Properties::new();
    }
    Ok(())
}

/// Delivers a callout's outcome to the context that made it.
pub(crate) fn deliver_call(
    vm: &mut Vm,
    call: &HttpCall,
    response: CallResponse,
) -> Result<(), HostError> {
    let context_id = call.context_id;
    let alive = context_id == ROOT_CONTEXT_ID || live_stream(vm, context_id).is_some();
    if !alive {
        return Ok(());
    }
    let sizes = match &response.message {
        // nginx reports a failure with zero sizes, whatever the map holds.
        _ if response.dispatch_status.is_some() => (0, 0, 0),
        Some(m) => (
            m.headers.len() as u32,
            m.body.len() as u32,
            m.trailers.len() as u32,
        ),
        None => (0, 0, 0),
    };
    vm.state_mut().call_response = Some(response);
    let result = vm.call::<(u32, u32, u32, u32, u32), ()>(
        "proxy_on_http_call_response",
        context_id,
        (context_id, call.token, sizes.0, sizes.1, sizes.2),
    );
    vm.state_mut().call_response = None;
    result?;
    settle(vm)
}

/// Fires the root context's tick and re-arms the timer from now, like Envoy.
pub(crate) fn tick(vm: &mut Vm) -> Result<(), HostError> {
    vm.call::<u32, ()>("proxy_on_tick", ROOT_CONTEXT_ID, ROOT_CONTEXT_ID)?;
    let state = vm.state_mut();
    let now = state.clock.monotonic_nanos();
    if let Some(tick) = state.tick.as_mut() {
        tick.next_due = now + tick.period;
    }
    settle(vm)
}

pub(crate) fn queue_ready(vm: &mut Vm, context_id: u32, token: u32) -> Result<(), HostError> {
    vm.call::<(u32, u32), ()>("proxy_on_queue_ready", context_id, (context_id, token))?;
    settle(vm)
}
