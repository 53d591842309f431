//! A wasmtime host for proxy-wasm filters that stands in for Envoy in fast, deterministic tests.
//!
//! Load a [`FilterModule`] once, start a [`Proxy`] (one Envoy process with N worker VMs) per
//! scenario, drive it with [`RequestSpec`]s, a [`VirtualClock`] and callout answers, and read
//! back [`ExchangeState`]s, logs, metrics, shared data and host-call counts.

mod abi;
mod calls;
mod clock;
mod error;
mod http;
mod imports;
mod lifecycle;
mod logs;
mod memory;
mod metrics;
mod module;
mod options;
mod process;
mod profile;
mod properties;
mod proxy;
mod queues;
mod shared;
mod stream;
mod vm;
mod wasi;

pub use abi::{header, Headers, LogLevel, Status};
pub use calls::HttpCall;
pub use clock::VirtualClock;
pub use error::{HostError, StartError, StartFailure};
pub use http::{ExchangeId, ExchangeState, RequestSpec, ResponseView};
pub use logs::{format_logs, LogEntry};
pub use metrics::{MetricKind, MetricValue};
pub use module::{filter_wasm_path, workspace_root, FilterModule};
pub use options::ProxyOptions;
pub use profile::HostProfile;
pub use properties::Properties;
pub use proxy::{Exchange, Proxy, Worker};
