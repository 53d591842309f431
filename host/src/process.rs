//! What one Envoy process shares between its worker VMs.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use super::abi::LogLevel;
use super::calls::HttpCall;
use super::logs::LogEntry;
use super::metrics::Stats;
use super::options::ProxyOptions;
use super::profile::HostProfile;
use super::properties::Properties;
use super::queues::{QueueReady, SharedQueues};
use super::shared::SharedData;

/// Process-wide state: shared data, shared queues, stats, logs and in-flight callouts.
#[derive(Debug)]
pub(crate) struct Process {
    pub vm_id: String,
    pub shared: SharedData,
    pub queues: SharedQueues,
    pub stats: Stats,
    pub logs: Vec<LogEntry>,
    pub log_level: LogLevel,
    /// Print every log line to the test's stderr too (`SLUICE_HOST_LOG=1`).
    pub echo_logs: bool,
    pub calls: BTreeMap<u32, HttpCall>,
    pub last_token: u32,
    pub queue_ready: VecDeque<QueueReady>,
    pub properties: Properties,
    pub clusters: Option<Vec<String>>,
    pub profile: HostProfile,
    pub queue_capacity: Option<usize>,
    /// Callouts nginx accepted but fails once the VM call returns (an unknown name: the
    /// resolver fails), with their `:dispatch_status`.
    pub doomed_calls: VecDeque<(u32, &'static str)>,
}

pub(crate) type SharedProcess = Arc<Mutex<Process>>;

impl Process {
    pub(crate) fn new(options: &ProxyOptions) -> SharedProcess {
        let defaults = match options.profile {
            HostProfile::Envoy => Properties::new()
                .with_str("plugin_name", &options.plugin_name)
                .with_str("plugin_root_id", &options.root_id)
                .with_str("plugin_vm_id", &options.vm_id)
                .with_str("node.id", "sluice-harness")
                .with_str("node.cluster", "sluice-harness")
                .with_str("destination.address", "10.0.0.2:10000")
                .with_int("destination.port", 10000)
                .with_int("listener_direction", 1),
            // ngx_wasm_module: the filter's name and root id; `plugin_vm_id` is not implemented,
            // `node`, `listener_direction` are not supported, `destination.*` is the PROXY
            // protocol's (absent without it).
            HostProfile::NgxWasmModule => Properties::new()
                .with_str("plugin_name", &options.plugin_name)
                .with_str("plugin_root_id", &options.root_id),
        };
        Arc::new(Mutex::new(Process {
            vm_id: options.vm_id.clone(),
            shared: SharedData::default(),
            queues: SharedQueues::default(),
            stats: Stats::default(),
            logs: Vec::new(),
            log_level: options.log_level,
            echo_logs: std::env::var_os("SLUICE_HOST_LOG").is_some_and(|v| v != "0"),
            calls: BTreeMap::new(),
            last_token: 0,
            queue_ready: VecDeque::new(),
            properties: options.properties.clone().or(&defaults),
            clusters: options.clusters.clone(),
            profile: options.profile,
            queue_capacity: options.queue_capacity,
            doomed_calls: VecDeque::new(),
        }))
    }

    pub(crate) fn log(&mut self, worker: usize, level: LogLevel, message: String) {
        if level < self.log_level {
            return;
        }
        let entry = LogEntry {
            worker,
            level,
            message,
        };
        if self.echo_logs {
            eprintln!("{entry}");
        }
        self.logs.push(entry);
    }
}

/// Locks the process, surviving a poisoned lock (a panicking test must not hide its cause).
pub(crate) fn lock(process: &SharedProcess) -> MutexGuard<'_, Process> {
    process
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
