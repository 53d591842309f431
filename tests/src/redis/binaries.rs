//! Where `redis-server` and `redis-cli` are.

use std::path::PathBuf;

/// `$SLUICE_REDIS_SERVER`, else `redis-server` from `PATH`.
pub fn redis_server() -> PathBuf {
    std::env::var_os("SLUICE_REDIS_SERVER")
        .filter(|path| !path.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("redis-server"))
}

/// `$SLUICE_REDIS_CLI`, else the `redis-cli` beside `redis-server`, else `redis-cli` from `PATH`.
pub fn redis_cli() -> PathBuf {
    if let Some(path) = std::env::var_os("SLUICE_REDIS_CLI").filter(|path| !path.is_empty()) {
        return PathBuf::from(path);
    }
    let server = redis_server();
    if let Some(dir) = server.parent().filter(|dir| !dir.as_os_str().is_empty()) {
        let beside = dir.join("redis-cli");
        if beside.exists() {
            return beside;
        }
    }
    PathBuf::from("redis-cli")
}
