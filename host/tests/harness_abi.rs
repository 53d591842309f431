//! The host harness against a real proxy-wasm module: the echo guest in `guests/echo`
//! (built here with cargo for wasm32-wasip1), plus a few hand-written modules for ABI edges.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use sluice_host::{
    ExchangeState, FilterModule, HostError, LogLevel, Properties, Proxy, ProxyOptions, RequestSpec,
    StartFailure, VirtualClock,
};

/// The echo guest, built and compiled once per test binary.
fn echo() -> &'static FilterModule {
    static MODULE: OnceLock<FilterModule> = OnceLock::new();
    MODULE.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("guests/echo");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
        let status = Command::new(cargo)
            .args([
                "build",
                "--release",
                "--target",
                "wasm32-wasip1",
                "--manifest-path",
            ])
            .arg(dir.join("Cargo.toml"))
            .env("CARGO_TARGET_DIR", dir.join("target"))
            .env_remove("CARGO_ENCODED_RUSTFLAGS")
            .status()
            .expect("cargo runs");
        assert!(status.success(), "building the echo guest failed");
        let wasm = dir.join("target/wasm32-wasip1/release/sluice_echo_guest.wasm");
        FilterModule::load(&wasm).unwrap_or_else(|e| panic!("{e}"))
    })
}

fn proxy(config: &str, workers: usize) -> Proxy {
    let options = ProxyOptions {
        workers,
        ..ProxyOptions::new(config)
    };
    Proxy::new(echo(), options).unwrap_or_else(|e| panic!("{e}"))
}

fn get(path: &str) -> RequestSpec {
    RequestSpec::get(path)
}

fn local(state: &ExchangeState) -> (u32, String) {
    match state {
        ExchangeState::LocalResponse { status, body, .. } => {
            (*status, String::from_utf8_lossy(body).into_owned())
        }
        other => panic!("expected a local response, got {other:?}"),
    }
}

fn shared_text(proxy: &Proxy, key: &str) -> Option<String> {
    proxy
        .shared_data(key)
        .map(|(value, _)| String::from_utf8_lossy(&value).into_owned())
}

#[test]
fn start_runs_vm_start_then_configure_on_every_worker() {
    let proxy = Proxy::new(
        echo(),
        ProxyOptions {
            workers: 3,
            vm_config: "vm-settings".into(),
            ..ProxyOptions::new("tick_ms=0")
        },
    )
    .unwrap();
    let infos = proxy.log_messages(LogLevel::Info);
    let starts = infos
        .iter()
        .filter(|m| *m == "vm_start size=11 config=vm-settings")
        .count();
    let configures = infos
        .iter()
        .filter(|m| *m == "echo: configured with `tick_ms=0`")
        .count();
    assert_eq!((starts, configures), (3, 3), "logs: {infos:?}");
    assert_eq!(proxy.workers(), 3);
}

#[test]
fn a_refused_configuration_is_a_start_error_carrying_the_logs() {
    let error = Proxy::new(
        echo(),
        ProxyOptions {
            workers: 2,
            ..ProxyOptions::new("reject=1")
        },
    )
    .unwrap_err();
    assert_eq!(error.reason, StartFailure::ConfigureRejected { worker: 0 });
    let logged = error.logs.iter().any(|e| {
        e.level == LogLevel::Error
            && e.message == "echo: configuration rejected: field `reject` is set"
    });
    assert!(logged, "{error}");
}

