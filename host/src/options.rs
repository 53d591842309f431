//! How to start a proxy: one settings struct.

use std::sync::Arc;

use super::abi::LogLevel;
use super::clock::VirtualClock;
use super::profile::HostProfile;
use super::properties::Properties;

/// Settings for [`Proxy::new`](super::Proxy::new). `ProxyOptions::new(config)` gives one
/// worker, a fresh clock and Envoy-like defaults; change fields with struct update syntax.
#[derive(Debug, Clone)]
pub struct ProxyOptions {
    /// Plugin configuration (`configuration` in Envoy's filter config), given to `on_configure`.
    pub plugin_config: String,
    /// Number of worker VMs (Envoy's `--concurrency`).
    pub workers: usize,
    /// VM configuration (`vm_config.configuration`), given to `on_vm_start`.
    pub vm_config: String,
    pub clock: Arc<VirtualClock>,
    /// Extra properties (override the defaults, see [`Proxy`](super::Proxy)).
    pub properties: Properties,
    /// `vm_config.vm_id`: scopes shared data and shared queue names.
    pub vm_id: String,
    /// `root_id` of the plugin (property `plugin_root_id`).
    pub root_id: String,
    /// `name` of the plugin (property `plugin_name`).
    pub plugin_name: String,
    /// Messages below this level are dropped; `proxy_get_log_level` reports it.
    pub log_level: LogLevel,
    /// Clusters `proxy_http_call` may target; `None` accepts any name. Envoy answers
    /// `BadArgument` for an unknown cluster.
    pub clusters: Option<Vec<String>>,
    /// Seed for WASI `random_get` (deterministic per worker).
    pub seed: u64,
    /// Which proxy the harness behaves as (see [`HostProfile`]). Under `NgxWasmModule`,
    /// `clusters` lists the host names the resolver knows (`None`: every name resolves); an IP
    /// address always does.
    pub profile: HostProfile,
    /// Bytes a shared queue holds (`ngx_wasm_module`'s `shm_queue` size); `None`: unbounded, as
    /// in Envoy. Only `NgxWasmModule` enforces it, by trapping the enqueuing VM as nginx does.
    pub queue_capacity: Option<usize>,
}

impl ProxyOptions {
    pub fn new(plugin_config: impl Into<String>) -> ProxyOptions {
        ProxyOptions {
            plugin_config: plugin_config.into(),
            ..ProxyOptions::default()
        }
    }
}

impl Default for ProxyOptions {
    fn default() -> Self {
        ProxyOptions {
            plugin_config: String::new(),
            workers: 1,
            vm_config: String::new(),
            clock: VirtualClock::new(),
            properties: Properties::default(),
            vm_id: String::new(),
            root_id: String::new(),
            plugin_name: "sluice".to_string(),
            log_level: LogLevel::Trace,
            clusters: None,
            seed: 0,
            profile: HostProfile::Envoy,
            queue_capacity: None,
        }
    }
}
