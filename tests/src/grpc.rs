//! A real gRPC server and client (PyPI's `grpcio`, in the project's virtualenv beside Envoy), driven by
//! `tests/grpc/peer.py`: what a gRPC client sees of sluice's answers through a real Envoy.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::envoy::{envoy_binary, repo_root};

/// The virtualenv's Python: beside `$SLUICE_ENVOY` (`.venv/bin/envoy`), where `make deps` installs `grpcio`.
fn python() -> Result<PathBuf> {
    let envoy = envoy_binary()?;
    let python = envoy.with_file_name("python");
    if !python.is_file() {
        bail!(
            "no {} beside SLUICE_ENVOY: run `make deps`",
            python.display()
        );
    }
    Ok(python)
}

fn peer() -> PathBuf {
    repo_root().join("tests/grpc/peer.py")
}

/// A gRPC server on 127.0.0.1: every method of `sluice.Test` answers `ok`, `Fail` fails with UNAVAILABLE.
/// Stopped when dropped.
pub struct GrpcServer {
    child: Child,
    /// Closed to stop the server.
    stdin: Option<ChildStdin>,
    pub port: u16,
}

impl GrpcServer {
    pub fn start() -> Result<GrpcServer> {
        let mut command = Command::new(python()?);
        command
            .arg(peer())
            .arg("serve")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        // SAFETY: prctl is async-signal-safe; the server dies with the thread that started it.
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = command.spawn().context("starting the gRPC server")?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().context("the gRPC server's stdout")?;
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line)?;
        let port = line
            .trim()
            .strip_prefix("PORT ")
            .and_then(|p| p.parse().ok())
            .with_context(|| format!("the gRPC server said {line:?}, not its port"))?;
        Ok(GrpcServer { child, stdin, port })
    }
}

impl Drop for GrpcServer {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What a gRPC client got for one call.
#[derive(Debug, Clone)]
pub struct GrpcAnswer {
    /// The status code (0: OK, 8: RESOURCE_EXHAUSTED, 14: UNAVAILABLE, ...).
    pub code: u32,
    /// The status message, as the client decoded it.
    pub details: String,
    /// The response message of a call that succeeded.
    pub response: Option<String>,
    /// The trailing metadata (a trailers-only answer's headers).
    pub trailing: BTreeMap<String, String>,
}

/// Makes `count` unary calls of `method` (`/sluice.Test/Ok`) to `target` (`127.0.0.1:port`), one after the
/// other, with no retries; with `until_shed`, stops after the first answer that carries `x-sluice-shed`.
pub fn calls(
    target: &str,
    method: &str,
    count: usize,
    until_shed: bool,
) -> Result<Vec<GrpcAnswer>> {
    let mut command = Command::new(python()?);
    command
        .arg(peer())
        .args(["call", target, method, &count.to_string()]);
    if until_shed {
        command.arg("--until-shed");
    }
    let output = command.output().context("running the gRPC client")?;
    if !output.status.success() {
        bail!(
            "the gRPC client failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|line| {
            let v: Value = serde_json::from_str(line).with_context(|| format!("{line:?}"))?;
            let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
            Ok(GrpcAnswer {
                code: v["code"].as_u64().context("no code")? as u32,
                details: text(&v["details"]),
                response: v["response"].as_str().map(str::to_owned),
                trailing: v["trailing"]
                    .as_object()
                    .map(|m| m.iter().map(|(k, v)| (k.clone(), text(v))).collect())
                    .unwrap_or_default(),
            })
        })
        .collect()
}
