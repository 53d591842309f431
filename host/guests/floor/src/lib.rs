//! The floor: the cheapest proxy-wasm filter that gives the answers sluice gives in `bench/bench.py`.
//!
//! What a Wasm filter costs in Envoy before it does any work: the VM, the context per request and
//! the host calls every request makes anyway. `bench.py` runs it as `floor-open` and `floor-deny`,
//! next to `sluice-open` and `sluice-deny`, with the same Envoy config (`envoy/sluice.yaml.tmpl`).
//!
//! Plugin configuration: a plain string, surrounding whitespace ignored: a path, then optionally
//! `+` and host calls that sluice makes on that path, to tell in one Envoy run what sluice's extra
//! cost is made of (its host calls, or its wasm work).
//!
//! | configuration  | on request headers                                                        |
//! |----------------|---------------------------------------------------------------------------|
//! | `open` or empty | nothing: `Continue`, no host call                                        |
//! | `deny`         | a path starting with `/api/` gets sluice's 429 (below); any other `Continue` |
//!
//! | added host call | what it does per request, as sluice does                                  |
//! |-----------------|---------------------------------------------------------------------------|
//! | `clock`         | reads the clock                                                           |
//! | `path`          | reads `:path` (the `deny` path reads it anyway)                           |
//! | `source`        | reads the `source.address` property                                       |
//! | `shared`        | reads a shared-data value of [`SET_BYTES`] and writes it back (compare-and-swap) |
//! | `metric`        | increments one counter (`floor.requests`)                                 |
//! | `headers`       | adds the three `x-ratelimit-*` response headers of an admitted request    |
//! | `calls`         | every host call sluice makes per request on the path: on `open` all of the above but `metric` (sluice counts its metrics in the worker and hands them to the host on its tick), on `deny` `clock` and `source` |
//!
//! For example `open+calls`, `open+shared+metric`, `deny+calls`. Anything else fails
//! `on_configure`. The 429 is what sluice sends when the bench's rule (`bench`,
//! 100 requests a second, a token bucket, `"headers": "legacy"`) denies: the headers and the body of
//! `denial()` in `core/src/exchange.rs` and `core/src/reply/headers.rs` with limit 100, remaining 0 and one
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
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType};

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
/// What sluice adds to an admitted response of the open bench rule (legacy headers).
const OPEN_HEADERS: [(&str, &str); 3] = [
    ("x-ratelimit-limit", "1000000000"),
    ("x-ratelimit-remaining", "999999999"),
    ("x-ratelimit-reset", "0"),
];
/// Bytes of sluice's set for the bench's rule with its one key: the ghost area (8 of 16 bytes)
/// and one record of one limit (48 + 16 bytes); see `set_len` in `core/src/limit/table.rs`.
pub const SET_BYTES: usize = 128 + 64;
/// The shared-data key of the floor's one set, of the length of sluice's set keys.
const SET_KEY: &str = "floor/t/0123456789abcdef/17";

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::default()) });
}}

/// Which of sluice's host calls the floor makes too, per request.
#[derive(Debug, Clone, Copy, Default)]
struct Calls {
    clock: bool,
    path: bool,
    source: bool,
    shared: bool,
    /// The id of `floor.requests`, when a metric is incremented per request.
    metric: Option<u32>,
    headers: bool,
}

#[derive(Default)]
struct Root {
    deny: bool,
    calls: Calls,
}

impl Context for Root {}

impl Root {
    /// Reads the configuration: `open` or `deny`, then `+`-separated host calls.
    fn parse(&mut self, config: &str) -> Result<(), String> {
        let mut parts = config.split('+').map(str::trim);
        self.deny = match parts.next() {
            Some("" | "open") => false,
            Some("deny") => true,
            other => return Err(format!("the path must be `open` or `deny`, not {other:?}")),
        };
        let mut metric = false;
        let calls = &mut self.calls;
        for part in parts {
            match part {
                "clock" => calls.clock = true,
                "path" => calls.path = true,
                "source" => calls.source = true,
                "shared" => calls.shared = true,
                "metric" => metric = true,
                "headers" => calls.headers = true,
                "calls" => {
                    calls.clock = true;
                    calls.source = true;
                    if !self.deny {
                        calls.path = true;
                        calls.shared = true;
                        calls.headers = true;
                    }
                }
                other => return Err(format!("no host call named {other:?}")),
            }
        }
        if metric {
            let id = hostcalls::define_metric(MetricType::Counter, "floor.requests")
                .map_err(|e| format!("define_metric: {e:?}"))?;
            calls.metric = Some(id);
        }
        if calls.shared {
            // Made once, as sluice's root context makes its sets before the first request.
            let _ = hostcalls::set_shared_data(SET_KEY, Some(&[7u8; SET_BYTES]), None);
        }
        Ok(())
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        // The hostcalls, not the SDK's methods: those unwrap.
        let config = hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX)
            .ok()
            .flatten()
            .unwrap_or_default();
        if let Err(error) = self.parse(String::from_utf8_lossy(&config).trim()) {
            let _ = hostcalls::log(LogLevel::Error, &format!("floor: configuration: {error}"));
            return false;
        }
        true
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Request {
            deny: self.deny,
            calls: self.calls,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Request {
    deny: bool,
    calls: Calls,
}

impl Context for Request {}

impl Request {
    /// sluice's host calls before its decision, their answers dropped.
    fn calls(&self) {
        let calls = &self.calls;
        if calls.clock {
            let _ = hostcalls::get_current_time();
        }
        if calls.path && !self.deny {
            let _ = hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, ":path");
        }
        if calls.source {
            let _ = hostcalls::get_property(vec!["source", "address"]);
        }
        if calls.shared {
            if let Ok((Some(value), cas)) = hostcalls::get_shared_data(SET_KEY) {
                let _ = hostcalls::set_shared_data(SET_KEY, Some(&value), cas);
            }
        }
        if let Some(id) = calls.metric {
            let _ = hostcalls::increment_metric(id, 1);
        }
    }
}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        self.calls();
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

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        if self.calls.headers {
            for (name, value) in OPEN_HEADERS {
                let _ = hostcalls::set_map_value(MapType::HttpResponseHeaders, name, Some(value));
            }
        }
        Action::Continue
    }
}