#[test]
fn a_continued_request_carries_the_filters_headers_and_the_response_too() {
    let proxy = proxy("", 1);
    let exchange = proxy
        .request(get("/hello?x=1").header("X-Custom", "v"))
        .unwrap();
    let state = exchange.state().unwrap();
    assert!(state.is_continued(), "{state:?}");
    assert_eq!(state.header("x-echo-seen"), Some("1"));
    assert_eq!(state.header(":method"), Some("GET"));
    assert_eq!(state.header(":path"), Some("/hello?x=1"));
    assert_eq!(state.header(":authority"), Some("example.com"));
    assert_eq!(state.header(":scheme"), Some("http"));
    assert_eq!(state.header("x-custom"), Some("v"));
    assert!(!exchange.is_finished().unwrap());

    let response = exchange.respond(200, &[("server", "upstream")]).unwrap();
    assert_eq!(response.status, 200);
    assert_eq!(response.header("x-echo-response"), Some("yes"));
    assert_eq!(response.header("server"), Some("upstream"));
    assert!(exchange.is_finished().unwrap());
    assert_eq!(exchange.response().unwrap(), Some(response));
    let access_log = format!(
        "echo: access log for context {} status 200",
        exchange.id().context_id
    );
    assert!(proxy.log_messages(LogLevel::Info).contains(&access_log));
}

#[test]
fn a_local_response_ends_the_stream_through_the_filters_own_response_path() {
    let proxy = proxy("", 1);
    let exchange = proxy
        .request(get("/").header("x-echo-local", "429"))
        .unwrap();
    let state = exchange.state().unwrap();
    assert_eq!(local(&state), (429, "local body".to_string()));
    assert_eq!(state.header("x-echo"), Some("local"));
    assert_eq!(state.header("content-length"), Some("10"));
    assert_eq!(
        state.header("x-echo-response"),
        Some("yes"),
        "Envoy encodes local replies through the filter"
    );
    assert!(exchange.is_finished().unwrap());
    let error = exchange.respond(200, &[]).unwrap_err();
    assert!(matches!(error, HostError::WrongState { .. }), "{error}");
}

#[test]
fn counters_sum_across_workers_and_gauges_return_to_zero() {
    let proxy = proxy("", 2);
    let mut exchanges = Vec::new();
    for worker in [0, 0, 0, 1, 1] {
        exchanges.push(proxy.worker(worker).request(get("/")).unwrap());
    }
    assert_eq!(proxy.metric("echo_requests"), Some(5));
    assert_eq!(proxy.metric("echo_inflight"), Some(5));
    for exchange in &exchanges {
        exchange.respond(204, &[]).unwrap();
    }
    assert_eq!(proxy.metric("echo_inflight"), Some(0));
    assert_eq!(proxy.metric("no_such_metric"), None);
}

#[test]
fn shared_data_reports_missing_keys_and_moves_the_cas_on_every_write() {
    let proxy = proxy("", 1);
    let missing = proxy
        .request(get("/").header("x-echo-get", "k"))
        .unwrap()
        .state()
        .unwrap();
    assert_eq!(
        (missing.header("x-echo-value"), missing.header("x-echo-cas")),
        (Some("none"), Some("none"))
    );

    proxy.request(get("/").header("x-echo-incr", "k")).unwrap();
    let first = proxy.shared_data("k").unwrap();
    proxy.request(get("/").header("x-echo-incr", "k")).unwrap();
    let second = proxy.shared_data("k").unwrap();
    assert_eq!(
        (first.0.as_slice(), second.0.as_slice()),
        (&b"1"[..], &b"2"[..])
    );
    assert!(
        second.1 > first.1,
        "cas must move: {} then {}",
        first.1,
        second.1
    );

    let seen = proxy
        .request(get("/").header("x-echo-get", "k"))
        .unwrap()
        .state()
        .unwrap();
    assert_eq!(
        seen.header("x-echo-cas"),
        Some(second.1.to_string().as_str())
    );
}

