//! One worker's VM: a wasmtime store and instance, and the host state its imports see.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, MutexGuard};

use wasmtime::{Extern, Instance, Linker, Memory, Store, TypedFunc, WasmParams, WasmResults};

use super::abi::LogLevel;
use super::calls::CallResponse;
use super::clock::VirtualClock;
use super::error::{HostError, StartFailure};
use super::metrics::MetricIds;
use super::module::FilterModule;
use super::options::ProxyOptions;
use super::process::{lock, Process, SharedProcess};
use super::profile::HostProfile;
use super::properties::Properties;
use super::stream::{Deferred, Stream};

/// The root context id of every VM (one plugin per VM).
pub(crate) const ROOT_CONTEXT_ID: u32 = 1;

/// A tick timer (`proxy_set_tick_period_milliseconds`), in monotonic nanoseconds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tick {
    pub period: u64,
    pub next_due: u64,
}

/// Host state of one VM, reachable from every import through the wasmtime `Caller`.
pub(crate) struct VmState {
    pub worker: usize,
    pub process: SharedProcess,
    pub clock: Arc<VirtualClock>,
    pub memory: Option<Memory>,
    pub allocate: Option<TypedFunc<u32, u32>>,
    pub next_context_id: u32,
    /// The context host calls act on (`proxy_set_effective_context`, or the callback's own).
    pub effective: u32,
    pub streams: BTreeMap<u32, Stream>,
    pub metric_ids: MetricIds,
    pub tick: Option<Tick>,
    pub vm_config: Vec<u8>,
    pub plugin_config: Vec<u8>,
    /// `on_configure` is running: the plugin configuration buffer is readable.
    pub configuring: bool,
    pub deferred: Vec<Deferred>,
    /// The callout response being delivered, while `on_http_call_response` runs.
    pub call_response: Option<CallResponse>,
    pub root_properties: Properties,
    pub log_level: LogLevel,
    pub host_calls: BTreeMap<&'static str, u64>,
    /// Partial stdout / stderr lines.
    stdio: [String; 2],
    /// Lines logged at Error or above during the current VM call (a Rust panic message among
    /// them: the SDK's panic hook logs it at Critical), for trap messages.
    pub errors_during_call: String,
    pub rng: u64,
    pub profile: HostProfile,
}

impl VmState {
    pub(crate) fn new(worker: usize, process: SharedProcess, options: &ProxyOptions) -> VmState {
        VmState {
            worker,
            process,
            clock: options.clock.clone(),
            memory: None,
            allocate: None,
            next_context_id: ROOT_CONTEXT_ID + 1,
            effective: ROOT_CONTEXT_ID,
            streams: BTreeMap::new(),
            metric_ids: MetricIds::default(),
            tick: None,
            vm_config: options.vm_config.clone().into_bytes(),
            plugin_config: options.plugin_config.clone().into_bytes(),
            configuring: false,
            deferred: Vec::new(),
            call_response: None,
            root_properties: Properties::new(),
            log_level: options.log_level,
            host_calls: BTreeMap::new(),
            stdio: [String::new(), String::new()],
            errors_during_call: String::new(),
            rng: options.seed ^ (worker as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5EED,
            profile: options.profile,
        }
    }

    pub(crate) fn process(&self) -> MutexGuard<'_, Process> {
        lock(&self.process)
    }

    pub(crate) fn count(&mut self, name: &'static str) {
        *self.host_calls.entry(name).or_insert(0) += 1;
    }

    pub(crate) fn log(&mut self, level: LogLevel, message: String) {
        if level >= LogLevel::Error {
            self.errors_during_call.push_str(&message);
            self.errors_during_call.push('\n');
        }
        self.process().log(self.worker, level, message);
    }

    /// The live stream the effective context names, if it is one.
    pub(crate) fn stream(&self) -> Option<&Stream> {
        self.streams.get(&self.effective).filter(|s| s.live())
    }

    pub(crate) fn stream_mut(&mut self) -> Option<&mut Stream> {
        self.streams.get_mut(&self.effective).filter(|s| s.live())
    }

    /// Captures WASI stdout (fd 1, logged at Info) and stderr (fd 2, at Error), one entry per
    /// line.
    pub(crate) fn write_stdio(&mut self, fd: u32, text: &str) {
        let (slot, level) = if fd == 1 {
            (0, LogLevel::Info)
        } else {
            (1, LogLevel::Error)
        };
        self.stdio[slot].push_str(text);
        while let Some(end) = self.stdio[slot].find('\n') {
            let line: String = self.stdio[slot].drain(..=end).collect();
            self.log(level, line.trim_end_matches(['\n', '\r']).to_string());
        }
    }

    pub(crate) fn flush_stdio(&mut self) {
        for (slot, level) in [(0, LogLevel::Info), (1, LogLevel::Error)] {
            if !self.stdio[slot].is_empty() {
                let line = std::mem::take(&mut self.stdio[slot]);
                self.log(level, line);
            }
        }
    }

