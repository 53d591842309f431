//! The `env` imports of proxy-wasm ABI 0.2.1: every function the Rust SDK 0.2.x declares.
//!
//! Each host call counts itself (see [`Proxy::host_calls`](super::Proxy::host_calls)), checks
//! every guest pointer (a bad one yields `InvalidMemoryAccess`, never a host panic) and
//! answers with the status Envoy would, or under the `NgxWasmModule` profile what
//! `ngx_wasm_module` does (see [`HostProfile`](super::HostProfile)).

use wasmtime::{Caller, Engine, Linker, Module, Store, Val};

use super::abi::{
    buffer_type, deserialize_pairs, map_type, stream_type, Headers, LogLevel, Status,
};
use super::calls::HttpCall;
use super::clock::duration_nanos;
use super::memory::{
    read, read_string, return_bytes, status_of, write_u32, write_u64, Fail, HostResult,
};
use super::metrics::{MetricKind, MetricValue};
use super::properties::parse_path;
use super::stream::{Deferred, LocalReply};
use super::vm::{Tick, VmState, ROOT_CONTEXT_ID};
use super::wasi;

type C<'a> = Caller<'a, VmState>;

macro_rules! env {
    ($linker:ident, $name:ident ( $($arg:ident : $ty:ty),* )) => {
        $linker.func_wrap(
            "env",
            stringify!($name),
            |mut caller: Caller<'_, VmState>, $($arg: $ty),*| -> wasmtime::Result<u32> {
                caller.data_mut().count(stringify!($name));
                status_of($name(&mut caller, $($arg),*))
            },
        )?;
    };
}

/// A linker with every proxy-wasm and WASI import the harness provides.
pub(crate) fn linker(engine: &Engine) -> wasmtime::Result<Linker<VmState>> {
    let mut linker = Linker::new(engine);
    env!(linker, proxy_log(level: u32, ptr: u32, len: u32));
    env!(linker, proxy_get_log_level(ret: u32));
    env!(linker, proxy_get_current_time_nanoseconds(ret: u32));
    env!(linker, proxy_set_tick_period_milliseconds(period: u32));
    env!(linker, proxy_get_buffer_bytes(kind: u32, start: u32, max: u32, ret_ptr: u32, ret_size: u32));
    env!(linker, proxy_set_buffer_bytes(kind: u32, start: u32, size: u32, ptr: u32, len: u32));
    env!(linker, proxy_get_header_map_pairs(kind: u32, ret_ptr: u32, ret_size: u32));
    env!(linker, proxy_set_header_map_pairs(kind: u32, ptr: u32, len: u32));
    env!(linker, proxy_get_header_map_value(kind: u32, kptr: u32, klen: u32, ret_ptr: u32, ret_size: u32));
    env!(linker, proxy_remove_header_map_value(kind: u32, kptr: u32, klen: u32));
    env!(linker, proxy_replace_header_map_value(kind: u32, kptr: u32, klen: u32, vptr: u32, vlen: u32));
    env!(linker, proxy_add_header_map_value(kind: u32, kptr: u32, klen: u32, vptr: u32, vlen: u32));
    env!(linker, proxy_get_property(pptr: u32, plen: u32, ret_ptr: u32, ret_size: u32));
    env!(linker, proxy_set_property(pptr: u32, plen: u32, vptr: u32, vlen: u32));
    env!(linker, proxy_get_shared_data(kptr: u32, klen: u32, ret_ptr: u32, ret_size: u32, ret_cas: u32));
    env!(linker, proxy_set_shared_data(kptr: u32, klen: u32, vptr: u32, vlen: u32, cas: u32));
    env!(linker, proxy_register_shared_queue(nptr: u32, nlen: u32, ret_id: u32));
    env!(linker, proxy_resolve_shared_queue(vptr: u32, vlen: u32, nptr: u32, nlen: u32, ret_id: u32));
    env!(linker, proxy_dequeue_shared_queue(id: u32, ret_ptr: u32, ret_size: u32));
    env!(linker, proxy_enqueue_shared_queue(id: u32, ptr: u32, len: u32));
    env!(linker, proxy_continue_stream(kind: u32));
    env!(linker, proxy_close_stream(kind: u32));
    env!(linker, proxy_send_local_response(
        status: u32, dptr: u32, dlen: u32, bptr: u32, blen: u32, hptr: u32, hlen: u32, grpc: i32
    ));
    env!(linker, proxy_http_call(
        uptr: u32, ulen: u32, hptr: u32, hlen: u32, bptr: u32, blen: u32, tptr: u32, tlen: u32,
        timeout: u32, ret_token: u32
    ));
    env!(linker, proxy_grpc_call(
        uptr: u32, ulen: u32, sptr: u32, slen: u32, mptr: u32, mlen: u32, iptr: u32, ilen: u32,
        bptr: u32, blen: u32, timeout: u32, ret_token: u32
    ));
    env!(linker, proxy_grpc_stream(
        uptr: u32, ulen: u32, sptr: u32, slen: u32, mptr: u32, mlen: u32, iptr: u32, ilen: u32,
        ret_token: u32
    ));
    env!(linker, proxy_grpc_send(token: u32, ptr: u32, len: u32, end: u32));
    env!(linker, proxy_grpc_cancel(token: u32));
    env!(linker, proxy_grpc_close(token: u32));
    env!(linker, proxy_get_status(ret_code: u32, ret_ptr: u32, ret_size: u32));
    env!(linker, proxy_set_effective_context(context_id: u32));
    env!(linker, proxy_call_foreign_function(
        nptr: u32, nlen: u32, aptr: u32, alen: u32, ret_ptr: u32, ret_size: u32
    ));
    env!(linker, proxy_done());
    env!(linker, proxy_define_metric(kind: u32, nptr: u32, nlen: u32, ret_id: u32));
    env!(linker, proxy_get_metric(id: u32, ret: u32));
    env!(linker, proxy_record_metric(id: u32, value: u64));
    env!(linker, proxy_increment_metric(id: u32, offset: i64));
    wasi::add_to_linker(&mut linker)?;
    Ok(linker)
}