#[test]
fn a_stale_cas_from_one_worker_loses_to_a_write_from_another() {
    let proxy = proxy("", 2);
    proxy.set_shared_data("hits", b"10");

    // Worker 0 reads hits (10, cas c) and waits on a callout before writing.
    let slow = proxy
        .worker(0)
        .request(get("/").header("x-echo-incr-after-call", "hits"))
        .unwrap();
    assert_eq!(slow.state().unwrap(), ExchangeState::Paused);
    // Worker 1 increments in between: 11, with a new cas.
    let fast = proxy
        .worker(1)
        .request(get("/").header("x-echo-incr", "hits"))
        .unwrap();
    assert_eq!(fast.state().unwrap().header("x-echo-count"), Some("11"));

    let [call] = proxy.pending_calls().try_into().unwrap();
    proxy.answer_call(call.token, 200, &[], b"").unwrap();
    assert_eq!(
        local(&slow.state().unwrap()),
        (409, "cas mismatch".to_string())
    );
    assert_eq!(
        shared_text(&proxy, "hits").as_deref(),
        Some("11"),
        "the stale write was refused"
    );

    // Without interference the same read-call-write succeeds.
    let alone = proxy
        .worker(0)
        .request(get("/").header("x-echo-incr-after-call", "hits"))
        .unwrap();
    let [call] = proxy.pending_calls().try_into().unwrap();
    proxy.answer_call(call.token, 200, &[], b"").unwrap();
    assert_eq!(alone.state().unwrap().header("x-echo-count"), Some("12"));
}

#[test]
fn two_proxies_share_no_data_and_no_stats() {
    let (a, b) = (proxy("", 1), proxy("", 1));
    a.request(get("/").header("x-echo-incr", "k")).unwrap();
    a.request(get("/").header("x-echo-incr", "k")).unwrap();
    let in_b = b
        .request(get("/").header("x-echo-get", "k"))
        .unwrap()
        .state()
        .unwrap();
    assert_eq!(in_b.header("x-echo-value"), Some("none"));
    b.request(get("/").header("x-echo-incr", "k")).unwrap();
    assert_eq!(
        (shared_text(&a, "k"), shared_text(&b, "k")),
        (Some("2".into()), Some("1".into()))
    );
    assert_eq!(
        (a.metric("echo_requests"), b.metric("echo_requests")),
        (Some(2), Some(2))
    );
}

#[test]
fn ticks_fire_per_worker_once_per_elapsed_period_on_the_virtual_clock() {
    let proxy = proxy("tick_ms=1000", 2);
    let clock = proxy.clock();
    let start = clock.now_nanos();
    proxy.advance(Duration::from_millis(999)).unwrap();
    assert_eq!(
        proxy.metric("echo_ticks"),
        Some(0),
        "at {:?}",
        clock.monotonic()
    );
    proxy.advance(Duration::from_millis(1)).unwrap();
    assert_eq!(
        proxy.metric("echo_ticks"),
        Some(2),
        "one per worker at {:?}",
        clock.monotonic()
    );
    proxy.advance(Duration::from_millis(3500)).unwrap();
    assert_eq!(
        proxy.metric("echo_ticks"),
        Some(8),
        "three more each at {:?}",
        clock.monotonic()
    );
    assert_eq!(clock.monotonic(), Duration::from_millis(4500));
    assert_eq!(shared_text(&proxy, "ticks").as_deref(), Some("4"));
    let first_tick = format!("echo: tick 1 at {}", start + 1_000_000_000);
    assert!(
        proxy.log_messages(LogLevel::Debug).contains(&first_tick),
        "{:?}",
        proxy.logs()
    );
}

#[test]
fn moving_a_shared_clock_runs_no_timer_until_fire_due() {
    let clock = VirtualClock::new();
    let proxy = Proxy::new(
        echo(),
        ProxyOptions {
            clock: clock.clone(),
            ..ProxyOptions::new("tick_ms=100")
        },
    )
    .unwrap();
    clock.advance(Duration::from_millis(250));
    assert_eq!(proxy.metric("echo_ticks"), Some(0));
    proxy.fire_due().unwrap();
    assert_eq!(
        proxy.metric("echo_ticks"),
        Some(1),
        "one late tick, as Envoy's timer fires once"
    );
}

