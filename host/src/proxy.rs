//! A proxy: one Envoy process with its worker VMs, driven by the test.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use super::abi::{Headers, LogLevel};
use super::calls::{timeout_reply, CallMessage, CallResponse, HttpCall};
use super::clock::{duration_nanos, VirtualClock};
use super::error::{HostError, StartError, StartFailure};
use super::http::{ExchangeId, ExchangeState, RequestSpec, ResponseView};
use super::imports;
use super::lifecycle;
use super::logs::LogEntry;
use super::metrics::MetricValue;
use super::module::FilterModule;
use super::options::ProxyOptions;
use super::process::{lock, Process, SharedProcess};
use super::profile::HostProfile;
use super::vm::{Vm, VmState, ROOT_CONTEXT_ID};

const ABI_VERSIONS: [&str; 3] = [
    "proxy_abi_version_0_2_1",
    "proxy_abi_version_0_2_0",
    "proxy_abi_version_0_1_0",
];

/// One Envoy process: `workers` VMs of one filter module (one wasm store and instance each, as
/// Envoy runs one VM per worker thread), sharing shared data, shared queues and stats.
/// Separate `Proxy` values share nothing but a clock the test gives both.
///
/// Cheap to clone (a handle). Every call runs to completion on the calling thread: callbacks
/// the host owes the filter (queue-ready notifications, actions deferred until a VM call
/// returns) run before the call returns.
///
/// Default properties: `plugin_name`, `plugin_root_id`, `plugin_vm_id` (from the options),
/// `node.id` and `node.cluster` (`sluice-harness`), `destination.address` (`10.0.0.2:10000`),
/// `destination.port`, `listener_direction` (1, inbound); per request `source.address`,
/// `source.port`, `request.path`, `request.url_path`, `request.query`, `request.host`,
/// `request.method`, `request.scheme`, `request.protocol`, `request.id`, and `response.code`
/// once responded. [`ProxyOptions::properties`] and [`RequestSpec::properties`] override them.
///
/// With [`ProxyOptions::profile`] set to [`HostProfile::NgxWasmModule`] it is one nginx with
/// `ngx_wasm_module` instead (one VM and root context per nginx worker, shared data and queues
/// in shared memory): the calls, callbacks and properties follow nginx, see [`HostProfile`].
#[derive(Clone)]
pub struct Proxy {
    inner: Arc<Mutex<Inner>>,
}

struct Inner {
    vms: Vec<Vm>,
    process: SharedProcess,
    clock: Arc<VirtualClock>,
    requests: u64,
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let inner = self.lock();
        let alive: Vec<bool> = inner.vms.iter().map(|vm| !vm.dead).collect();
        f.debug_struct("Proxy")
            .field("workers_alive", &alive)
            .field("clock", &inner.clock.now())
            .finish()
    }
}

/// One worker of a proxy, to send requests through.
pub struct Worker<'a> {
    proxy: &'a Proxy,
    index: usize,
}

impl Worker<'_> {
    pub fn index(&self) -> usize {
        self.index
    }

    /// Sends a request through this worker's filter: `on_context_create`,
    /// `on_http_request_headers` and, with a body, `on_http_request_body`.
    pub fn request(&self, spec: RequestSpec) -> Result<Exchange, HostError> {
        self.proxy.request_on(self.index, spec)
    }

    /// The VM has not trapped.
    pub fn is_alive(&self) -> bool {
        self.proxy.is_alive(self.index)
    }
}