/// Defines, for every function import the linker lacks, a stub that counts itself and answers
/// `Unimplemented` (env) or `ENOSYS` (WASI). An import with another shape is an error naming
/// it, as Envoy refuses a module with a missing import.
pub(crate) fn stub_missing(
    linker: &mut Linker<VmState>,
    module: &Module,
    store: &mut Store<VmState>,
) -> Result<(), String> {
    let mut missing = Vec::new();
    for import in module.imports() {
        let (module_name, name) = (import.module(), import.name());
        if linker.get_by_import(&mut *store, &import).is_some() {
            continue;
        }
        let Some(ty) = import.ty().func().cloned() else {
            missing.push(format!("{module_name}.{name}"));
            continue;
        };
        let returns_status =
            ty.results().len() == 1 && ty.results().all(|r| matches!(r, wasmtime::ValType::I32));
        if !returns_status {
            missing.push(format!("{module_name}.{name}"));
            continue;
        }
        let code = if module_name == "env" {
            Status::Unimplemented as i32
        } else {
            wasi::ENOSYS as i32
        };
        let label: &'static str = Box::leak(format!("{module_name}.{name}").into_boxed_str());
        linker
            .func_new(
                module_name,
                name,
                ty,
                move |mut caller: C<'_>, _params, results| {
                    caller.data_mut().count(label);
                    results[0] = Val::I32(code);
                    Ok(())
                },
            )
            .map_err(|e| e.to_string())?;
    }
    if missing.is_empty() {
        Ok(())
    } else {
        Err(format!("missing imports: {}", missing.join(", ")))
    }
}

/// A trap with nginx's message.
fn trap(message: impl Into<String>) -> Fail {
    Fail::Trap(wasmtime::Error::msg(message.into()))
}

/// `ngx_wasm_module` links every ABI 0.2.1 import, but the ones it does not implement trap the
/// calling VM (`host trap (function not yet implemented): NAME`).
fn nginx_lacks(c: &C<'_>, name: &str) -> HostResult {
    match c.data().profile.is_nginx() {
        true => Err(trap(format!(
            "host trap (function not yet implemented): {name}"
        ))),
        false => Ok(()),
    }
}

fn proxy_log(c: &mut C<'_>, level: u32, ptr: u32, len: u32) -> HostResult {
    let message = read_string(c, ptr, len)?;
    c.data_mut().log(LogLevel::from_raw(level), message);
    Ok(())
}