    /// splitmix64: deterministic bytes for WASI `random_get`.
    pub(crate) fn next_random(&mut self) -> u64 {
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// A metered VM's fuel: more than any test runs.
const FUEL: u64 = u64::MAX / 2;

/// One worker's VM.
pub(crate) struct Vm {
    pub store: Store<VmState>,
    instance: Instance,
    /// Exports by name, looked up once: a lookup by name on every callback was a tenth of a
    /// harness request's time.
    exports: HashMap<&'static str, Option<Extern>>,
    pub worker: usize,
    pub dead: bool,
}

impl Vm {
    /// A store for a VM about to be instantiated.
    pub(crate) fn store(module: &FilterModule, state: VmState) -> Store<VmState> {
        let mut store = Store::new(&module.engine, state);
        if module.metered {
            // Never runs out: the fuel is a meter here, not a limit.
            let _ = store.set_fuel(FUEL);
        }
        store
    }

    /// Instructions run since the meter was last reset (0 when the module is not metered).
    pub(crate) fn instructions(&self) -> u64 {
        self.store.get_fuel().map_or(0, |left| FUEL - left)
    }

    /// The size of the VM's linear memory, in bytes (it grows in 64 KiB pages, never shrinks).
    pub(crate) fn memory_bytes(&self) -> usize {
        self.store
            .data()
            .memory
            .map_or(0, |memory| memory.data_size(&self.store))
    }

    pub(crate) fn reset_instructions(&mut self) {
        if self.store.get_fuel().is_ok() {
            let _ = self.store.set_fuel(FUEL);
        }
    }

    pub(crate) fn instantiate(
        module: &FilterModule,
        linker: &Linker<VmState>,
        mut store: Store<VmState>,
    ) -> Result<Vm, StartFailure> {
        let worker = store.data().worker;
        let failure = |message: String| StartFailure::Instantiate { worker, message };
        let instance = linker
            .instantiate(&mut store, &module.module)
            .map_err(|e| failure(format!("{e:?}")))?;
        let memory = instance
            .get_memory(&mut store, "memory")
            .ok_or_else(|| failure("the module exports no memory".to_string()))?;
        let allocate = ["malloc", "proxy_on_memory_allocate"]
            .iter()
            .find_map(|name| instance.get_typed_func::<u32, u32>(&mut store, name).ok())
            .ok_or_else(|| {
                failure("the module exports no malloc / proxy_on_memory_allocate".to_string())
            })?;
        store.data_mut().memory = Some(memory);
        store.data_mut().allocate = Some(allocate);
        Ok(Vm {
            store,
            instance,
            exports: HashMap::new(),
            worker,
            dead: false,
        })
    }

    pub(crate) fn has_export(&mut self, name: &str) -> bool {
        self.instance.get_export(&mut self.store, name).is_some()
    }

    pub(crate) fn state(&self) -> &VmState {
        self.store.data()
    }

    pub(crate) fn state_mut(&mut self) -> &mut VmState {
        self.store.data_mut()
    }

    /// Calls export `name` with `context_id` as the effective context. `Ok(None)` if the module
    /// does not export it (Envoy then applies the callback's default). A trap kills the VM.
    pub(crate) fn call<P: WasmParams, R: WasmResults>(
        &mut self,
        name: &'static str,
        context_id: u32,
        params: P,
    ) -> Result<Option<R>, HostError> {
        if self.dead {
            return Err(HostError::VmDead {
                worker: self.worker,
            });
        }
        let export = match self.exports.get(name) {
            Some(export) => export.clone(),
            None => {
                let export = self.instance.get_export(&mut self.store, name);
                self.exports.insert(name, export.clone());
                export
            }
        };
        let Some(export) = export else {
            return Ok(None);
        };
        let func = export
            .into_func()
            .ok_or_else(|| "export is not a function".to_string())
            .and_then(|func| {
                func.typed::<P, R>(&self.store)
                    .map_err(|e| format!("export has an unexpected signature: {e}"))
            })
            .map_err(|message| self.kill(name, message))?;
        let state = self.store.data_mut();
        state.effective = context_id;
        state.errors_during_call.clear();
        func.call(&mut self.store, params)
            .map(Some)
            .map_err(|e| self.kill(name, describe(&e)))
    }

    fn kill(&mut self, callback: &'static str, message: String) -> HostError {
        self.dead = true;
        let worker = self.worker;
        let state = self.store.data_mut();
        state.flush_stdio();
        let guest_errors = std::mem::take(&mut state.errors_during_call);
        state.process().log(
            worker,
            LogLevel::Critical,
            format!("VM trapped in {callback}: {message}"),
        );
        state
            .process()
            .calls
            .retain(|_, call| call.worker != worker);
        HostError::Trap {
            worker,
            callback,
            message,
            guest_errors,
        }
    }
}

/// A trap's cause, then its wasm backtrace if wasmtime captured frames.
fn describe(error: &wasmtime::Error) -> String {
    let mut message = error.root_cause().to_string();
    if let Some(trace) = error.downcast_ref::<wasmtime::WasmBacktrace>() {
        if !trace.frames().is_empty() {
            message.push_str(&format!("\n{trace}"));
        }
    }
    message
}
