//! A compiled filter module, shared by every VM of every proxy a test starts.

use std::hash::{Hash, Hasher};
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
    let module = match cache_path(&engine, bytes) {
        Some(path) => cached(&engine, bytes, &path)?,
        None => Module::new(&engine, bytes).map_err(|e| format!("{e:?}"))?,
    };
    Ok((engine, module))
}

/// Where a module compiled from `bytes` by `engine` is kept: `$SLUICE_MODULE_CACHE` (empty: no
/// cache), else `<workspace>/target/tmp/modules`, under a name that hashes the wasm and
/// everything of the engine that makes compiled code differ (its version and settings, fuel
/// included). Every test process loads the filter; compiling it with Cranelift costs about a
/// second of CPU each time, reading it back a few milliseconds.
fn cache_path(engine: &Engine, bytes: &[u8]) -> Option<PathBuf> {
    let dir = match std::env::var_os("SLUICE_MODULE_CACHE") {
        Some(dir) if dir.is_empty() => return None,
        Some(dir) => PathBuf::from(dir),
        None => workspace_root().join("target/tmp/modules"),
    };
    let mut hasher = std::hash::DefaultHasher::new();
    bytes.hash(&mut hasher);
    engine.precompile_compatibility_hash().hash(&mut hasher);
    Some(dir.join(format!("{:016x}-{}.cwasm", hasher.finish(), bytes.len())))
}

/// The module at `path` if one is there and this engine can run it; else compiles `bytes` and
/// leaves the result at `path` for the next process (written aside and renamed into place, so
/// that a reader never sees half a file). A cache that cannot be written only costs time.
fn cached(engine: &Engine, bytes: &[u8], path: &Path) -> Result<Module, String> {
    // SAFETY: the file is one this function wrote from `Module::serialize` (renamed into place
    // whole), under a name that hashes the wasm and the engine's compatibility; wasmtime checks
    // the header and the engine's settings again, and anything it refuses is compiled afresh.
    if let Ok(module) = unsafe { Module::deserialize_file(engine, path) } {
        return Ok(module);
    }
    let module = Module::new(engine, bytes).map_err(|e| format!("{e:?}"))?;
    if let (Ok(serialized), Some(dir)) = (module.serialize(), path.parent()) {
        let aside = dir.join(format!(".{}.{}", std::process::id(), unique()));
        let written = std::fs::create_dir_all(dir)
            .and_then(|()| std::fs::write(&aside, serialized))
            .and_then(|()| std::fs::rename(&aside, path));
        if written.is_err() {
            let _ = std::fs::remove_file(&aside);
        }
    }
    Ok(module)
}

/// A number no other call in this process returns.
fn unique() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The smallest valid module: the magic number and the version.
    const EMPTY: &[u8] = b"\0asm\x01\0\0\0";

    #[test]
    fn a_compiled_module_is_kept_and_a_bad_cache_file_is_compiled_afresh() {
        let dir = std::env::temp_dir().join(format!("sluice-module-cache-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let engine = Engine::new(&Config::new()).unwrap();
        let path = dir.join("empty.cwasm");
        cached(&engine, EMPTY, &path).unwrap();
        let kept = std::fs::read(&path).unwrap();
        assert!(
            !kept.is_empty(),
            "the compiled module is left for the next process"
        );
        // Read back as it was kept.
        let module = unsafe { Module::deserialize_file(&engine, &path) }.unwrap();
        assert_eq!(module.imports().count(), 0);
        // A file that is not a compiled module (cut short, or from elsewhere) is compiled again
        // and replaced.
        std::fs::write(&path, b"not a module").unwrap();
        cached(&engine, EMPTY, &path).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), kept);
        // No file written aside is left behind.
        let names: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().collect();
        assert_eq!(names.len(), 1, "{names:?}");
        // The name hashes the engine's settings too: fuel changes the compiled code.
        let mut fuel = Config::new();
        fuel.consume_fuel(true);
        let metered = Engine::new(&fuel).unwrap();
        assert_ne!(cache_path(&engine, EMPTY), cache_path(&metered, EMPTY));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