fn proxy_get_log_level(c: &mut C<'_>, ret: u32) -> HostResult {
    nginx_lacks(c, "proxy_get_log_level")?;
    let level = c.data().log_level as u32;
    Ok(write_u32(c, ret, level)?)
}

fn proxy_get_current_time_nanoseconds(c: &mut C<'_>, ret: u32) -> HostResult {
    let now = c.data().clock.now_nanos();
    Ok(write_u64(c, ret, now)?)
}

fn proxy_set_tick_period_milliseconds(c: &mut C<'_>, period: u32) -> HostResult {
    let state = c.data_mut();
    if state.profile.is_nginx() {
        // nginx arms one timer per root context, once.
        if state.effective != ROOT_CONTEXT_ID {
            return Err(trap("can only set tick_period in root context"));
        }
        if period > 0 && state.tick.is_some() {
            return Err(trap("tick_period already set"));
        }
    }
    let period = duration_nanos(std::time::Duration::from_millis(period.into()));
    state.tick = (period > 0).then(|| Tick {
        period,
        next_due: state.clock.monotonic_nanos() + period,
    });
    Ok(())
}

fn buffer(state: &VmState, kind: u32) -> Option<Vec<u8>> {
    match kind {
        buffer_type::HTTP_REQUEST_BODY => state.stream()?.request_body.clone(),
        buffer_type::HTTP_CALL_RESPONSE_BODY => {
            Some(state.call_response.as_ref()?.message.as_ref()?.body.clone())
        }
        buffer_type::VM_CONFIGURATION => Some(state.vm_config.clone()),
        buffer_type::PLUGIN_CONFIGURATION if state.configuring => Some(state.plugin_config.clone()),
        _ => None,
    }
}

fn proxy_get_buffer_bytes(
    c: &mut C<'_>,
    kind: u32,
    start: u32,
    max: u32,
    ret_ptr: u32,
    ret_size: u32,
) -> HostResult {
    if kind > buffer_type::MAX {
        return Err(Status::BadArgument.into());
    }
    let bytes = buffer(c.data(), kind).ok_or(Status::NotFound)?;
    let start = start as usize;
    if start >= bytes.len() {
        return Ok(());
    }
    let end = start.saturating_add(max as usize).min(bytes.len());
    return_bytes(c, &bytes[start..end], ret_ptr, ret_size)
}

fn proxy_set_buffer_bytes(
    c: &mut C<'_>,
    kind: u32,
    start: u32,
    size: u32,
    ptr: u32,
    len: u32,
) -> HostResult {
    let data = read(c, ptr, len)?;
    if kind != buffer_type::HTTP_REQUEST_BODY {
        return Err(Status::NotFound.into());
    }
    let stream = c.data_mut().stream_mut().ok_or(Status::NotFound)?;
    let body = stream.request_body.as_mut().ok_or(Status::NotFound)?;
    let start = (start as usize).min(body.len());
    let end = start.saturating_add(size as usize).min(body.len());
    body.splice(start..end, data);
    Ok(())
}

/// A header map for reading, with Envoy's availability rules.
fn read_map(state: &VmState, kind: u32) -> Result<Headers, Status> {
    let stream = state.stream();
    match kind {
        map_type::REQUEST_HEADERS => stream
            .map(|s| s.request_headers.clone())
            .ok_or(Status::BadArgument),
        map_type::RESPONSE_HEADERS => {
            let stream = stream.ok_or(Status::BadArgument)?;
            match &stream.response_headers {
                Some(headers) if stream.response_active || stream.access_log => Ok(headers.clone()),
                _ if stream.access_log => Err(Status::NotFound),
                _ => Err(Status::BadArgument),
            }
        }
        map_type::HTTP_CALL_RESPONSE_HEADERS | map_type::HTTP_CALL_RESPONSE_TRAILERS => {
            let message = state
                .call_response
                .as_ref()
                .and_then(|r| r.message.as_ref());
            let message = message.ok_or(Status::BadArgument)?;
            Ok(if kind == map_type::HTTP_CALL_RESPONSE_HEADERS {
                message.headers.clone()
            } else {
                message.trailers.clone()
            })
        }
        map_type::REQUEST_TRAILERS | map_type::RESPONSE_TRAILERS => match stream {
            Some(s) if s.access_log => Err(Status::NotFound),
            _ => Err(Status::BadArgument),
        },
        map_type::GRPC_INITIAL_METADATA | map_type::GRPC_TRAILING_METADATA => {
            Err(Status::BadArgument)
        }
        _ => Err(Status::BadArgument),
    }
}

