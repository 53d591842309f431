//! Wasmtime's C API (`wasmtime-c-api-impl` from crates.io) re-exported as one static library,
//! `libwasmtime.a`, for nginx's ngx_wasm_module to link (`make nginx`).
pub use wasmtime_c_api::*;