#[test]
fn host_time_and_wasi_time_read_the_virtual_clock() {
    let proxy = proxy("", 1);
    let clock = proxy.clock();
    let read = || {
        let state = proxy
            .request(get("/").header("x-echo-time", ""))
            .unwrap()
            .state()
            .unwrap();
        (
            state.header("x-echo-now").unwrap().to_string(),
            state.header("x-echo-wasi-now").unwrap().to_string(),
        )
    };
    let now = clock.now_nanos().to_string();
    assert_eq!(read(), (now.clone(), now));
    proxy.advance(Duration::from_secs(5)).unwrap();
    let later = clock.now_nanos().to_string();
    assert_eq!(read(), (later.clone(), later));
}

#[test]
fn an_answered_callout_continues_the_paused_request() {
    let proxy = proxy("", 1);
    let exchange = proxy
        .request(get("/").header("x-echo-call", "backend"))
        .unwrap();
    assert_eq!(exchange.state().unwrap(), ExchangeState::Paused);
    let [call] = proxy.pending_calls().try_into().unwrap();
    assert_eq!(call.upstream, "backend");
    assert_eq!(
        (call.header(":path"), call.header(":method")),
        (Some("/check"), Some("GET"))
    );
    assert_eq!(call.body, b"ping");
    assert_eq!(call.timeout, Some(Duration::from_secs(1)));
    assert_eq!(call.context_id, exchange.id().context_id);

    proxy
        .answer_call(call.token, 200, &[("x-from", "backend")], b"pong")
        .unwrap();
    let state = proxy.exchange_state(exchange.id()).unwrap();
    assert_eq!(state.header("x-echo-call-body"), Some("pong"));
    assert!(proxy.pending_calls().is_empty());
    assert_eq!(exchange.respond(200, &[]).unwrap().status, 200);
    let error = proxy.answer_call(call.token, 200, &[], b"").unwrap_err();
    assert_eq!(error, HostError::NoSuchCall { token: call.token });
}

#[test]
fn a_callout_status_and_a_callout_failure_reach_the_filter() {
    let proxy = proxy("", 1);
    let refused = proxy
        .request(get("/").header("x-echo-call", "backend"))
        .unwrap();
    let token = proxy.pending_calls()[0].token;
    proxy.answer_call(token, 500, &[], b"").unwrap();
    assert_eq!(
        local(&refused.state().unwrap()),
        (502, "upstream said 500".to_string())
    );

    let reset = proxy
        .request(get("/").header("x-echo-call", "backend"))
        .unwrap();
    let token = proxy.pending_calls()[0].token;
    proxy.fail_call(token).unwrap();
    assert_eq!(
        local(&reset.state().unwrap()),
        (503, "callout failed".to_string())
    );
}

#[test]
fn a_callout_times_out_when_the_clock_passes_its_deadline() {
    let proxy = proxy("", 1);
    let exchange = proxy
        .request(
            get("/")
                .header("x-echo-call", "backend")
                .header("x-echo-timeout-ms", "200"),
        )
        .unwrap();
    let token = proxy.pending_calls()[0].token;
    proxy.advance(Duration::from_millis(199)).unwrap();
    assert_eq!(exchange.state().unwrap(), ExchangeState::Paused);
    proxy.advance(Duration::from_millis(1)).unwrap();
    assert_eq!(
        local(&exchange.state().unwrap()),
        (502, "upstream said 504".to_string())
    );
    assert!(proxy.pending_calls().is_empty());
    assert_eq!(
        proxy.answer_call(token, 200, &[], b"").unwrap_err(),
        HostError::NoSuchCall { token }
    );
}

#[test]
fn ending_a_paused_stream_cancels_its_callout() {
    let proxy = proxy("", 1);
    let exchange = proxy
        .request(get("/").header("x-echo-call", "backend"))
        .unwrap();
    exchange.finish().unwrap();
    assert!(exchange.is_finished().unwrap());
    assert!(proxy.pending_calls().is_empty());
    assert_eq!(proxy.metric("echo_inflight"), Some(0));
}