/// A header map for writing, with Envoy's availability rules.
fn write_map(state: &mut VmState, kind: u32) -> Result<&mut Headers, Status> {
    match kind {
        map_type::REQUEST_HEADERS => {
            let stream = state.stream_mut().ok_or(Status::BadArgument)?;
            if !stream.request_writable {
                return Err(Status::BadArgument);
            }
            Ok(&mut stream.request_headers)
        }
        map_type::RESPONSE_HEADERS => {
            let stream = state.stream_mut().ok_or(Status::BadArgument)?;
            match &mut stream.response_headers {
                Some(headers) if stream.response_active => Ok(headers),
                _ => Err(Status::BadArgument),
            }
        }
        map_type::HTTP_CALL_RESPONSE_HEADERS => state
            .call_response
            .as_mut()
            .and_then(|r| r.message.as_mut())
            .map(|m| &mut m.headers)
            .ok_or(Status::BadArgument),
        _ => Err(Status::BadArgument),
    }
}

fn proxy_get_header_map_pairs(c: &mut C<'_>, kind: u32, ret_ptr: u32, ret_size: u32) -> HostResult {
    let pairs = read_map(c.data(), kind)?;
    let bytes = if pairs.is_empty() {
        Vec::new()
    } else {
        super::abi::serialize_pairs(&pairs)
    };
    return_bytes(c, &bytes, ret_ptr, ret_size)
}

fn proxy_set_header_map_pairs(c: &mut C<'_>, kind: u32, ptr: u32, len: u32) -> HostResult {
    let pairs = deserialize_pairs(&read(c, ptr, len)?).ok_or(Status::BadArgument)?;
    let map = write_map(c.data_mut(), kind)?;
    *map = pairs
        .into_iter()
        .map(|(k, v)| (k.to_ascii_lowercase(), v))
        .collect();
    Ok(())
}

fn proxy_get_header_map_value(
    c: &mut C<'_>,
    kind: u32,
    kptr: u32,
    klen: u32,
    ret_ptr: u32,
    ret_size: u32,
) -> HostResult {
    let key = read_string(c, kptr, klen)?.to_ascii_lowercase();
    let map = read_map(c.data(), kind)?;
    let value = map
        .into_iter()
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v)
        .ok_or(Status::NotFound)?;
    return_bytes(c, value.as_bytes(), ret_ptr, ret_size)
}

fn proxy_remove_header_map_value(c: &mut C<'_>, kind: u32, kptr: u32, klen: u32) -> HostResult {
    let key = read_string(c, kptr, klen)?.to_ascii_lowercase();
    write_map(c.data_mut(), kind)?.retain(|(k, _)| *k != key);
    Ok(())
}

fn proxy_replace_header_map_value(
    c: &mut C<'_>,
    kind: u32,
    kptr: u32,
    klen: u32,
    vptr: u32,
    vlen: u32,
) -> HostResult {
    let key = read_string(c, kptr, klen)?.to_ascii_lowercase();
    let value = read_string(c, vptr, vlen)?;
    let map = write_map(c.data_mut(), kind)?;
    match map.iter().position(|(k, _)| *k == key) {
        Some(first) => {
            map[first].1 = value;
            let mut index = 0;
            map.retain(|(k, _)| {
                index += 1;
                index - 1 == first || *k != key
            });
        }
        None => map.push((key, value)),
    }
    Ok(())
}

fn proxy_add_header_map_value(
    c: &mut C<'_>,
    kind: u32,
    kptr: u32,
    klen: u32,
    vptr: u32,
    vlen: u32,
) -> HostResult {
    let key = read_string(c, kptr, klen)?.to_ascii_lowercase();
    let value = read_string(c, vptr, vlen)?;
    write_map(c.data_mut(), kind)?.push((key, value));
    Ok(())
}

