//! Where the service binary is: `$SLUICE_SERVICE_BIN`, else the workspace's release build
//! (built with cargo when missing).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// The service binary, building it (`cargo build --release -p sluice-counter-service`) if absent.
pub fn service_binary() -> Result<PathBuf> {
    if let Some(path) = std::env::var_os("SLUICE_SERVICE_BIN").filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(path));
    }
    let root = workspace_root();
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    let binary = target.join("release").join("sluice-counter-service");
    if binary.exists() {
        return Ok(binary);
    }
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .current_dir(&root)
        .args(["build", "--release", "-p", "sluice-counter-service"])
        .status()
        .context("running cargo build for the counter service")?;
    if !status.success() || !binary.exists() {
        bail!("could not build {}", binary.display());
    }
    Ok(binary)
}