impl Proxy {
    /// Starts the VMs like Envoy: per worker, `_initialize` (or `_start`), then
    /// `proxy_on_context_create(root, 0)`, `proxy_on_vm_start` and `proxy_on_configure`. If any
    /// refuses (returns false) or traps, the proxy does not start.
    pub fn new(module: &FilterModule, options: ProxyOptions) -> Result<Proxy, StartError> {
        let process = Process::new(&options);
        let logs_of = process.clone();
        let fail = |reason: StartFailure| StartError {
            reason,
            logs: lock(&logs_of).logs.clone(),
        };
        let mut linker = imports::linker(&module.engine).map_err(|e| {
            fail(StartFailure::Instantiate {
                worker: 0,
                message: format!("{e:?}"),
            })
        })?;
        let mut vms = Vec::with_capacity(options.workers);
        for worker in 0..options.workers.max(1) {
            let mut store = Vm::store(module, VmState::new(worker, process.clone(), &options));
            if worker == 0 {
                imports::stub_missing(&mut linker, &module.module, &mut store)
                    .map_err(|message| fail(StartFailure::Instantiate { worker, message }))?;
            }
            let mut vm = Vm::instantiate(module, &linker, store).map_err(&fail)?;
            if !ABI_VERSIONS.iter().any(|name| vm.has_export(name)) {
                return Err(fail(StartFailure::UnknownAbi));
            }
            start(&mut vm).map_err(&fail)?;
            vms.push(vm);
        }
        let proxy = Proxy {
            inner: Arc::new(Mutex::new(Inner {
                vms,
                process,
                clock: options.clock,
                requests: 0,
            })),
        };
        proxy
            .lock()
            .pump()
            .map_err(|e| fail(StartFailure::Trap(e)))?;
        Ok(proxy)
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn process(&self) -> SharedProcess {
        self.lock().process.clone()
    }

    pub fn workers(&self) -> usize {
        self.lock().vms.len()
    }

    /// Worker `index` (panics if out of range: that is a bug in the test, not the filter).
    pub fn worker(&self, index: usize) -> Worker<'_> {
        let workers = self.workers();
        assert!(
            index < workers,
            "no worker {index}: the proxy has {workers}"
        );
        Worker { proxy: self, index }
    }

    /// Sends a request through worker 0.
    pub fn request(&self, spec: RequestSpec) -> Result<Exchange, HostError> {
        self.request_on(0, spec)
    }

    fn request_on(&self, worker: usize, spec: RequestSpec) -> Result<Exchange, HostError> {
        let mut inner = self.lock();
        inner.requests += 1;
        let request_id = inner.requests;
        let context_id = lifecycle::open(inner.vm(worker)?, &spec, request_id)?;
        inner.pump()?;
        Ok(Exchange {
            proxy: self.clone(),
            id: ExchangeId { worker, context_id },
        })
    }

    /// The clock this proxy reads.
    pub fn clock(&self) -> Arc<VirtualClock> {
        self.lock().clock.clone()
    }

    /// Moves the clock forward by `by`, stopping at every timer due on the way, in time order:
    /// each worker's tick fires once per elapsed period (a 3.5 s advance with a 1 s period
    /// fires 3 ticks), and callouts whose timeout elapses get Envoy's timeout answer (see
    /// [`timeout_call`](Self::timeout_call)). Callout deadlines fire before ticks due at the
    /// same instant; workers fire in index order.
    pub fn advance(&self, by: Duration) -> Result<(), HostError> {
        let mut inner = self.lock();
        let until = inner
            .clock
            .monotonic_nanos()
            .saturating_add(duration_nanos(by));
        inner.run_timers(until)
    }

    /// Fires the timers due at the clock's current time (after the test moved a shared clock).
    pub fn fire_due(&self) -> Result<(), HostError> {
        let mut inner = self.lock();
        let now = inner.clock.monotonic_nanos();
        inner.run_timers(now)
    }

    /// Everything logged so far, in order.
    pub fn logs(&self) -> Vec<LogEntry> {
        lock(&self.process()).logs.clone()
    }

    /// Log messages at `level` or above, in order.
    pub fn log_messages(&self, level: LogLevel) -> Vec<String> {
        self.logs()
            .into_iter()
            .filter(|e| e.level >= level)
            .map(|e| e.message)
            .collect()
    }

    pub fn clear_logs(&self) {
        lock(&self.process()).logs.clear();
    }

    /// A counter's or gauge's value (counters sum over workers, as they are one Envoy stat).
    pub fn metric(&self, name: &str) -> Option<u64> {
        match lock(&self.process()).stats.get(name)? {
            MetricValue::Counter(value) | MetricValue::Gauge(value) => Some(*value),
            MetricValue::Histogram(_) => None,
        }
    }