#[test]
fn a_call_to_an_unknown_cluster_is_refused_with_bad_argument() {
    let options = ProxyOptions {
        clusters: Some(vec!["backend".into()]),
        ..ProxyOptions::new("")
    };
    let proxy = Proxy::new(echo(), options).unwrap();
    let exchange = proxy
        .request(get("/").header("x-echo-call", "elsewhere"))
        .unwrap();
    assert_eq!(
        local(&exchange.state().unwrap()),
        (500, "dispatch failed: BadArgument".to_string())
    );
    assert!(proxy.pending_calls().is_empty());
}

#[test]
fn a_shared_queue_notifies_the_vm_that_registered_it_last() {
    let proxy = proxy("", 2);
    proxy
        .worker(0)
        .request(get("/").header("x-echo-enqueue", "a"))
        .unwrap();
    proxy
        .worker(1)
        .request(get("/").header("x-echo-enqueue", "b"))
        .unwrap();
    proxy.enqueue("echo-queue", b"c").unwrap();
    assert_eq!(shared_text(&proxy, "dequeued").as_deref(), Some("a,b,c"));
    let readers: Vec<usize> = proxy
        .logs()
        .iter()
        .filter(|e| e.message.contains("ready:"))
        .map(|e| e.worker)
        .collect();
    assert_eq!(
        readers,
        vec![1, 1, 1],
        "workers register in order; the last registrant gets every notification"
    );
    assert!(matches!(
        proxy.enqueue("nope", b"x"),
        Err(HostError::NoSuchQueue { .. })
    ));
}

#[test]
fn a_guest_panic_is_an_error_and_kills_only_that_worker() {
    let proxy = proxy("", 2);
    let error = proxy
        .worker(0)
        .request(get("/").header("x-echo-panic", ""))
        .unwrap_err();
    match &error {
        HostError::Trap {
            worker: 0,
            callback: "proxy_on_request_headers",
            message,
            guest_errors,
        } => {
            assert!(message.contains("unreachable"), "{error}");
            assert!(
                guest_errors.contains("echo guest asked to panic"),
                "{error}"
            );
        }
        other => panic!("expected a trap, got {other}"),
    }
    assert!(!proxy.worker(0).is_alive());
    assert_eq!(
        proxy.worker(0).request(get("/")).unwrap_err(),
        HostError::VmDead { worker: 0 }
    );
    assert!(proxy
        .worker(1)
        .request(get("/"))
        .unwrap()
        .state()
        .unwrap()
        .is_continued());
    let errors = proxy.log_messages(LogLevel::Error);
    assert!(
        errors
            .iter()
            .any(|m| m.contains("echo guest asked to panic")),
        "{errors:?}"
    );
}

#[test]
fn properties_come_from_the_request_the_plugin_and_the_test() {
    let options = ProxyOptions {
        properties: Properties::new().with_str("node.metadata.zone", "eu-1"),
        ..ProxyOptions::new("")
    };
    let proxy = Proxy::new(echo(), options).unwrap();
    let property = |path: &str| {
        let spec = get("/")
            .from("9.8.7.6:5555")
            .header("x-echo-property", path);
        let state = proxy.request(spec).unwrap().state().unwrap();
        state.header("x-echo-property-value").unwrap().to_string()
    };
    assert_eq!(property("source.address"), "9.8.7.6:5555");
    assert_eq!(property("source.port"), "int:5555");
    assert_eq!(property("plugin_name"), "sluice");
    assert_eq!(property("request.method"), "GET");
    assert_eq!(property("node.metadata.zone"), "eu-1");
    assert_eq!(property("no.such.thing"), "none");
    // A request's own properties override what the host derives from it.
    let mut spec = get("/")
        .from("9.8.7.6:5555")
        .header("x-echo-property", "request.method");
    spec.properties = Properties::new().with_str("request.method", "PATCH");
    let state = proxy.request(spec).unwrap().state().unwrap();
    assert_eq!(state.header("x-echo-property-value"), Some("PATCH"));
}

