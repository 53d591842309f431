//! One Envoy process: rendered config in a temp dir, log file beside it, killed on drop.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tempfile::TempDir;

use super::client::{agent, get};
use super::paths::{envoy_binary, wasm_path};
use super::ports::free_ports;
use super::stats::{histogram_samples, Stats};
use super::template::{render_file, yaml_single_quoted, Template};

/// How long Envoy may take to become ready (or to give up on a bad configuration).
const STARTUP_TIMEOUT: Duration = Duration::from_secs(30);
/// Attempts when a picked port was taken by someone else before Envoy bound it.
const BIND_ATTEMPTS: usize = 3;
/// How long [`Envoy::stats_when`] waits: sluice's tick (1 s at most) with room for a busy machine.
const STATS_WAIT: Duration = Duration::from_secs(10);
/// How long [`Envoy::stat_settled`] wants a stat unchanged.
const STATS_STILL: Duration = Duration::from_secs(2);

/// What to start.
#[derive(Debug, Clone)]
pub struct EnvoyOptions {
    pub template: Template,
    /// sluice's JSON configuration, as Envoy hands it to the filter (`{{PLUGIN_CONFIG}}`).
    pub plugin_config_json: String,
    /// Envoy's worker threads (`--concurrency`).
    pub concurrency: u32,
    /// Values for the template's other placeholders, e.g. `("MAX_TOKENS", "50")`. A value given here for
    /// `LISTEN_PORT`, `ADMIN_PORT` or `UPSTREAM_PORT` fixes that port (otherwise a free one is picked).
    pub placeholders: Vec<(String, String)>,
}

impl Default for EnvoyOptions {
    fn default() -> Self {
        EnvoyOptions {
            template: Template::Sluice,
            plugin_config_json: r#"{"rules":[]}"#.to_owned(),
            concurrency: 2,
            placeholders: Vec::new(),
        }
    }
}

/// How Envoy refused a configuration: its exit status and everything it logged.
#[derive(Debug)]
pub struct EnvoyRefusal {
    pub status: ExitStatus,
    pub log: String,
}

/// A running Envoy, killed when dropped.
#[derive(Debug)]
pub struct Envoy {
    child: Child,
    dir: TempDir,
    /// The edge listener (with the filter under test).
    pub listen_port: u16,
    /// The admin interface.
    pub admin_port: u16,
    /// The built-in upstream listener.
    pub upstream_port: u16,
}

impl Envoy {
    /// Starts Envoy and waits (at most 30 s) until its admin interface says `LIVE`.
    pub fn start(options: EnvoyOptions) -> Result<Envoy> {
        // With every port given there is nothing to pick again.
        let fixed = ["LISTEN_PORT", "ADMIN_PORT", "UPSTREAM_PORT"]
            .iter()
            .all(|name| options.placeholders.iter().any(|(key, _)| key == name));
        let attempts = if fixed { 1 } else { BIND_ATTEMPTS };
        let mut attempt = 1;
        loop {
            let mut envoy = Envoy::launch(&options)?;
            match envoy.wait_until_live() {
                Ok(()) => return Ok(envoy),
                Err(err) if attempt < attempts && envoy.lost_a_port_race() => {
                    eprintln!("envoy: a picked port was taken ({err:#}); retrying with new ports");
                    attempt += 1;
                }
                Err(err) => return Err(err),
            }
        }
    }