fn proxy_get_property(
    c: &mut C<'_>,
    pptr: u32,
    plen: u32,
    ret_ptr: u32,
    ret_size: u32,
) -> HostResult {
    let path = parse_path(&read(c, pptr, plen)?);
    let state = c.data();
    if state.profile.is_nginx() && state.stream().is_none() && path.len() > 1 {
        // "cannot get scoped properties outside of a request"
        return Err(Status::InternalFailure.into());
    }
    let value = state
        .stream()
        .and_then(|s| s.properties.get(&path).map(<[u8]>::to_vec))
        .or_else(|| state.root_properties.get(&path).map(<[u8]>::to_vec))
        .or_else(|| state.process().properties.get(&path).map(<[u8]>::to_vec))
        .ok_or(Status::NotFound)?;
    return_bytes(c, &value, ret_ptr, ret_size)
}

fn proxy_set_property(c: &mut C<'_>, pptr: u32, plen: u32, vptr: u32, vlen: u32) -> HostResult {
    let path = parse_path(&read(c, pptr, plen)?);
    let value = read(c, vptr, vlen)?;
    let segments: Vec<&str> = path.iter().map(String::as_str).collect();
    let dotted = segments.join(".");
    let state = c.data_mut();
    // ngx_wasm_module sets only nginx variables (`ngx.*`) and its host properties (`wasmx.*`):
    // any other name answers NotFound and is not kept.
    if state.profile.is_nginx() && !(dotted.starts_with("ngx.") || dotted.starts_with("wasmx.")) {
        return Err(Status::NotFound.into());
    }
    match state.stream_mut() {
        Some(stream) => {
            let text = String::from_utf8_lossy(&value).into_owned();
            stream.set_properties.push((dotted, text));
            stream.properties.insert(&segments, value)
        }
        None => state.root_properties.insert(&segments, value),
    }
    Ok(())
}

fn proxy_get_shared_data(
    c: &mut C<'_>,
    kptr: u32,
    klen: u32,
    ret_ptr: u32,
    ret_size: u32,
    ret_cas: u32,
) -> HostResult {
    let key = read_string(c, kptr, klen)?;
    let found = {
        let process = c.data().process();
        process.shared.get(&process.vm_id, &key)
    };
    let (value, cas) = found.ok_or(Status::NotFound)?;
    return_bytes(c, &value, ret_ptr, ret_size)?;
    Ok(write_u32(c, ret_cas, cas)?)
}

fn proxy_set_shared_data(
    c: &mut C<'_>,
    kptr: u32,
    klen: u32,
    vptr: u32,
    vlen: u32,
    cas: u32,
) -> HostResult {
    let key = read_string(c, kptr, klen)?;
    let value = read(c, vptr, vlen)?;
    let mut process = c.data().process();
    let vm_id = process.vm_id.clone();
    process
        .shared
        .set(&vm_id, &key, &value, cas)
        .map_err(|_| Status::CasMismatch)?;
    Ok(())
}

fn proxy_register_shared_queue(c: &mut C<'_>, nptr: u32, nlen: u32, ret_id: u32) -> HostResult {
    let name = read_string(c, nptr, nlen)?;
    let worker = c.data().worker;
    let token = {
        let mut process = c.data().process();
        let vm_id = process.vm_id.clone();
        process
            .queues
            .register(&vm_id, &name, worker, ROOT_CONTEXT_ID)
    };
    Ok(write_u32(c, ret_id, token)?)
}

fn proxy_resolve_shared_queue(
    c: &mut C<'_>,
    vptr: u32,
    vlen: u32,
    nptr: u32,
    nlen: u32,
    ret_id: u32,
) -> HostResult {
    nginx_lacks(c, "proxy_resolve_shared_queue")?;
    let vm_id = read_string(c, vptr, vlen)?;
    let name = read_string(c, nptr, nlen)?;
    let token = c
        .data()
        .process()
        .queues
        .resolve(&vm_id, &name)
        .ok_or(Status::NotFound)?;
    Ok(write_u32(c, ret_id, token)?)
}

