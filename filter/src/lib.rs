//! sluice's proxy-wasm filter: a thin adapter from host calls to `sluice-core`.
//!
//! `root` parses the configuration once and owns the per-proxy machinery; `http` turns each
//! request into one `Limiter::decide` call; `host` is the only place that touches host calls.

mod announce;
mod host;
mod http;
mod metrics;
mod root;
mod sync;

use proxy_wasm::traits::RootContext;
use proxy_wasm::types::LogLevel;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(root::Root::default()) });
}}
