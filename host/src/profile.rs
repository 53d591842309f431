//! Which proxy the harness stands in for: Envoy, or nginx with Kong's `ngx_wasm_module`.

/// The host a [`Proxy`](super::Proxy) behaves as. Both run proxy-wasm ABI 0.2.1; they differ
/// where `ngx_wasm_module` lacks a call or maps a concept to nginx's own:
///
/// | | Envoy | `NgxWasmModule` |
/// |---|---|---|
/// | `proxy_get_log_level`, `proxy_done`, `proxy_close_stream`, `proxy_resolve_shared_queue`, `proxy_get_status`, gRPC calls | answered | trap (`function not yet implemented`) |
/// | an unknown foreign function | `NotFound` | trap |
/// | `proxy_set_tick_period_milliseconds` a second time | moves the tick | trap (`tick_period already set`) |
/// | `proxy_set_effective_context` | switches context | `Ok`, no effect: calls act on the callback's own context |
/// | `on_queue_ready` | called on the registrant | never called |
/// | a shared queue over its capacity | grows | trap (`could not enqueue (queue is full)`) |
/// | `on_http_response_headers` returning Pause | pauses the response | the response goes on, a warning is logged |
/// | `proxy_continue_stream(HttpResponse)` | resumes the response | resumes the request (a no-op once it is upstream) |
/// | a callout's `host` | a cluster name | `ip:port` or `name:port` (a name the resolver does not know fails with `resolver failure`) |
/// | a callout without `:method` / `:path` / `:authority` | `BadArgument` | trap without `:method` or `:path`; `:authority` optional |
/// | a failed callout (reset, timeout) | 0 headers (reset) or a 504 answer (timeout) | 0 headers, the reason in `:dispatch_status` |
/// | properties | Envoy's attributes, integers as 8 bytes | nginx's mapping: strings, `source.address` without port, no `node`, `plugin_vm_id`, `listener_direction`, `metadata`; `request.id` only from an `x-request-id` header |
/// | request headers | adds `x-forwarded-proto`, `x-request-id` | as the client sent them |
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum HostProfile {
    #[default]
    Envoy,
    NgxWasmModule,
}

impl HostProfile {
    /// Both profiles, Envoy first: for suites that run every scenario under each.
    pub const ALL: [HostProfile; 2] = [HostProfile::Envoy, HostProfile::NgxWasmModule];

    pub fn name(self) -> &'static str {
        match self {
            HostProfile::Envoy => "envoy",
            HostProfile::NgxWasmModule => "ngx_wasm_module",
        }
    }

    pub fn is_nginx(self) -> bool {
        self == HostProfile::NgxWasmModule
    }
}