fn proxy_dequeue_shared_queue(c: &mut C<'_>, id: u32, ret_ptr: u32, ret_size: u32) -> HostResult {
    let item = c.data().process().queues.dequeue(id);
    let item = match item {
        Some(item) => item,
        None if c.data().profile.is_nginx() => return Err(trap("could not find queue")),
        None => return Err(Status::NotFound.into()),
    };
    let item = item.ok_or(Status::Empty)?;
    return_bytes(c, &item, ret_ptr, ret_size)
}

fn proxy_enqueue_shared_queue(c: &mut C<'_>, id: u32, ptr: u32, len: u32) -> HostResult {
    let item = read(c, ptr, len)?;
    let mut process = c.data().process();
    if !process.profile.is_nginx() {
        let ready = process.queues.enqueue(id, item).ok_or(Status::NotFound)?;
        process.queue_ready.push_back(ready);
        return Ok(());
    }
    // ngx_wasm_module: a shared-memory queue of a fixed size that nobody is notified of; an
    // unknown queue or a full one traps the caller.
    let Some((_, bytes)) = process.queues.size(id) else {
        return Err(trap("could not find queue"));
    };
    if let Some(capacity) = process.queue_capacity {
        if bytes.saturating_add(item.len()) > capacity {
            return Err(trap("could not enqueue (queue is full)"));
        }
    }
    let _ = process.queues.enqueue(id, item);
    Ok(())
}

/// Queues an action on the effective stream; on a root context Envoy has no stream and
/// ignores the request.
fn defer(c: &mut C<'_>, action: impl FnOnce(u32) -> Deferred) -> HostResult {
    let state = c.data_mut();
    if state.stream().is_some() {
        let context_id = state.effective;
        state.deferred.push(action(context_id));
    }
    Ok(())
}

fn proxy_continue_stream(c: &mut C<'_>, kind: u32) -> HostResult {
    match kind {
        stream_type::HTTP_REQUEST | stream_type::HTTP_RESPONSE => {
            // nginx resumes the request whichever stream is named.
            let response = kind == stream_type::HTTP_RESPONSE && !c.data().profile.is_nginx();
            defer(c, |context_id| Deferred::Continue {
                context_id,
                response,
            })
        }
        _ => Err(Status::BadArgument.into()),
    }
}

fn proxy_close_stream(c: &mut C<'_>, kind: u32) -> HostResult {
    nginx_lacks(c, "proxy_close_stream")?;
    match kind {
        stream_type::HTTP_REQUEST | stream_type::HTTP_RESPONSE => {
            defer(c, |context_id| Deferred::Reset { context_id })
        }
        _ => Err(Status::BadArgument.into()),
    }
}

#[allow(clippy::too_many_arguments)]
fn proxy_send_local_response(
    c: &mut C<'_>,
    status: u32,
    dptr: u32,
    dlen: u32,
    bptr: u32,
    blen: u32,
    hptr: u32,
    hlen: u32,
    _grpc: i32,
) -> HostResult {
    let body = read(c, bptr, blen)?;
    let details = String::from_utf8_lossy(&read(c, dptr, dlen)?).into_owned();
    let headers = deserialize_pairs(&read(c, hptr, hlen)?).ok_or(Status::BadArgument)?;
    let headers = headers
        .into_iter()
        .map(|(k, v)| (k.to_ascii_lowercase(), v))
        .collect();
    let reply = LocalReply {
        status,
        headers,
        body,
        details,
    };
    defer(c, |context_id| Deferred::LocalReply { context_id, reply })
}