    /// A histogram's recorded values.
    pub fn histogram(&self, name: &str) -> Option<Vec<u64>> {
        match lock(&self.process()).stats.get(name)? {
            MetricValue::Histogram(values) => Some(values.clone()),
            _ => None,
        }
    }

    pub fn metrics(&self) -> BTreeMap<String, MetricValue> {
        lock(&self.process()).stats.all()
    }

    /// Shared data `key` (in this proxy's vm_id) with its cas.
    pub fn shared_data(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        let process = self.process();
        let process = lock(&process);
        process.shared.get(&process.vm_id, key)
    }

    /// Every shared-data key of this proxy's vm_id, sorted: an emptied value keeps its key, as in
    /// Envoy, so this is what shared data holds however the filter empties it.
    pub fn shared_data_keys(&self) -> Vec<String> {
        let process = self.process();
        let process = lock(&process);
        let mut keys = process.shared.keys(&process.vm_id);
        keys.sort();
        keys
    }

    /// Writes shared data `key` unconditionally (cas 0), as another VM of the process could.
    pub fn set_shared_data(&self, key: &str, value: &[u8]) {
        let process = self.process();
        let mut process = lock(&process);
        let vm_id = process.vm_id.clone();
        // cas 0 cannot mismatch.
        let _ = process.shared.set(&vm_id, key, value, 0);
    }

    /// Items waiting on shared queue `name` (in this proxy's vm_id), and their bytes; `None`
    /// when no VM registered it.
    pub fn queue_size(&self, name: &str) -> Option<(usize, usize)> {
        let process = self.process();
        let process = lock(&process);
        let token = process.queues.resolve(&process.vm_id, name)?;
        process.queues.size(token)
    }

    /// Enqueues `item` on shared queue `name` (in this proxy's vm_id), notifying its registrant
    /// (not under `NgxWasmModule`, which never calls `on_queue_ready`).
    pub fn enqueue(&self, name: &str, item: &[u8]) -> Result<(), HostError> {
        let mut inner = self.lock();
        {
            let mut process = lock(&inner.process);
            let vm_id = process.vm_id.clone();
            let no_queue = || HostError::NoSuchQueue {
                name: name.to_string(),
            };
            let token = process.queues.resolve(&vm_id, name).ok_or_else(no_queue)?;
            let ready = process
                .queues
                .enqueue(token, item.to_vec())
                .ok_or_else(no_queue)?;
            // ngx_wasm_module never calls on_queue_ready.
            if !process.profile.is_nginx() {
                process.queue_ready.push_back(ready);
            }
        }
        inner.pump()
    }

    /// Callouts not answered yet, by token.
    pub fn pending_calls(&self) -> Vec<HttpCall> {
        lock(&self.process()).calls.values().cloned().collect()
    }

