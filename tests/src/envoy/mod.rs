//! A real Envoy (from the project's virtualenv) with sluice loaded, for end-to-end tests: pick free loopback
//! ports, render a template from `envoy/`, start, wait until ready, kill on drop.
//!
//! `make test` sets `SLUICE_ENVOY` (`.venv/bin/envoy`) and `SLUICE_WASM` (the release `.wasm`); without
//! `SLUICE_ENVOY` every start fails with a message that says so. Each Envoy gets its own temp dir with the
//! rendered `envoy.yaml` and `envoy.log`; a test that panics prints the log's last lines.
//!
//! ```no_run
//! use sluice_tests::envoy::{agent, burst, get, Envoy, EnvoyOptions, Template};
//!
//! let envoy = Envoy::start(EnvoyOptions {
//!     template: Template::Sluice,
//!     plugin_config_json: r#"{"rules":[{"name":"per-ip","match":{"path_prefix":"/api/"},
//!         "key":["client_ip"],"limits":[{"requests":50,"per":"minute"}]}]}"#
//!         .to_owned(),
//!     concurrency: 4,
//!     ..EnvoyOptions::default()
//! })?;
//! let result = burst(&envoy.url("/api/x"), 500, 16)?; // 16 keep-alive connections
//! assert_eq!(result.count(200), 50);
//! let reply = get(&agent(), &envoy.url("/healthz"), &[])?;
//! assert_eq!(envoy.counter("wasmcustom.sluice.rule.per-ip.denied")?, Some(450));
//! # Ok::<(), anyhow::Error>(())
//! ```
//!
//! The shipped configurations can be started as shipped ([`Demo`] for `envoy/demo.yaml`, [`DerivedTemplate`] for a
//! template with exact text edits), [`raw_get`] sends a request target byte for byte (`/./api/x`), and [`streams`]
//! sends many requests at once on one HTTP/2 connection. Load held under a change is closed-loop ([`sustain_until`]:
//! each connection sends its next request once answered) or open-loop ([`offer_until`]: requests due at a fixed rate).

mod arrivals;
mod client;
mod load;
mod paths;
mod ports;
mod process;
mod raw;
mod shipped;
mod stats;
mod streams;
mod sustain;
mod template;

pub use arrivals::{offer_until, Arrivals};
pub use client::{agent, get, Reply};
pub use load::{burst, Burst};
pub use paths::{envoy_binary, repo_root, wasm_path};
pub use ports::free_ports;
pub use process::{Envoy, EnvoyOptions, EnvoyRefusal};
pub use raw::{raw_get, raw_get_bytes, raw_get_to};
pub use shipped::{replace_exactly, Demo, DerivedTemplate};
pub use stats::Stats;
pub use streams::streams;
pub use sustain::{latency_quantile, sustain, sustain_until, Load, Sample, Sustained};
pub use template::{render, Template};