#[allow(clippy::too_many_arguments)]
fn proxy_http_call(
    c: &mut C<'_>,
    uptr: u32,
    ulen: u32,
    hptr: u32,
    hlen: u32,
    bptr: u32,
    blen: u32,
    tptr: u32,
    tlen: u32,
    timeout: u32,
    ret_token: u32,
) -> HostResult {
    let upstream = read_string(c, uptr, ulen)?;
    let headers = deserialize_pairs(&read(c, hptr, hlen)?).ok_or(Status::BadArgument)?;
    let body = read(c, bptr, blen)?;
    let trailers = deserialize_pairs(&read(c, tptr, tlen)?).ok_or(Status::BadArgument)?;
    let has = |name: &str| headers.iter().any(|(k, _)| k.eq_ignore_ascii_case(name));
    let nginx = c.data().profile.is_nginx();
    if nginx {
        // ngx_wasm_module fails the dispatch inside the host call: a trap.
        for name in [":method", ":path"] {
            if !has(name) {
                return Err(trap(format!("dispatch failed: no {name}")));
            }
        }
    } else if !(has(":path") && has(":method") && has(":authority")) {
        return Err(Status::BadArgument.into());
    }
    let (worker, context_id, now) = {
        let state = c.data();
        (state.worker, state.effective, state.clock.monotonic_nanos())
    };
    let mut doomed = None;
    let token = {
        let process = c.data().process();
        if nginx {
            let name =
                nginx_host(&upstream).map_err(|why| trap(format!("dispatch failed: {why}")))?;
            let known = name.parse::<std::net::IpAddr>().is_ok()
                || process
                    .clusters
                    .as_ref()
                    .is_none_or(|names| names.iter().any(|n| n == name));
            if !known {
                doomed = Some("resolver failure");
            }
        } else if let Some(clusters) = &process.clusters {
            if !clusters.contains(&upstream) {
                return Err(Status::BadArgument.into());
            }
        }
        process.last_token + 1
    };
    write_u32(c, ret_token, token)?;
    let timeout = (timeout > 0).then(|| std::time::Duration::from_millis(timeout.into()));
    let call = HttpCall {
        worker,
        context_id,
        token,
        upstream,
        headers,
        body,
        trailers,
        timeout,
        deadline: timeout.map(|t| now + duration_nanos(t)),
    };
    let mut process = c.data().process();
    process.last_token = token;
    process.calls.insert(token, call);
    if let Some(reason) = doomed {
        process.doomed_calls.push_back((token, reason));
    }
    Ok(())
}

/// The name (or address) of an `ngx_wasm_module` dispatch host: `name`, `name:port`,
/// `ip:port`, `[v6]:port` or a bare IP (port 80). A port must be 1 to 65535.
fn nginx_host(host: &str) -> Result<&str, &'static str> {
    if host.is_empty() {
        return Err("no host");
    }
    if host.parse::<std::net::IpAddr>().is_ok() {
        return Ok(host);
    }
    let (name, port) = match host.strip_prefix('[') {
        Some(rest) => {
            let (v6, after) = rest.split_once(']').ok_or("invalid host")?;
            (v6, after.strip_prefix(':'))
        }
        None => match host.rsplit_once(':') {
            Some((name, port)) => (name, Some(port)),
            None => (host, None),
        },
    };
    if name.is_empty() || name.contains(['/', ' ', '@', '?', '#']) {
        return Err("invalid host");
    }
    if let Some(port) = port {
        match port.parse::<u32>() {
            Ok(1..=65535) => {}
            _ => return Err("invalid port"),
        }
    }
    Ok(name)
}

#[allow(clippy::too_many_arguments)]
fn proxy_grpc_call(
    _c: &mut C<'_>,
    _uptr: u32,
    _ulen: u32,
    _sptr: u32,
    _slen: u32,
    _mptr: u32,
    _mlen: u32,
    _iptr: u32,
    _ilen: u32,
    _bptr: u32,
    _blen: u32,
    _timeout: u32,
    _ret_token: u32,
) -> HostResult {
    nginx_lacks(_c, "proxy_grpc_call")?;
    // gRPC callouts are not modelled; InternalFailure is a status the SDK turns into an Err.
    Err(Status::InternalFailure.into())
}

#[allow(clippy::too_many_arguments)]
fn proxy_grpc_stream(
    _c: &mut C<'_>,
    _uptr: u32,
    _ulen: u32,
    _sptr: u32,
    _slen: u32,
    _mptr: u32,
    _mlen: u32,
    _iptr: u32,
    _ilen: u32,
    _ret_token: u32,
) -> HostResult {
    nginx_lacks(_c, "proxy_grpc_stream")?;
    Err(Status::InternalFailure.into())
}

fn proxy_grpc_send(_c: &mut C<'_>, _token: u32, _ptr: u32, _len: u32, _end: u32) -> HostResult {
    nginx_lacks(_c, "proxy_grpc_send")?;
    Err(Status::NotFound.into())
}