    /// Answers callout `token` with a response: `on_http_call_response` runs on the calling
    /// context with `:status` + `headers` (map `HttpCallResponseHeaders`) and `body` (buffer
    /// `HttpCallResponseBody`).
    pub fn answer_call(
        &self,
        token: u32,
        status: u32,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<(), HostError> {
        let mut all: Headers = vec![(":status".to_string(), status.to_string())];
        all.extend(
            headers
                .iter()
                .map(|(k, v)| (k.to_ascii_lowercase(), v.to_string())),
        );
        let message = CallMessage {
            headers: all,
            body: body.to_vec(),
            trailers: Vec::new(),
        };
        self.deliver(
            token,
            CallResponse {
                message: Some(message),
                ..CallResponse::default()
            },
        )
    }

    /// Fails callout `token` the way Envoy reports a reset (`onFailure`): `on_http_call_response`
    /// with 0 headers, 0 body bytes, 0 trailers; the response maps and body are unavailable
    /// (reading the headers returns BadArgument, which the Rust SDK turns into a panic), and
    /// `proxy_get_status` reports BrokenConnection (11) "reset".
    ///
    /// Under [`HostProfile::NgxWasmModule`](super::HostProfile) the callback gets 0 headers and
    /// the response headers hold only `:dispatch_status: broken connection`.
    pub fn fail_call(&self, token: u32) -> Result<(), HostError> {
        if lock(&self.process()).profile.is_nginx() {
            return self.deliver(token, CallResponse::dispatch_failure("broken connection"));
        }
        let response = CallResponse {
            message: None,
            status_code: super::abi::Status::BrokenConnection as u32,
            status_message: "reset".to_string(),
            dispatch_status: None,
        };
        self.deliver(token, response)
    }

    /// Times callout `token` out now, as Envoy does when its timeout elapses: the async
    /// client's router answers 504 with body `upstream request timeout` (`content-length`,
    /// `content-type: text/plain`), delivered as a response.
    ///
    /// Under [`HostProfile::NgxWasmModule`](super::HostProfile): 0 headers and
    /// `:dispatch_status: timeout`.
    pub fn timeout_call(&self, token: u32) -> Result<(), HostError> {
        let response = timeout_response(lock(&self.process()).profile);
        self.deliver(token, response)
    }

    fn deliver(&self, token: u32, response: CallResponse) -> Result<(), HostError> {
        let mut inner = self.lock();
        inner.deliver(token, response)?;
        inner.pump()
    }

    /// Where exchange `id` stands now.
    pub fn exchange_state(&self, id: ExchangeId) -> Result<ExchangeState, HostError> {
        let mut inner = self.lock();
        let vm = inner.vm(id.worker)?;
        let stream = vm
            .state()
            .streams
            .get(&id.context_id)
            .ok_or(HostError::NoSuchExchange(id))?;
        Ok(stream.state.clone())
    }

    pub(crate) fn respond(
        &self,
        id: ExchangeId,
        status: u32,
        headers: &[(&str, &str)],
    ) -> Result<ResponseView, HostError> {
        let mut inner = self.lock();
        let vm = inner.vm(id.worker)?;
        let stream = vm
            .state_mut()
            .streams
            .get_mut(&id.context_id)
            .ok_or(HostError::NoSuchExchange(id))?;
        if !stream.state.is_continued() || stream.responding || !stream.live() {
            let state = format!(
                "{} (responded: {}, finished: {})",
                stream.state.name(),
                stream.responding,
                stream.finished
            );
            return Err(HostError::WrongState {
                id,
                wanted: "continued and not yet responded",
                state,
            });
        }
        // nginx serves every property as a string (`$status`).
        let code = match lock(&inner.process).profile.is_nginx() {
            true => status.to_string().into_bytes(),
            false => i64::from(status).to_le_bytes().to_vec(),
        };
        let vm = inner.vm(id.worker)?;
        if let Some(stream) = vm.state_mut().streams.get_mut(&id.context_id) {
            stream.properties.insert(&["response", "code"], code);
        }
        let mut all: Headers = vec![(":status".to_string(), status.to_string())];
        all.extend(
            headers
                .iter()
                .map(|(k, v)| (k.to_ascii_lowercase(), v.to_string())),
        );
        let view = lifecycle::respond(vm, id.context_id, all)?;
        inner.pump()?;
        Ok(view)
    }

    pub(crate) fn response(&self, id: ExchangeId) -> Result<Option<ResponseView>, HostError> {
        let mut inner = self.lock();
        let vm = inner.vm(id.worker)?;
        let stream = vm
            .state()
            .streams
            .get(&id.context_id)
            .ok_or(HostError::NoSuchExchange(id))?;
        Ok(stream.response.clone())
    }

    pub(crate) fn finish(&self, id: ExchangeId) -> Result<(), HostError> {
        let mut inner = self.lock();
        let vm = inner.vm(id.worker)?;
        if !vm.state().streams.contains_key(&id.context_id) {
            return Err(HostError::NoSuchExchange(id));
        }
        lifecycle::finish(vm, id.context_id)?;
        inner.pump()
    }

    pub(crate) fn is_finished(&self, id: ExchangeId) -> Result<bool, HostError> {
        let mut inner = self.lock();
        let vm = inner.vm(id.worker)?;
        let stream = vm
            .state()
            .streams
            .get(&id.context_id)
            .ok_or(HostError::NoSuchExchange(id))?;
        Ok(stream.finished)
    }

    /// Forgets finished exchanges (their states become unqueryable), to bound memory in long
    /// runs.
    pub fn forget_finished(&self) {
        for vm in self.lock().vms.iter_mut() {
            vm.state_mut().streams.retain(|_, s| s.live());
        }
    }

    /// Host calls made so far, by import name, summed over workers (WASI calls included).
    pub fn host_calls(&self) -> BTreeMap<&'static str, u64> {
        let mut total = BTreeMap::new();
        for vm in &self.lock().vms {
            for (name, count) in &vm.state().host_calls {
                *total.entry(*name).or_insert(0) += count;
            }
        }
        total
    }

