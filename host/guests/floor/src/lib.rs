//! The floor: the cheapest proxy-wasm filter that gives the answers sluice gives in `bench/bench.py`.
//!
//! What a Wasm filter costs in Envoy before it does any work: the VM, the context per request and
//! the host calls every request makes anyway. `bench.py` runs it as `floor-open` and `floor-deny`,
//! next to `sluice-open` and `sluice-deny`, with the same Envoy config (`envoy/sluice.yaml.tmpl`).
//!
//! Plugin configuration: a plain string, surrounding whitespace ignored.
//!
//! | configuration  | on request headers                                                        |
//! |----------------|---------------------------------------------------------------------------|
//! | `open` or empty | nothing: `Continue`, no host call                                        |
//! | `deny`         | a path starting with `/api/` gets sluice's 429 (below); any other `Continue` |
//!
//! Anything else fails `on_configure`. The 429 is what sluice sends when the bench's rule (`bench`,
//! 100 requests a second, a token bucket, `"headers": "legacy"`) denies: the headers and the body of
//! `denial()` in `core/src/exchange.rs` and `core/src/headers.rs` with limit 100, remaining 0 and one
//! second for both `retry-after` and `x-ratelimit-reset`. They are constants here: the floor
//! computes nothing.

// A panic traps the VM and fails every request on its worker: none in the hooks.
#![cfg_attr(
    not(test),
    deny(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::indexing_slicing
    )
)]

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType};

/// The status, headers and body sluice answers a request its bench rule denies.
const STATUS: u32 = 429;
const HEADERS: [(&str, &str); 5] = [
    ("retry-after", "1"),
    ("content-type", "application/json"),
    ("x-ratelimit-limit", "100"),
    ("x-ratelimit-remaining", "0"),
    ("x-ratelimit-reset", "1"),
];
const BODY: &[u8] = b"{\"error\":\"rate_limited\",\"rule\":\"bench\",\"message\":\"rate limit exceeded: 100 requests per second for rule bench; retry in 1 s\",\"retryAfter\":1}";
/// The paths sluice's bench rule matches (`"match": {"path_prefix": "/api/"}`).
const PREFIX: &str = "/api/";

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root { deny: false }) });
}}

struct Root {
    deny: bool,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        // The hostcalls, not the SDK's methods: those unwrap.
        let config = hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX)
            .ok()
            .flatten()
            .unwrap_or_default();
        match String::from_utf8_lossy(&config).trim() {
            "" | "open" => self.deny = false,
            "deny" => self.deny = true,
            other => {
                let _ = hostcalls::log(
                    LogLevel::Error,
                    &format!("floor: configuration must be `open` or `deny`, not `{other}`"),
                );
                return false;
            }
        }
        true
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Request { deny: self.deny }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Request {
    deny: bool,
}

impl Context for Request {}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        if !self.deny {
            return Action::Continue;
        }
        let denied = matches!(
            hostcalls::get_map_value(MapType::HttpRequestHeaders, ":path"),
            Ok(Some(path)) if path.starts_with(PREFIX)
        );
        if denied && hostcalls::send_http_response(STATUS, HEADERS.to_vec(), Some(BODY)).is_ok() {
            return Action::Pause;
        }
        Action::Continue
    }
}
