//! Redis Sentinel (`redis-server <config> --sentinel`, Debian's `redis-sentinel` is the same
//! binary): sentinels on free loopback ports watching one primary, killed on drop.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tempfile::TempDir;

use super::binaries::redis_server;
use super::ports::free_port;
use super::resp::{query, Reply};

/// One running sentinel.
pub struct Sentinel {
    port: u16,
    dir: TempDir,
    child: Option<Child>,
}

impl Sentinel {
    /// Starts a sentinel watching the primary on `127.0.0.1:primary_port` under `name`, with a
    /// `quorum` and `down_after_ms` (how long the primary may be silent before it is down), and
    /// waits until it answers `PING`.
    pub fn start(
        name: &str,
        primary_port: u16,
        quorum: u32,
        down_after_ms: u64,
    ) -> Result<Sentinel> {
        let dir = tempfile::Builder::new()
            .prefix("sluice-sentinel-")
            .tempdir()?;
        let port = free_port(false)?;
        let config = dir.path().join("sentinel.conf");
        std::fs::write(
            &config,
            format!(
                "port {port}\nbind 127.0.0.1\ndir {dir}\n\
                 sentinel monitor {name} 127.0.0.1 {primary_port} {quorum}\n\
                 sentinel down-after-milliseconds {name} {down_after_ms}\n\
                 sentinel failover-timeout {name} 10000\n\
                 sentinel parallel-syncs {name} 1\n",
                dir = dir.path().display()
            ),
        )?;
        let log = File::create(dir.path().join("sentinel.log"))?;
        let mut command = Command::new(redis_server());
        command
            .arg(&config)
            .arg("--sentinel")
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        // SAFETY: prctl is async-signal-safe; the sentinel dies with the thread that started it.
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = command.spawn().context("starting a sentinel")?;
        let mut sentinel = Sentinel {
            port,
            dir,
            child: Some(child),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if matches!(query(port, &["PING"]), Ok(Reply::Status(pong)) if pong == "PONG") {
                return Ok(sentinel);
            }
            if Instant::now() > deadline {
                let log = sentinel.log();
                sentinel.stop();
                bail!("the sentinel on port {port} did not answer PING: {log}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `redis://127.0.0.1:<port>`
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The port of the primary this sentinel names for `name` now.
    pub fn primary_port(&self, name: &str) -> Option<u16> {
        match query(self.port, &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", name]) {
            Ok(Reply::Array(parts)) => parts.get(1)?.text()?.parse().ok(),
            _ => None,
        }
    }

    /// The sentinel's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("sentinel.log")).unwrap_or_default()
    }

    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        self.stop();
    }
}