    /// Host calls since the last reset, all names together.
    pub fn host_call_total(&self) -> u64 {
        self.host_calls().values().sum()
    }

    /// Resets the host-call counts and the instruction meter.
    pub fn reset_host_calls(&self) {
        for vm in self.lock().vms.iter_mut() {
            vm.state_mut().host_calls.clear();
            vm.reset_instructions();
        }
    }

    /// Wasm instructions run by every worker since the last [`reset_host_calls`]
    /// (wasmtime's fuel: about one per instruction; 0 unless the module was loaded with
    /// [`FilterModule::load_metered`]). The same build and the same requests give the same
    /// count on any machine.
    ///
    /// [`reset_host_calls`]: Self::reset_host_calls
    pub fn instructions(&self) -> u64 {
        self.lock().vms.iter().map(|vm| vm.instructions()).sum()
    }

    /// The size of worker `index`'s linear memory, in bytes: what the module's allocator has
    /// taken from the host so far (a wasm memory grows in 64 KiB pages and never shrinks).
    pub fn memory_bytes(&self, index: usize) -> Option<usize> {
        self.lock().vms.get(index).map(|vm| vm.memory_bytes())
    }

    /// Worker `index`'s VM has not trapped.
    pub fn is_alive(&self, index: usize) -> bool {
        self.lock().vms.get(index).is_some_and(|vm| !vm.dead)
    }
}

/// Envoy's VM start sequence on one worker.
fn start(vm: &mut Vm) -> Result<(), StartFailure> {
    let worker = vm.worker;
    let initializer = if vm.has_export("_initialize") {
        "_initialize"
    } else {
        "_start"
    };
    vm.call::<(), ()>(initializer, 0, ())
        .map_err(StartFailure::Trap)?;
    let root = ROOT_CONTEXT_ID;
    vm.call::<(u32, u32), ()>("proxy_on_context_create", root, (root, 0))
        .map_err(StartFailure::Trap)?;
    let vm_config_size = vm.state().vm_config.len() as u32;
    let started = vm.call::<(u32, u32), u32>("proxy_on_vm_start", root, (root, vm_config_size));
    if started.map_err(StartFailure::Trap)? == Some(0) {
        return Err(StartFailure::VmStartRejected { worker });
    }
    let plugin_config_size = vm.state().plugin_config.len() as u32;
    vm.state_mut().configuring = true;
    let configured =
        vm.call::<(u32, u32), u32>("proxy_on_configure", root, (root, plugin_config_size));
    vm.state_mut().configuring = false;
    if configured.map_err(StartFailure::Trap)? == Some(0) {
        return Err(StartFailure::ConfigureRejected { worker });
    }
    lifecycle::settle(vm).map_err(StartFailure::Trap)
}

/// What fires next on the virtual clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Timer {
    /// Sorted before ticks at the same instant.
    CallTimeout {
        token: u32,
    },
    Tick {
        worker: usize,
    },
}

impl Inner {
    fn vm(&mut self, worker: usize) -> Result<&mut Vm, HostError> {
        let workers = self.vms.len();
        let vm = self
            .vms
            .get_mut(worker)
            .ok_or(HostError::NoSuchWorker { worker, workers })?;
        if vm.dead {
            return Err(HostError::VmDead { worker });
        }
        Ok(vm)
    }

