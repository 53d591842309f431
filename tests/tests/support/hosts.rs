//! Running a suite's scenarios under both host profiles, Envoy and nginx (`ngx_wasm_module`),
//! in one `cargo test`: `both_hosts!(scenario, ...)` makes `envoy::scenario` and
//! `nginx::scenario` tests; inside a scenario, [`profile`] says which host it runs as and
//! [`service`] names the counter service the way that host wants.
//!
//! Include it with `#[path = "support/hosts.rs"] mod hosts;`.

#![allow(dead_code)]

use std::cell::Cell;

use sluice_host::HostProfile;

thread_local! {
    static PROFILE: Cell<HostProfile> = const { Cell::new(HostProfile::Envoy) };
}

/// The profile of the scenario running on this thread.
pub fn profile() -> HostProfile {
    PROFILE.with(Cell::get)
}

/// Runs `scenario` as `profile`.
pub fn run_as(profile: HostProfile, scenario: fn()) {
    PROFILE.with(|p| p.set(profile));
    scenario();
}

/// The `service` fields that name the counter service: a cluster in Envoy, an address in nginx.
pub fn service() -> &'static str {
    match profile() {
        HostProfile::Envoy => r#""cluster": "sluice_service""#,
        HostProfile::NgxWasmModule => r#""address": "127.0.0.1:8081""#,
    }
}

/// `config` (a JSON object) for the host of this scenario: nginx's says `"host": "nginx"`, which
/// refuses what nginx cannot do and names the service by address.
pub fn config(config: &str) -> String {
    match profile() {
        HostProfile::Envoy => config.to_string(),
        HostProfile::NgxWasmModule => {
            let inner = config.trim_start().strip_prefix('{').unwrap_or(config);
            format!(r#"{{"host": "nginx", {inner}"#)
        }
    }
}

/// One test per scenario and host.
#[macro_export]
macro_rules! both_hosts {
    ($($scenario:ident),* $(,)?) => {
        mod envoy {
            $(#[test]
            fn $scenario() {
                super::hosts::run_as(sluice_host::HostProfile::Envoy, super::$scenario);
            })*
        }
        mod nginx {
            $(#[test]
            fn $scenario() {
                super::hosts::run_as(sluice_host::HostProfile::NgxWasmModule, super::$scenario);
            })*
        }
    };
}
