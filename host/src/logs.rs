//! Captured guest output: `proxy_log` and WASI stdout/stderr.

use super::abi::LogLevel;

/// One captured log line.
///
/// `proxy_log` messages keep their level. WASI stdout lines are recorded at `Info` and stderr
/// lines at `Error`, as Envoy logs them (a Rust panic message therefore shows up at `Error`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogEntry {
    /// Index of the worker VM that wrote it.
    pub worker: usize,
    pub level: LogLevel,
    pub message: String,
}

impl std::fmt::Display for LogEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "[worker {}][{:?}] {}",
            self.worker, self.level, self.message
        )
    }
}

/// Formats entries one per line, for assert messages and errors.
pub fn format_logs(logs: &[LogEntry]) -> String {
    logs.iter().map(|entry| format!("{entry}\n")).collect()
}