    /// Delivers queue-ready notifications until none are owed.
    /// Fails the callouts nginx accepted but cannot reach (their `:dispatch_status`), then
    /// delivers queue-ready notifications, until none are owed.
    fn pump(&mut self) -> Result<(), HostError> {
        loop {
            let doomed = lock(&self.process).doomed_calls.pop_front();
            if let Some((token, reason)) = doomed {
                // Gone already if its stream ended meanwhile.
                if lock(&self.process).calls.contains_key(&token) {
                    self.deliver(token, CallResponse::dispatch_failure(reason))?;
                }
                continue;
            }
            let Some(ready) = lock(&self.process).queue_ready.pop_front() else {
                return Ok(());
            };
            match self.vms.get_mut(ready.worker) {
                Some(vm) if !vm.dead => lifecycle::queue_ready(vm, ready.context_id, ready.token)?,
                _ => {}
            }
        }
    }

    fn next_timer(&self) -> Option<(u64, Timer)> {
        let calls = lock(&self.process)
            .calls
            .values()
            .filter_map(|c| Some((c.deadline?, Timer::CallTimeout { token: c.token })))
            .collect::<Vec<_>>();
        let ticks =
            self.vms.iter().filter(|vm| !vm.dead).filter_map(|vm| {
                Some((vm.state().tick?.next_due, Timer::Tick { worker: vm.worker }))
            });
        calls.into_iter().chain(ticks).min()
    }

    fn run_timers(&mut self, until: u64) -> Result<(), HostError> {
        while let Some((due, timer)) = self.next_timer().filter(|(due, _)| *due <= until) {
            self.clock.advance_to_monotonic(due);
            match timer {
                Timer::CallTimeout { token } => {
                    let response = timeout_response(lock(&self.process).profile);
                    self.deliver(token, response)?;
                }
                Timer::Tick { worker } => lifecycle::tick(self.vm(worker)?)?,
            }
            self.pump()?;
        }
        self.clock.advance_to_monotonic(until);
        Ok(())
    }

    fn deliver(&mut self, token: u32, response: CallResponse) -> Result<(), HostError> {
        let call = lock(&self.process)
            .calls
            .remove(&token)
            .ok_or(HostError::NoSuchCall { token })?;
        lifecycle::deliver_call(self.vm(call.worker)?, &call, response)
    }
}

/// What a callout whose timeout elapsed gets: Envoy's router answers 504; nginx fails it.
fn timeout_response(profile: HostProfile) -> CallResponse {
    match profile {
        HostProfile::Envoy => CallResponse {
            message: Some(timeout_reply()),
            ..CallResponse::default()
        },
        HostProfile::NgxWasmModule => CallResponse::dispatch_failure("timeout"),
    }
}

/// One request's trip through a worker. Cheap to clone; queries always read the current state
/// (a callout answer or a timeout can move it on).
#[derive(Clone)]
pub struct Exchange {
    pub(crate) proxy: Proxy,
    pub(crate) id: ExchangeId,
}

impl std::fmt::Debug for Exchange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exchange").field("id", &self.id).finish()
    }
}

impl Exchange {
    pub fn id(&self) -> ExchangeId {
        self.id
    }

    /// Where the filter has left the request by now.
    pub fn state(&self) -> Result<ExchangeState, HostError> {
        self.proxy.exchange_state(self.id)
    }

    /// The upstream answers a continued request: runs `on_http_response_headers` (end of
    /// stream, no body) on `:status` + `headers` and, unless the filter pauses the response,
    /// ends the stream (`on_done`, `on_log`, `on_delete`).
    pub fn respond(
        &self,
        status: u32,
        headers: &[(&str, &str)],
    ) -> Result<ResponseView, HostError> {
        self.proxy.respond(self.id, status, headers)
    }

    /// The response as the filter left it, once [`respond`](Self::respond) ran (or a local
    /// reply replaced it).
    pub fn response(&self) -> Result<Option<ResponseView>, HostError> {
        self.proxy.response(self.id)
    }

    /// Ends the stream now, as when the client goes away (`on_done`, `on_log`, `on_delete`);
    /// pending callouts of the stream are cancelled. No-op on a finished exchange.
    pub fn finish(&self) -> Result<(), HostError> {
        self.proxy.finish(self.id)
    }

    /// The stream is over (answered, responded or reset) and its context deleted.
    pub fn is_finished(&self) -> Result<bool, HostError> {
        self.proxy.is_finished(self.id)
    }
}
