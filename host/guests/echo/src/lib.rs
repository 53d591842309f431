//! A tiny proxy-wasm guest that exercises the host harness (`sluice_host`).
//!
//! It is driven by request headers, one feature each, so a test names what it wants:
//!
//! | request header            | what the guest does                                              |
//! |---------------------------|------------------------------------------------------------------|
//! | (always)                  | adds `x-echo-seen: 1` to the request, `x-echo-response: yes` to the response, counts `echo_requests` |
//! | `x-echo-local: STATUS`    | sends a local response STATUS with `x-echo: local` and body `local body` |
//! | `x-echo-incr: KEY`        | read-modify-write of a decimal counter in shared data with its cas; adds `x-echo-count` or `x-echo-cas: mismatch` |
//! | `x-echo-incr-after-call: KEY` | reads KEY, calls cluster `echo-upstream`, writes on the answer with the cas it read; 409 on mismatch |
//! | `x-echo-get: KEY`         | adds `x-echo-value` (or `none`) and `x-echo-cas` (or `none`)      |
//! | `x-echo-call: CLUSTER`    | http call to CLUSTER (`x-echo-timeout-ms`, default 1000), pauses; 200 → continue with `x-echo-call-body`, other → 502, failure → 503 |
//! | `x-echo-enqueue: ITEM`    | enqueues ITEM on the shared queue `echo-queue`                    |
//! | `x-echo-property: a.b`    | adds `x-echo-property-value` (UTF-8, or `int:N` for 8 bytes, or `none`) |
//! | `x-echo-log: MSG`         | logs MSG at warn                                                  |
//! | `x-echo-stdout: MSG`      | prints MSG to stdout and `err:MSG` to stderr                      |
//! | `x-echo-time`             | adds `x-echo-now` (host time, ns) and `x-echo-wasi-now` (WASI realtime, ns) |
//! | `x-echo-panic`            | panics (traps the VM)                                             |
//!
//! Plugin configuration: `key=value` pairs separated by `;`. `reject=1` makes on_configure fail;
//! `tick_ms=N` sets a tick period. On each tick the root counts `echo_ticks` and stores the tick
//! count in shared data `ticks`. On queue ready it dequeues everything and appends the items to
//! shared data `dequeued` (comma separated).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel, MetricType, Status};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Trace);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(EchoRoot::default()) });
}}

#[derive(Default, Clone, Copy)]
struct Metrics {
    requests: u32,
    ticks: u32,
    inflight: u32,
}

#[derive(Default)]
struct EchoRoot {
    metrics: Metrics,
    queue: u32,
    ticks: u64,
}

impl Context for EchoRoot {}