    /// Starts Envoy on a configuration it must refuse, and returns how it exited (at most 30 s). An Envoy
    /// that becomes ready instead is an error.
    pub fn start_expect_failure(options: EnvoyOptions) -> Result<EnvoyRefusal> {
        let mut envoy = Envoy::launch(&options)?;
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        let admin = agent();
        while Instant::now() < deadline {
            if let Some(status) = envoy.child.try_wait()? {
                return Ok(EnvoyRefusal {
                    status,
                    log: envoy.log(),
                });
            }
            if envoy.is_live(&admin) {
                bail!(
                    "Envoy accepted a configuration it should have refused; its log:\n{}",
                    envoy.log()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        bail!(
            "Envoy neither exited nor became ready within {STARTUP_TIMEOUT:?}; its log:\n{}",
            envoy.log()
        )
    }

    fn launch(options: &EnvoyOptions) -> Result<Envoy> {
        let binary = envoy_binary()?;
        let ports = free_ports(3)?;
        let given = |name: &str, free: u16| -> Result<u16> {
            match options.placeholders.iter().find(|(key, _)| key == name) {
                Some((_, value)) => value
                    .parse()
                    .with_context(|| format!("{name} = {value:?} is not a port")),
                None => Ok(free),
            }
        };
        let listen_port = given("LISTEN_PORT", ports[0])?;
        let admin_port = given("ADMIN_PORT", ports[1])?;
        let upstream_port = given("UPSTREAM_PORT", ports[2])?;
        let mut values = vec![
            ("LISTEN_PORT".to_owned(), listen_port.to_string()),
            ("ADMIN_PORT".to_owned(), admin_port.to_string()),
            ("UPSTREAM_PORT".to_owned(), upstream_port.to_string()),
            (
                "PLUGIN_CONFIG".to_owned(),
                yaml_single_quoted(&options.plugin_config_json),
            ),
        ];
        if matches!(
            options.template,
            Template::Sluice | Template::SluiceService | Template::Shedding
        ) {
            values.push(("WASM".to_owned(), wasm_path()?.display().to_string()));
        }
        values.extend(options.placeholders.iter().cloned());
        let config = render_file(&options.template, &values)?;

        let dir = tempfile::Builder::new()
            .prefix("sluice-envoy-")
            .tempdir()
            .context("creating a temp dir for Envoy")?;
        let config_path = dir.path().join("envoy.yaml");
        std::fs::write(&config_path, config)
            .with_context(|| format!("writing {}", config_path.display()))?;
        let log = File::create(dir.path().join("envoy.log")).context("creating envoy.log")?;

        let mut command = Command::new(&binary);
        command
            .arg("-c")
            .arg(&config_path)
            .arg("--concurrency")
            .arg(options.concurrency.to_string())
            .args(["--log-level", "info", "--disable-hot-restart"])
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        // SAFETY: prctl is async-signal-safe and touches no memory of the parent. SIGKILL when the thread that
        // started Envoy dies, so an interrupted test run leaves no Envoy behind.
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        Ok(Envoy {
            child,
            dir,
            listen_port,
            admin_port,
            upstream_port,
        })
    }

    fn wait_until_live(&mut self) -> Result<()> {
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        let admin = agent();
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "Envoy exited ({status}) before it was ready; its log:\n{}",
                    self.log()
                );
            }
            if self.is_live(&admin) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        bail!(
            "Envoy was not ready within {STARTUP_TIMEOUT:?}; its log:\n{}",
            self.log()
        )
    }

    fn is_live(&self, admin: &ureq::Agent) -> bool {
        get(admin, &self.admin_url("/ready"), &[])
            .is_ok_and(|r| r.status == 200 && r.body.trim() == "LIVE")
    }

    fn lost_a_port_race(&self) -> bool {
        let log = self.log();
        log.contains("Address already in use") || log.contains("cannot bind")
    }

    /// `http://127.0.0.1:<listen_port><path>`: through the filter under test.
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.listen_port)
    }

    /// `http://127.0.0.1:<admin_port><path>`.
    pub fn admin_url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.admin_port)
    }

    /// All statistics, from the admin interface.
    pub fn stats(&self) -> Result<Stats> {
        let reply = get(&agent(), &self.admin_url("/stats"), &[])?;
        if reply.status != 200 {
            bail!("GET /stats answered {}: {}", reply.status, reply.body);
        }
        Ok(Stats::parse(&reply.body))
    }

    /// The counter `name` (e.g. `wasmcustom.sluice.rule.per-ip.allowed`), if Envoy has it.
    pub fn counter(&self, name: &str) -> Result<Option<u64>> {
        Ok(self.stats()?.counter(name))
    }

    /// The counter or gauge `name`, 0 while Envoy does not have it yet (panics if the admin
    /// endpoint does not answer: for tests).
    pub fn stat(&self, name: &str) -> u64 {
        match self.counter(name) {
            Ok(value) => value.unwrap_or(0),
            Err(error) => panic!("reading {name} from Envoy's admin: {error:#}"),
        }
    }

    /// Envoy's stats once `ready` holds for them, or the last ones read after [`STATS_WAIT`]:
    /// sluice adds its requests' counters (a rule's outcomes, charged tokens, bypassed) to Envoy's
    /// stats on its next tick, a second at most after the request. Panics if the admin endpoint
    /// does not answer (for tests).
    pub fn stats_when(&self, ready: impl Fn(&Stats) -> bool) -> Stats {
        let deadline = Instant::now() + STATS_WAIT;
        loop {
            let stats = match self.stats() {
                Ok(stats) => stats,
                Err(error) => panic!("reading Envoy's stats: {error:#}"),
            };
            if ready(&stats) || Instant::now() > deadline {
                return stats;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The counter or gauge `name` once every request sent before the call is in it: once it held
    /// still for [`STATS_STILL`] (two of sluice's ticks, 1 s at most each), or after [`STATS_WAIT`].
    /// For a count that must not have moved; when the count to expect is known,
    /// [`stat_reaching`](Self::stat_reaching) returns sooner.
    pub fn stat_settled(&self, name: &str) -> u64 {
        let deadline = Instant::now() + STATS_WAIT;
        let mut last = self.stat(name);
        let mut since = Instant::now();
        while since.elapsed() < STATS_STILL && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
            let now = self.stat(name);
            if now != last {
                (last, since) = (now, Instant::now());
            }
        }
        last
    }

    /// The counter or gauge `name` once it reached `at_least`, or its value after [`STATS_WAIT`]
    /// (see [`stats_when`](Self::stats_when)): assert on the value returned.
    pub fn stat_reaching(&self, name: &str, at_least: u64) -> u64 {
        let stats = self.stats_when(|s| s.counter(name).unwrap_or(0) >= at_least);
        stats.counter(name).unwrap_or(0)
    }

    /// How many samples the histogram `name` holds (e.g. `wasmcustom.sluice.shed.api.latency_ms`), 0 while it
    /// has none. Envoy merges histograms on a flush: with `stats_flush_on_admin` (as in `shedding.yaml.tmpl`) a
    /// read starts one, so poll (see [`crate::eventually`]).
    pub fn histogram_samples(&self, name: &str) -> Result<u64> {
        let reply = get(
            &agent(),
            &self.admin_url("/stats?histogram_buckets=detailed"),
            &[],
        )?;
        if reply.status != 200 {
            bail!("GET /stats answered {}: {}", reply.status, reply.body);
        }
        Ok(histogram_samples(&reply.body, name).unwrap_or(0))
    }

    /// sluice's own stats (`wasmcustom.sluice.*`), for assert messages.
    pub fn sluice_stats(&self) -> Vec<(String, String)> {
        match self.stats() {
            Ok(stats) => stats
                .matching("wasmcustom.sluice")
                .into_iter()
                .map(|(n, v)| (n.to_owned(), v.to_owned()))
                .collect(),
            Err(error) => vec![("error".to_owned(), format!("{error:#}"))],
        }
    }

    /// Envoy's release as (major, minor, patch), from its admin `/server_info` (`"version":
    /// "<commit>/1.40.0/Clean/RELEASE/BoringSSL"`): for the few expectations that differ between the supported
    /// releases.
    pub fn version(&self) -> Result<(u32, u32, u32)> {
        let reply = get(&agent(), &self.admin_url("/server_info"), &[])?;
        if reply.status != 200 {
            bail!("GET /server_info answered {}: {}", reply.status, reply.body);
        }
        let info = reply.json()?;
        let full = info["version"].as_str().unwrap_or_default();
        full.split('/')
            .nth(1)
            .and_then(|release| {
                let mut parts = release.split('.').map(|p| p.parse::<u32>().ok());
                Some((parts.next()??, parts.next()??, parts.next()??))
            })
            .with_context(|| format!("no release in /server_info's version {full:?}"))
    }

    /// Whether the process is running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Bytes the Envoy process has allocated on its heap, as its admin `/memory` reports them (`allocated`): where
    /// Envoy keeps Wasm shared data and shared queues.
    pub fn allocated_bytes(&self) -> Result<u64> {
        let reply = get(&agent(), &self.admin_url("/memory"), &[])?;
        if reply.status != 200 {
            bail!("GET /memory answered {}: {}", reply.status, reply.body);
        }
        let memory = reply.json()?;
        // The admin interface writes these 64-bit numbers as JSON strings.
        memory["allocated"]
            .as_str()
            .and_then(|s| s.parse().ok())
            .or_else(|| memory["allocated"].as_u64())
            .with_context(|| format!("no `allocated` in /memory: {}", reply.body))
    }

    /// The process's resident set size (`VmRSS` of `/proc/<pid>/status`), in bytes: includes what the heap does
    /// not, such as the Wasm VMs' linear memories.
    pub fn rss_bytes(&self) -> Result<u64> {
        crate::rss_bytes(self.pid())
            .with_context(|| format!("no VmRSS in /proc/{}/status", self.pid()))
    }

    /// Everything Envoy logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// The log file (inside a temp dir removed on drop).
    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("envoy.log")
    }

    /// The temp dir with the rendered `envoy.yaml` and `envoy.log`.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            let log = self.log();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            eprintln!("--- last lines of Envoy's log ---");
            for line in tail.iter().rev() {
                eprintln!("{line}");
            }
        }
    }
}
