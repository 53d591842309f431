//! sluice's proxy-wasm filter: a thin adapter from host calls to `sluice-core`.
//!
//! `root` parses the configuration once and owns the per-proxy machinery (`shared`); `http`
//! turns each request into one `Limiter::decide` call and strict checks; `syncer` runs the batched
//! sync on ticks and `announce` feeds it; `callout` is the one way to call the counter service;
//! `host` wraps the host's shared data, headers and clock; `metrics` the stats; `shedder` keeps
//! shedding's samples, metrics and wait queue; `shaper` holds requests a leaky bucket delays.

// A panic traps the VM and fails every request on its worker: none in the filter.
#![cfg_attr(
    not(test),
    deny(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::indexing_slicing
    )
)]

#[cfg(any(test, all(target_arch = "wasm32", not(target_feature = "atomics"))))]
mod alloc;
mod announce;
mod callout;
mod host;
mod http;
mod metrics;
mod root;
mod shaper;
mod shared;
mod shedder;
mod syncer;

// A VM is one thread: its allocations go through the free lists (native tests keep the system
// allocator, and test the lists on their own).
#[cfg(all(target_arch = "wasm32", not(target_feature = "atomics")))]
#[global_allocator]
static ALLOCATOR: alloc::Pools = alloc::Pools::new();

use proxy_wasm::traits::RootContext;
use proxy_wasm::types::LogLevel;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(root::Root::default()) });
}}