#[test]
fn stdout_and_stderr_are_logged_at_info_and_error() {
    let proxy = proxy("", 1);
    proxy
        .request(get("/").header("x-echo-stdout", "hello"))
        .unwrap();
    let logs = proxy.logs();
    assert!(
        logs.iter()
            .any(|e| e.level == LogLevel::Info && e.message == "hello"),
        "{logs:?}"
    );
    assert!(
        logs.iter()
            .any(|e| e.level == LogLevel::Error && e.message == "err:hello"),
        "{logs:?}"
    );
}

#[test]
fn host_calls_are_counted_by_name() {
    let proxy = proxy("", 1);
    proxy.reset_host_calls();
    let exchange = proxy.request(get("/")).unwrap();
    let calls = proxy.host_calls();
    assert_eq!(
        calls.get("proxy_add_header_map_value"),
        Some(&1),
        "{calls:?}"
    );
    assert_eq!(calls.get("proxy_increment_metric"), Some(&2), "{calls:?}");
    exchange.respond(200, &[]).unwrap();
    let calls = proxy.host_calls();
    assert_eq!(
        calls.get("proxy_add_header_map_value"),
        Some(&2),
        "{calls:?}"
    );
    assert_eq!(
        calls.get("proxy_increment_metric"),
        Some(&3),
        "on_done decrements the gauge: {calls:?}"
    );
    proxy.reset_host_calls();
    assert_eq!(proxy.host_call_total(), 0);
}

/// A hand-written module: bad pointers get InvalidMemoryAccess, an unknown import answers
/// Unimplemented, and the host does not panic. `on_configure` returns true only if so.
#[test]
fn bad_guest_pointers_and_unknown_imports_get_statuses_not_host_panics() {
    let wasm = wat::parse_str(
        r#"(module
          (import "env" "proxy_log" (func $log (param i32 i32 i32) (result i32)))
          (import "env" "proxy_get_current_time_nanoseconds" (func $now (param i32) (result i32)))
          (import "env" "proxy_on_something_new" (func $new (param i32) (result i32)))
          (memory (export "memory") 1)
          (global $bump (mut i32) (i32.const 1024))
          (func (export "proxy_on_memory_allocate") (param $size i32) (result i32)
            (local $p i32)
            (local.set $p (global.get $bump))
            (global.set $bump (i32.add (global.get $bump) (local.get $size)))
            (local.get $p))
          (func (export "proxy_abi_version_0_2_1"))
          (func (export "proxy_on_context_create") (param i32 i32))
          (func (export "proxy_on_configure") (param i32 i32) (result i32)
            (i32.and
              (i32.and
                (i32.eq (call $log (i32.const 2) (i32.const 0xFFFFFFF0) (i32.const 100)) (i32.const 6))
                (i32.eq (call $now (i32.const 65533)) (i32.const 6)))
              (i32.eq (call $new (i32.const 1)) (i32.const 12)))))"#,
    )
    .unwrap();
    let module = FilterModule::from_bytes(&wasm).unwrap();
    let proxy = Proxy::new(&module, ProxyOptions::new("")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        proxy.host_calls().get("env.proxy_on_something_new"),
        Some(&1)
    );
}

#[test]
fn a_module_without_a_known_abi_version_does_not_start() {
    let wasm = wat::parse_str(r#"(module (memory (export "memory") 1) (func (export "malloc") (param i32) (result i32) i32.const 0))"#)
        .unwrap();
    let module = FilterModule::from_bytes(&wasm).unwrap();
    let error = Proxy::new(&module, ProxyOptions::new("")).unwrap_err();
    assert_eq!(error.reason, StartFailure::UnknownAbi);
}