fn proxy_grpc_cancel(_c: &mut C<'_>, _token: u32) -> HostResult {
    nginx_lacks(_c, "proxy_grpc_cancel")?;
    Err(Status::NotFound.into())
}

fn proxy_grpc_close(_c: &mut C<'_>, _token: u32) -> HostResult {
    nginx_lacks(_c, "proxy_grpc_close")?;
    Err(Status::NotFound.into())
}

fn proxy_get_status(c: &mut C<'_>, ret_code: u32, ret_ptr: u32, ret_size: u32) -> HostResult {
    nginx_lacks(c, "proxy_get_status")?;
    let (code, message) = match &c.data().call_response {
        Some(response) => (response.status_code, response.status_message.clone()),
        None => (0, String::new()),
    };
    write_u32(c, ret_code, code)?;
    return_bytes(c, message.as_bytes(), ret_ptr, ret_size)
}

fn proxy_set_effective_context(c: &mut C<'_>, context_id: u32) -> HostResult {
    let state = c.data_mut();
    if state.profile.is_nginx() {
        // ngx_wasm_module answers Ok and changes nothing: the calls that follow act on the
        // context of the callback that runs.
        return Ok(());
    }
    let known =
        context_id == ROOT_CONTEXT_ID || state.streams.get(&context_id).is_some_and(|s| s.live());
    if !known {
        return Err(Status::BadArgument.into());
    }
    state.effective = context_id;
    Ok(())
}

fn proxy_call_foreign_function(
    _c: &mut C<'_>,
    _nptr: u32,
    _nlen: u32,
    _aptr: u32,
    _alen: u32,
    _ret_ptr: u32,
    _ret_size: u32,
) -> HostResult {
    if _c.data().profile.is_nginx() {
        return Err(trap("unknown foreign function"));
    }
    // Envoy answers NotFound for a foreign function it does not register.
    Err(Status::NotFound.into())
}

fn proxy_done(c: &mut C<'_>) -> HostResult {
    nginx_lacks(c, "proxy_done")?;
    Ok(())
}

fn proxy_define_metric(c: &mut C<'_>, kind: u32, nptr: u32, nlen: u32, ret_id: u32) -> HostResult {
    let kind = MetricKind::from_raw(kind).ok_or(Status::BadArgument)?;
    let name = read_string(c, nptr, nlen)?;
    let id = c.data_mut().metric_ids.define(kind, &name);
    c.data().process().stats.define(kind, &name);
    Ok(write_u32(c, ret_id, id)?)
}

/// Applies `f` to the stat behind a VM's metric id.
fn with_metric<T>(
    c: &mut C<'_>,
    id: u32,
    f: impl FnOnce(&mut MetricValue) -> Result<T, Status>,
) -> Result<T, Status> {
    let (_, name) = c
        .data()
        .metric_ids
        .lookup(id)
        .cloned()
        .ok_or(Status::NotFound)?;
    let mut process = c.data().process();
    let value = process.stats.get_mut(&name).ok_or(Status::NotFound)?;
    f(value)
}

fn proxy_get_metric(c: &mut C<'_>, id: u32, ret: u32) -> HostResult {
    let value = with_metric(c, id, |value| match value {
        MetricValue::Counter(v) | MetricValue::Gauge(v) => Ok(*v),
        MetricValue::Histogram(_) => Err(Status::BadArgument),
    })?;
    Ok(write_u64(c, ret, value)?)
}

fn proxy_record_metric(c: &mut C<'_>, id: u32, value: u64) -> HostResult {
    with_metric(c, id, |stat| {
        match stat {
            MetricValue::Counter(v) => *v = v.wrapping_add(value),
            MetricValue::Gauge(v) => *v = value,
            MetricValue::Histogram(values) => values.push(value),
        }
        Ok(())
    })?;
    Ok(())
}

fn proxy_increment_metric(c: &mut C<'_>, id: u32, offset: i64) -> HostResult {
    with_metric(c, id, |stat| match stat {
        MetricValue::Counter(v) if offset > 0 => {
            *v = v.wrapping_add(offset.unsigned_abs());
            Ok(())
        }
        MetricValue::Gauge(v) => {
            *v = v.wrapping_add_signed(offset);
            Ok(())
        }
        _ => Err(Status::BadArgument),
    })?;
    Ok(())
}
