//! The `NgxWasmModule` profile on hand-written modules: the calls nginx lacks trap, a tick is
//! set once. (The echo guest's scenarios under the profile are in `harness_abi`.)

use sluice_host::{FilterModule, HostProfile, Proxy, ProxyOptions, StartFailure};

/// A module whose `on_configure` makes the calls in `body` (WAT instructions leaving an i32:
/// non-zero starts the proxy).
fn module(imports: &str, body: &str) -> FilterModule {
    let wat = format!(
        r#"(module
          {imports}
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
            {body}))"#
    );
    FilterModule::from_bytes(&wat::parse_str(wat).unwrap()).unwrap()
}

fn start(module: &FilterModule, profile: HostProfile) -> Result<Proxy, StartFailure> {
    let options = ProxyOptions {
        profile,
        ..ProxyOptions::new("")
    };
    Proxy::new(module, options).map_err(|e| e.reason)
}

fn trap_message(failure: StartFailure) -> String {
    match failure {
        StartFailure::Trap(error) => error.to_string(),
        other => panic!("expected a trap, got {other:?}"),
    }
}

#[test]
fn the_calls_nginx_lacks_trap_there_and_answer_in_envoy() {
    let calls = [
        (
            "proxy_get_log_level",
            "(param i32) (result i32)",
            "(i32.const 64)",
        ),
        ("proxy_done", "(result i32)", ""),
        (
            "proxy_close_stream",
            "(param i32) (result i32)",
            "(i32.const 0)",
        ),
        (
            "proxy_get_status",
            "(param i32 i32 i32) (result i32)",
            "(i32.const 64) (i32.const 68) (i32.const 72)",
        ),
        (
            "proxy_resolve_shared_queue",
            "(param i32 i32 i32 i32 i32) (result i32)",
            "(i32.const 0) (i32.const 0) (i32.const 0) (i32.const 1) (i32.const 64)",
        ),
        (
            "proxy_grpc_cancel",
            "(param i32) (result i32)",
            "(i32.const 1)",
        ),
    ];
    for (name, signature, args) in calls {
        let module = module(
            &format!(r#"(import "env" "{name}" (func $f {signature}))"#),
            &format!("(drop (call $f {args})) (i32.const 1)"),
        );
        assert!(
            start(&module, HostProfile::Envoy).is_ok(),
            "{name} in Envoy"
        );
        let message = trap_message(start(&module, HostProfile::NgxWasmModule).unwrap_err());
        assert!(
            message.contains(&format!("function not yet implemented): {name}")),
            "{name}: {message}"
        );
    }
}

#[test]
fn a_tick_period_is_set_once_in_nginx() {
    let module = module(
        r#"(import "env" "proxy_set_tick_period_milliseconds" (func $tick (param i32) (result i32)))"#,
        "(drop (call $tick (i32.const 100))) (drop (call $tick (i32.const 2))) (i32.const 1)",
    );
    assert!(start(&module, HostProfile::Envoy).is_ok());
    let message = trap_message(start(&module, HostProfile::NgxWasmModule).unwrap_err());
    assert!(message.contains("tick_period already set"), "{message}");
}

#[test]
fn set_effective_context_is_a_no_op_and_a_full_queue_traps_in_nginx() {
    // Switching to an unknown context: Envoy refuses (BadArgument, 2), nginx says Ok (0).
    let module_ctx = module(
        r#"(import "env" "proxy_set_effective_context" (func $ctx (param i32) (result i32)))"#,
        "(i32.eqz (call $ctx (i32.const 999)))",
    );
    assert!(start(&module_ctx, HostProfile::NgxWasmModule).is_ok());
    assert_eq!(
        start(&module_ctx, HostProfile::Envoy).unwrap_err(),
        StartFailure::ConfigureRejected { worker: 0 }
    );
    // Two 8-byte items on a queue of 12 bytes: the second traps in nginx.
    let module_queue = module(
        r#"(import "env" "proxy_register_shared_queue" (func $reg (param i32 i32 i32) (result i32)))
           (import "env" "proxy_enqueue_shared_queue" (func $enq (param i32 i32 i32) (result i32)))
           (data (i32.const 0) "q")"#,
        "(drop (call $reg (i32.const 0) (i32.const 1) (i32.const 64)))
         (drop (call $enq (i32.load (i32.const 64)) (i32.const 100) (i32.const 8)))
         (drop (call $enq (i32.load (i32.const 64)) (i32.const 100) (i32.const 8)))
         (i32.const 1)",
    );
    let options = |profile| ProxyOptions {
        profile,
        queue_capacity: Some(12),
        ..ProxyOptions::new("")
    };
    assert!(Proxy::new(&module_queue, options(HostProfile::Envoy)).is_ok());
    let failure = Proxy::new(&module_queue, options(HostProfile::NgxWasmModule))
        .unwrap_err()
        .reason;
    assert!(trap_message(failure).contains("could not enqueue (queue is full)"));
}
