//! What can go wrong driving a harnessed filter, each outcome named.

use std::fmt;
use std::path::PathBuf;

use super::http::ExchangeId;
use super::logs::{format_logs, LogEntry};

/// An error from a harness call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostError {
    /// The wasm file could not be read or compiled.
    Load {
        path: PathBuf,
        message: String,
    },
    /// The guest trapped (a Rust panic, `unreachable`, out-of-bounds access, `proc_exit`...).
    /// The worker's VM is dead from now on, as in Envoy.
    Trap {
        worker: usize,
        /// The export that was running, e.g. `proxy_on_request_headers`.
        callback: &'static str,
        /// The trap and its wasm backtrace.
        message: String,
        /// What the guest logged at Error or above (`proxy_log` or stderr) during the call: a
        /// Rust panic message is there, as the SDK's panic hook logs it at Critical.
        guest_errors: String,
    },
    /// A call on a worker whose VM trapped earlier.
    VmDead {
        worker: usize,
    },
    NoSuchWorker {
        worker: usize,
        workers: usize,
    },
    NoSuchExchange(ExchangeId),
    /// The exchange is not in a state that allows the call (e.g. `respond` on a paused or
    /// locally answered exchange).
    WrongState {
        id: ExchangeId,
        wanted: &'static str,
        state: String,
    },
    /// No pending callout with that token (never made, already answered, or cancelled because
    /// its stream ended).
    NoSuchCall {
        token: u32,
    },
    NoSuchQueue {
        name: String,
    },
}

impl fmt::Display for HostError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HostError::Load { path, message } => {
                write!(f, "cannot load {}: {message}", path.display())
            }
            HostError::Trap {
                worker,
                callback,
                message,
                guest_errors,
            } => {
                write!(f, "worker {worker} trapped in {callback}: {message}")?;
                if !guest_errors.is_empty() {
                    write!(f, "\nguest errors:\n{guest_errors}")?;
                }
                Ok(())
            }
            HostError::VmDead { worker } => {
                write!(f, "worker {worker}'s VM is dead (it trapped earlier)")
            }
            HostError::NoSuchWorker { worker, workers } => {
                write!(f, "no worker {worker}: the proxy has {workers}")
            }
            HostError::NoSuchExchange(id) => write!(f, "no exchange {id:?}"),
            HostError::WrongState { id, wanted, state } => {
                write!(f, "exchange {id:?} must be {wanted} but is {state}")
            }
            HostError::NoSuchCall { token } => write!(f, "no pending http call with token {token}"),
            HostError::NoSuchQueue { name } => write!(f, "no shared queue named {name:?}"),
        }
    }
}

impl std::error::Error for HostError {}

/// Why a proxy did not start, with everything the filter logged until then.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartError {
    pub reason: StartFailure,
    pub logs: Vec<LogEntry>,
}

/// The step of Envoy's start sequence that failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StartFailure {
    /// The module has no `proxy_abi_version_*` export Envoy knows.
    UnknownAbi,
    /// Instantiation failed (a missing import, a bad export, a start-function trap...).
    Instantiate { worker: usize, message: String },
    /// `proxy_on_vm_start` returned false.
    VmStartRejected { worker: usize },
    /// `proxy_on_configure` returned false: Envoy refuses the filter configuration.
    ConfigureRejected { worker: usize },
    /// A callback trapped during start.
    Trap(HostError),
}

impl fmt::Display for StartError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.reason {
            StartFailure::UnknownAbi => write!(f, "module exports no known proxy_abi_version_*")?,
            StartFailure::Instantiate { worker, message } => {
                write!(f, "worker {worker}: cannot instantiate: {message}")?
            }
            StartFailure::VmStartRejected { worker } => {
                write!(f, "worker {worker}: proxy_on_vm_start returned false")?
            }
            StartFailure::ConfigureRejected { worker } => {
                write!(f, "worker {worker}: proxy_on_configure returned false")?
            }
            StartFailure::Trap(error) => write!(f, "{error}")?,
        }
        if !self.logs.is_empty() {
            write!(f, "\nlogs:\n{}", format_logs(&self.logs))?;
        }
        Ok(())
    }
}

impl std::error::Error for StartError {}
