//! A compiled filter module, shared by every VM of every proxy a test starts.

use std::path::{Path, PathBuf};

use wasmtime::{Config, Engine, Module};

use super::error::HostError;

/// A wasm filter compiled once (engine + module) and instantiated for many VMs.
#[derive(Clone)]
pub struct FilterModule {
    pub(crate) engine: Engine,
    pub(crate) module: Module,
    path: PathBuf,
    /// Whether VMs count the wasm instructions they run (wasmtime's fuel, about one unit per
    /// instruction): see [`Proxy::instructions`](crate::Proxy::instructions).
    pub(crate) metered: bool,
}

impl std::fmt::Debug for FilterModule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FilterModule")
            .field("path", &self.path)
            .finish()
    }
}

impl FilterModule {
    /// Reads and compiles the wasm file at `path`.
    pub fn load(path: impl AsRef<Path>) -> Result<FilterModule, HostError> {
        Self::load_with(path, false)
    }

    /// Like [`load`](Self::load), and every VM counts the instructions it runs: repeatable
    /// per-request costs, at some speed.
    pub fn load_metered(path: impl AsRef<Path>) -> Result<FilterModule, HostError> {
        Self::load_with(path, true)
    }

    fn load_with(path: impl AsRef<Path>, metered: bool) -> Result<FilterModule, HostError> {
        let path = path.as_ref().to_path_buf();
        let load_error = |message: String| HostError::Load {
            path: path.clone(),
            message,
        };
        let bytes = std::fs::read(&path).map_err(|e| load_error(e.to_string()))?;
        let (engine, module) = compile(&bytes, metered).map_err(load_error)?;
        Ok(FilterModule {
            engine,
            module,
            path,
            metered,
        })
    }

    /// Compiles a wasm binary held in memory.
    pub fn from_bytes(bytes: &[u8]) -> Result<FilterModule, HostError> {
        let (engine, module) = compile(bytes, false).map_err(|message| HostError::Load {
            path: PathBuf::new(),
            message,
        })?;
        Ok(FilterModule {
            engine,
            module,
            path: PathBuf::new(),
            metered: false,
        })
    }

    /// Where the module was loaded from (empty for [`from_bytes`](Self::from_bytes)).
    pub fn path(&self) -> &Path {
        &self.path
    }
}

fn compile(bytes: &[u8], metered: bool) -> Result<(Engine, Module), String> {
    let mut config = Config::new();
    config.consume_fuel(metered);
    let engine = Engine::new(&config).map_err(|e| format!("{e:?}"))?;
    let module = Module::new(&engine, bytes).map_err(|e| format!("{e:?}"))?;
    Ok((engine, module))
}

/// Path of the sluice filter's wasm: `$SLUICE_WASM` if set, else
/// `<workspace>/target/wasm32-wasip1/release/sluice_filter.wasm` (built by
/// `cargo build -p sluice-filter --target wasm32-wasip1 --release`).
pub fn filter_wasm_path() -> PathBuf {
    match std::env::var_os("SLUICE_WASM") {
        Some(path) if !path.is_empty() => PathBuf::from(path),
        _ => workspace_root().join("target/wasm32-wasip1/release/sluice_filter.wasm"),
    }
}

/// The workspace root (the parent of this crate's folder).
pub fn workspace_root() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    here.parent().unwrap_or(here).to_path_buf()
}
