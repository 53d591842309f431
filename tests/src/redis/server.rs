//! One `redis-server` on a free loopback port.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tempfile::TempDir;

use super::binaries::redis_server;
use super::ports::free_port;
use super::resp::{query, Reply};
use super::tls::{TestCertificates, TlsClient};

/// A running `redis-server` (no persistence), killed on drop.
pub struct Redis {
    port: u16,
    dir: TempDir,
    extra: Vec<String>,
    child: Option<Child>,
    /// TLS only (`--port 0 --tls-port`): the files and how the fixture itself connects.
    tls: Option<Tls>,
}

struct Tls {
    args: Vec<String>,
    client: TlsClient,
}

impl Redis {
    /// Starts a Redis on a free loopback port and waits until it answers `PING`.
    pub fn start() -> Result<Redis> {
        Redis::start_with(&[])
    }

    /// Like [`Redis::start`], with more `redis-server` arguments (e.g. `--cluster-enabled yes`).
    pub fn start_with(extra: &[&str]) -> Result<Redis> {
        Redis::start_at(None, extra)
    }

    /// Like [`Redis::start_with`], on the given loopback port (one attempt: a taken port is an error).
    pub fn start_on(port: u16, extra: &[&str]) -> Result<Redis> {
        Redis::start_at(Some(port), extra)
    }

    /// Starts a Redis that listens over TLS only (`--port 0 --tls-port`), with `certs`'s
    /// `server.pem` and trusting its CA for client certificates (`--tls-auth-clients optional`;
    /// `extra` may say `yes`, or override any of these). The fixture connects with `client.pem`.
    pub fn start_tls(certs: &TestCertificates, extra: &[&str]) -> Result<Redis> {
        let path = |name: &str| certs.path(name).display().to_string();
        let args = vec![
            "--tls-cert-file".to_owned(),
            path("server.pem"),
            "--tls-key-file".to_owned(),
            path("server.key"),
            "--tls-ca-cert-file".to_owned(),
            path("ca.pem"),
            "--tls-auth-clients".to_owned(),
            "optional".to_owned(),
        ];
        let client = TlsClient::new(
            &certs.path("ca.pem"),
            &certs.path("client.pem"),
            &certs.path("client.key"),
        )?;
        Redis::start_at_with(None, extra, Some(Tls { args, client }))
    }

    fn start_at(port: Option<u16>, extra: &[&str]) -> Result<Redis> {
        Redis::start_at_with(port, extra, None)
    }

    fn start_at_with(port: Option<u16>, extra: &[&str], tls: Option<Tls>) -> Result<Redis> {
        let with_bus = extra.contains(&"--cluster-enabled");
        let attempts = if port.is_some() { 1 } else { 3 };
        let mut last = None;
        let mut tls = tls;
        for _ in 0..attempts {
            let mut redis = Redis {
                port: match port {
                    Some(port) => port,
                    None => free_port(with_bus)?,
                },
                dir: tempfile::Builder::new().prefix("sluice-redis-").tempdir()?,
                extra: extra.iter().map(|a| a.to_string()).collect(),
                child: None,
                tls: tls.take(),
            };
            match redis.restart() {
                Ok(()) => return Ok(redis),
                Err(error) => {
                    tls = redis.tls.take();
                    last = Some(error);
                }
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("Redis did not start")))
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:<port>` (`rediss://localhost:<port>` over TLS: the name its
    /// certificate is for).
    pub fn url(&self) -> String {
        match self.tls {
            Some(_) => format!("rediss://localhost:{}", self.port),
            None => format!("redis://127.0.0.1:{}", self.port),
        }
    }

    /// `127.0.0.1:<port>`
    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The directory Redis runs in (its log is `redis.log` there).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Redis's log file (inside [`Redis::dir`], removed on drop).
    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("redis.log")
    }

    /// The process id, while Redis runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Sends one command; a Redis error reply is an `Err`.
    pub fn query(&self, args: &[&str]) -> Result<Reply> {
        match self.send(args)? {
            Reply::Error(message) => bail!("Redis {args:?}: {message}"),
            reply => Ok(reply),
        }
    }

    /// The count (field `n`) of a window rule's key when it is the only sluice key here; 0
    /// before the first report. Panics if there are several.
    pub fn only_window_count(&self) -> u64 {
        let Ok(Reply::Array(keys)) = self.query(&["KEYS", "sluice:*"]) else {
            return 0;
        };
        assert!(keys.len() <= 1, "one sluice key: {keys:?}");
        let Some(key) = keys.first().and_then(Reply::text) else {
            return 0;
        };
        self.text(&["HGET", key, "n"])
            .ok()
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0)
    }

    /// Sends one command and returns its status, bulk or integer reply as text.
    pub fn text(&self, args: &[&str]) -> Result<String> {
        match self.query(args)? {
            Reply::Integer(n) => Ok(n.to_string()),
            reply => reply
                .text()
                .map(str::to_owned)
                .with_context(|| format!("Redis {args:?} answered {reply:?}")),
        }
    }

    /// How many times `command` (lower case, e.g. `evalsha`) ran since start or `CONFIG RESETSTAT`.
    pub fn command_calls(&self, command: &str) -> Result<u64> {
        let info = self.text(&["INFO", "commandstats"])?;
        let prefix = format!("cmdstat_{command}:calls=");
        Ok(info
            .lines()
            .find_map(|line| line.strip_prefix(&prefix))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0))
    }

    /// Whether the process is running (it may still be starting).
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.as_mut().map(|c| c.try_wait()), Some(Ok(None)))
    }

    /// Kills Redis (SIGKILL: a crash, not a shutdown) and waits for it to exit.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts Redis again on the same port, empty, and waits until it answers `PING`.
    pub fn restart(&mut self) -> Result<()> {
        self.stop();
        let log = File::create(self.dir.path().join("redis.log"))?;
        let mut command = Command::new(redis_server());
        let port = self.port.to_string();
        match &self.tls {
            Some(tls) => command
                .args(["--port", "0", "--tls-port", &port])
                .args(&tls.args),
            None => command.args(["--port", &port]),
        };
        command
            .current_dir(self.dir.path())
            .args(["--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
            .args(["--daemonize", "no", "--dir"])
            .arg(self.dir.path())
            .args(&self.extra)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        // SAFETY: prctl is async-signal-safe; it only asks the kernel to kill the child when the
        // thread that started it ends, so a failed test never leaves a Redis behind.
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = command
            .spawn()
            .with_context(|| format!("starting {}", redis_server().display()))?;
        self.child = Some(child);
        self.wait_for_ping(Duration::from_secs(10))
    }

    /// One command over a fresh connection (TLS if Redis listens so), its reply as it is.
    fn send(&self, args: &[&str]) -> Result<Reply> {
        match &self.tls {
            Some(tls) => tls.client.query(self.port, args),
            None => query(self.port, args),
        }
    }

    fn wait_for_ping(&mut self, within: Duration) -> Result<()> {
        let deadline = Instant::now() + within;
        loop {
            if let Ok(Reply::Status(pong)) = self.send(&["PING"]) {
                if pong == "PONG" {
                    return Ok(());
                }
            }
            if !self.is_running() {
                let log =
                    std::fs::read_to_string(self.dir.path().join("redis.log")).unwrap_or_default();
                self.stop();
                bail!("redis-server on port {} exited: {log}", self.port);
            }
            if Instant::now() > deadline {
                self.stop();
                bail!(
                    "redis-server on port {} did not answer PING in {within:?}",
                    self.port
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.stop();
    }
}
