//! sluice's playground: `core` in the browser. [`validate`] checks a configuration with the
//! filter's own parser; [`simulate`] plays a trace of requests through it and reports every
//! decision, the exact response headers, each limit's state and per-rule counts over time.
//!
//! Both take and return JSON text, so the page needs no glue beyond `JSON.parse`.

pub mod report;
pub mod simulation;
pub mod state;
pub mod trace;

pub use simulation::{simulate_policy, EPOCH_US};
pub use trace::{parse_trace, Arrival, MAX_REQUESTS};

use wasm_bindgen::prelude::wasm_bindgen;

/// Validates a filter configuration: `{"ok": true, "rules": [...]}`, or `{"ok": false,
/// "field": ..., "problem": ..., "message": ...}` with the parser's own message.
#[wasm_bindgen]
pub fn validate(config: &str) -> String {
    json(&report::validation(config))
}

/// Plays `trace` (CSV: `seconds,client[,path[,method[,extras]]]`) through `config`: every
/// decision, the response headers, limit states and counts over time, as JSON
/// ([`report::Report`]), or `{"ok": false, ...}` naming what is wrong.
#[wasm_bindgen]
pub fn simulate(config: &str, trace: &str) -> String {
    match simulation::simulate(config, trace) {
        Ok(report) => json(&report),
        Err(invalid) => json(&invalid),
    }
}

/// The crate's version, shown on the page.
#[wasm_bindgen]
pub fn version() -> String {
    env!("CARGO_PKG_VERSION").to_string()
}

fn json<T: serde::Serialize>(value: &T) -> String {
    // Plain data (strings, numbers, lists): writing it cannot fail; if it ever did, the page
    // still gets an answer it can show.
    serde_json::to_string(value).unwrap_or_else(|_| {
        r#"{"ok":false,"field":"","problem":"the report could not be written","message":"the report could not be written"}"#.to_string()
    })
}