impl RootContext for EchoRoot {
    fn on_vm_start(&mut self, vm_configuration_size: usize) -> bool {
        let vm_config = self.get_vm_configuration().unwrap_or_default();
        proxy_wasm::hostcalls::log(
            LogLevel::Info,
            &format!(
                "vm_start size={vm_configuration_size} config={}",
                String::from_utf8_lossy(&vm_config)
            ),
        )
        .ok();
        true
    }

    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let config = self.get_plugin_configuration().unwrap_or_default();
        let config = String::from_utf8_lossy(&config).into_owned();
        let mut tick_ms = 0u64;
        for pair in config.split(';').filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some(("reject", _)) => {
                    log(
                        LogLevel::Error,
                        "echo: configuration rejected: field `reject` is set",
                    );
                    return false;
                }
                Some(("tick_ms", value)) => match value.parse() {
                    Ok(ms) => tick_ms = ms,
                    Err(_) => {
                        log(LogLevel::Error, "echo: field `tick_ms` is not a number");
                        return false;
                    }
                },
                _ => {}
            }
        }
        let define = |kind, name| proxy_wasm::hostcalls::define_metric(kind, name).unwrap_or(0);
        self.metrics = Metrics {
            requests: define(MetricType::Counter, "echo_requests"),
            ticks: define(MetricType::Counter, "echo_ticks"),
            inflight: define(MetricType::Gauge, "echo_inflight"),
        };
        self.queue = proxy_wasm::hostcalls::register_shared_queue("echo-queue").unwrap_or(0);
        if tick_ms > 0 {
            self.set_tick_period(Duration::from_millis(tick_ms));
        }
        log(LogLevel::Info, &format!("echo: configured with `{config}`"));
        true
    }

    fn on_tick(&mut self) {
        self.ticks += 1;
        proxy_wasm::hostcalls::increment_metric(self.metrics.ticks, 1).ok();
        let value = self.ticks.to_string();
        self.set_shared_data("ticks", Some(value.as_bytes()), None)
            .ok();
        let now = nanos(self.get_current_time());
        log(
            LogLevel::Debug,
            &format!("echo: tick {} at {now}", self.ticks),
        );
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        while let Ok(Some(item)) = self.dequeue_shared_queue(queue_id) {
            let item = String::from_utf8_lossy(&item).into_owned();
            let (old, cas) = self.get_shared_data("dequeued");
            let mut all = old
                .map(|v| String::from_utf8_lossy(&v).into_owned())
                .unwrap_or_default();
            if !all.is_empty() {
                all.push(',');
            }
            all.push_str(&item);
            self.set_shared_data("dequeued", Some(all.as_bytes()), cas)
                .ok();
            log(
                LogLevel::Info,
                &format!("echo: queue {queue_id} ready: {item}"),
            );
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(EchoHttp {
            context_id,
            metrics: self.metrics,
            pending: Pending::None,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

enum Pending {
    None,
    Call,
    IncrAfterCall {
        key: String,
        value: u64,
        cas: Option<u32>,
    },
}

struct EchoHttp {
    context_id: u32,
    metrics: Metrics,
    pending: Pending,
}

impl Context for EchoHttp {
    fn on_http_call_response(
        &mut self,
        _token: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        if num_headers == 0 {
            // Envoy's failure path: no response at all, and the response maps are unavailable.
            self.send_http_response(
                503,
                vec![("x-echo", "callout-failed")],
                Some(b"callout failed"),
            );
            return;
        }
        let status = self
            .get_http_call_response_header(":status")
            .unwrap_or_default();
        let body = self
            .get_http_call_response_body(0, body_size)
            .unwrap_or_default();
        match std::mem::replace(&mut self.pending, Pending::None) {
            Pending::IncrAfterCall { key, value, cas } => {
                let next = (value + 1).to_string();
                match self.set_shared_data(&key, Some(next.as_bytes()), cas) {
                    Ok(()) => {
                        self.add_http_request_header("x-echo-count", &next);
                        self.resume_http_request();
                    }
                    Err(Status::CasMismatch) => {
                        self.send_http_response(
                            409,
                            vec![("x-echo", "cas-mismatch")],
                            Some(b"cas mismatch"),
                        );
                    }
                    Err(_) => self.send_http_response(500, vec![], None),
                }
            }
            _ if status == "200" => {
                let body = String::from_utf8_lossy(&body).into_owned();
                self.add_http_request_header("x-echo-call-body", &body);
                self.resume_http_request();
            }
            _ => {
                let message = format!("upstream said {status}");
                self.send_http_response(
                    502,
                    vec![("x-echo", "callout-status")],
                    Some(message.as_bytes()),
                );
            }
        }
    }

    fn on_done(&mut self) -> bool {
        proxy_wasm::hostcalls::increment_metric(self.metrics.inflight, -1).ok();
        true
    }
}

impl HttpContext for EchoHttp {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        proxy_wasm::hostcalls::increment_metric(self.metrics.requests, 1).ok();
        proxy_wasm::hostcalls::increment_metric(self.metrics.inflight, 1).ok();
        self.add_http_request_header("x-echo-seen", "1");

        if self.get_http_request_header("x-echo-panic").is_some() {
            panic!("echo guest asked to panic on context {}", self.context_id);
        }
        if let Some(message) = self.get_http_request_header("x-echo-log") {
            log(LogLevel::Warn, &message);
        }
        if let Some(message) = self.get_http_request_header("x-echo-stdout") {
            println!("{message}");
            eprintln!("err:{message}");
        }
        if self.get_http_request_header("x-echo-time").is_some() {
            let host = nanos(self.get_current_time());
            let wasi = nanos(SystemTime::now());
            self.add_http_request_header("x-echo-now", &host.to_string());
            self.add_http_request_header("x-echo-wasi-now", &wasi.to_string());
        }
        if let Some(path) = self.get_http_request_header("x-echo-property") {
            let value = match self.get_property(path.split('.').collect()) {
                Some(bytes) => match String::from_utf8(bytes.clone()) {
                    Ok(text) if bytes.len() != 8 => text,
                    _ if bytes.len() == 8 => {
                        let mut raw = [0u8; 8];
                        raw.copy_from_slice(&bytes);
                        format!("int:{}", i64::from_le_bytes(raw))
                    }
                    _ => "binary".to_string(),
                },
                None => "none".to_string(),
            };
            self.add_http_request_header("x-echo-property-value", &value);
        }
        if let Some(key) = self.get_http_request_header("x-echo-get") {
            let (value, cas) = self.get_shared_data(&key);
            let value = value.map(|v| String::from_utf8_lossy(&v).into_owned());
            self.add_http_request_header("x-echo-value", value.as_deref().unwrap_or("none"));
            let cas = cas.map(|c| c.to_string());
            self.add_http_request_header("x-echo-cas", cas.as_deref().unwrap_or("none"));
        }
        if let Some(key) = self.get_http_request_header("x-echo-incr") {
            let (value, cas) = read_counter(self, &key);
            let next = (value + 1).to_string();
            match self.set_shared_data(&key, Some(next.as_bytes()), cas) {
                Ok(()) => self.add_http_request_header("x-echo-count", &next),
                Err(_) => self.add_http_request_header("x-echo-cas", "mismatch"),
            }
        }
        if let Some(item) = self.get_http_request_header("x-echo-enqueue") {
            match proxy_wasm::hostcalls::resolve_shared_queue("", "echo-queue") {
                Ok(Some(queue)) => {
                    self.enqueue_shared_queue(queue, Some(item.as_bytes())).ok();
                }
                _ => self.add_http_request_header("x-echo-queue", "missing"),
            }
        }
        if let Some(status) = self.get_http_request_header("x-echo-local") {
            let status = status.parse().unwrap_or(500);
            self.send_http_response(status, vec![("x-echo", "local")], Some(b"local body"));
            return Action::Pause;
        }
        if let Some(key) = self.get_http_request_header("x-echo-incr-after-call") {
            let (value, cas) = read_counter(self, &key);
            self.pending = Pending::IncrAfterCall { key, value, cas };
            return self.call("echo-upstream", Duration::from_secs(1));
        }
        if let Some(cluster) = self.get_http_request_header("x-echo-call") {
            let timeout = self
                .get_http_request_header("x-echo-timeout-ms")
                .and_then(|t| t.parse().ok())
                .unwrap_or(1000);
            self.pending = Pending::Call;
            return self.call(&cluster, Duration::from_millis(timeout));
        }
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        self.add_http_response_header("x-echo-response", "yes");
        Action::Continue
    }

    fn on_log(&mut self) {
        let status = self.get_http_response_header(":status").unwrap_or_default();
        log(
            LogLevel::Info,
            &format!(
                "echo: access log for context {} status {status}",
                self.context_id
            ),
        );
    }
}

impl EchoHttp {
    fn call(&mut self, cluster: &str, timeout: Duration) -> Action {
        let headers = vec![
            (":method", "GET"),
            (":path", "/check"),
            (":authority", "echo-upstream"),
        ];
        match self.dispatch_http_call(cluster, headers, Some(b"ping"), vec![], timeout) {
            Ok(_) => Action::Pause,
            Err(status) => {
                let message = format!("dispatch failed: {status:?}");
                self.send_http_response(
                    500,
                    vec![("x-echo", "dispatch-failed")],
                    Some(message.as_bytes()),
                );
                Action::Pause
            }
        }
    }
}

fn read_counter(context: &dyn Context, key: &str) -> (u64, Option<u32>) {
    let (value, cas) = context.get_shared_data(key);
    let value = value
        .and_then(|v| String::from_utf8(v).ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    (value, cas)
}

fn log(level: LogLevel, message: &str) {
    proxy_wasm::hostcalls::log(level, message).ok();
}

fn nanos(time: SystemTime) -> u128 {
    time.duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}
