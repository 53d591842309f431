//! A real nginx with Kong's `ngx_wasm_module` (a dynamic module) and a proxy-wasm filter, for end-to-end
//! tests: pick free loopback ports, render `nginx/sluice.conf.tmpl`, start, wait until every worker has
//! loaded the filter, stop on drop.
//!
//! `make test-nginx` sets `SLUICE_NGINX_MODULE` (the built `ngx_wasmx_module.so`); without it every
//! start fails with a message that says so. `SLUICE_NGINX` names the nginx binary (default: `nginx`
//! in `PATH`, else Debian's `/usr/sbin/nginx`); it must be the release the module was built against.
//! Each nginx gets its own temp dir (its prefix) with the rendered `nginx.conf`, `error.log` and the pid
//! file; a test that panics prints the log's last lines.
//!
//! ```no_run
//! use sluice_tests::nginx::{Filter, Nginx, NginxOptions};
//!
//! let nginx = Nginx::start(NginxOptions {
//!     filter: Filter::Sluice,
//!     plugin_config: r#"{"rules":[{"name":"per-ip","match":{"path_prefix":"/api/"},
//!         "key":["client_ip"],"limits":[{"requests":50,"per":"minute"}]}]}"#
//!         .to_owned(),
//!     workers: 4,
//!     ..NginxOptions::default()
//! })?;
//! let result = sluice_tests::envoy::burst(&nginx.url("/api/x"), 500, 16)?;
//! assert_eq!(result.count(200), 50);
//! # Ok::<(), anyhow::Error>(())
//! ```

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tempfile::TempDir;

use crate::envoy::{agent, free_ports, get, render, repo_root, wasm_path};

/// How long nginx may take until every worker has compiled the filter (each worker compiles its own
/// copy with Cranelift: seconds each on a busy two-core machine), or to give up on a bad configuration.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a stopped nginx may take to exit before it is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// Attempts when a picked port was taken by someone else before nginx bound it.
const BIND_ATTEMPTS: usize = 3;
/// What `ngx_wasm_module` logs once per worker when the module is compiled and instantiated.
const LOADED: &str = "successfully loaded \"sluice\" module";
/// What it logs when a filter's `on_configure` (or its start) failed in a worker.
const FAILED: &str = "failed initializing \"sluice\" filter";

/// Which proxy-wasm filter nginx runs as `sluice`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Filter {
    /// sluice itself (`SLUICE_WASM`, or the release build's `sluice_filter.wasm`).
    Sluice,
    /// The floor filter of the bench (`SLUICE_FLOOR_WASM`, or the release build's `sluice_floor.wasm`).
    Floor,
}

/// What to start.
#[derive(Debug, Clone)]
pub struct NginxOptions {
    pub filter: Filter,
    /// The filter's configuration, as `proxy_wasm sluice '<this>';` hands it over.
    pub plugin_config: String,
    /// `worker_processes`.
    pub workers: u32,
    /// `proxy_wasm_request_headers_in_access`: on, as `nginx/nginx.conf` ships. Off runs the
    /// filter's request hook in the rewrite phase, where ngx_wasm_module does not hold a paused
    /// request (docs/nginx.md).
    pub headers_in_access: bool,
    /// More directives of the `wasm {}` block (e.g. `tls_trusted_certificate ...;` for dispatches over TLS).
    pub wasm_directives: String,
}

impl Default for NginxOptions {
    fn default() -> Self {
        NginxOptions {
            filter: Filter::Sluice,
            plugin_config: r#"{"rules":[]}"#.to_owned(),
            workers: 2,
            headers_in_access: true,
            wasm_directives: String::new(),
        }
    }
}

/// How nginx refused a filter configuration: what it logged. The master stays up without workers
/// (they exit with "fatal code 2" and are not respawned), so the fixture stops it.
#[derive(Debug)]
pub struct NginxRefusal {
    pub log: String,
}

/// `$SLUICE_NGINX_MODULE`: the built `ngx_wasmx_module.so`. Unset is an error, never a silent skip.
pub fn nginx_module() -> Result<PathBuf> {
    let Some(path) = std::env::var_os("SLUICE_NGINX_MODULE") else {
        bail!(
            "SLUICE_NGINX_MODULE is not set: run the real-nginx tests with `make test-nginx`, which sets it \
             to the ngx_wasm_module build (see docs/nginx.md)"
        );
    };
    let path = PathBuf::from(path);
    if !path.is_file() {
        bail!("SLUICE_NGINX_MODULE={} is not a file", path.display());
    }
    Ok(path)
}

/// `$SLUICE_NGINX`, else `nginx` in `PATH`, else Debian's `/usr/sbin/nginx`.
pub fn nginx_binary() -> Result<PathBuf> {
    if let Some(path) = std::env::var_os("SLUICE_NGINX") {
        let path = PathBuf::from(path);
        if !path.is_file() {
            bail!("SLUICE_NGINX={} is not a file", path.display());
        }
        return Ok(path);
    }
    let in_path = std::env::var_os("PATH")
        .map(|paths| {
            std::env::split_paths(&paths)
                .map(|dir| dir.join("nginx"))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    in_path
        .into_iter()
        .chain([PathBuf::from("/usr/sbin/nginx")])
        .find(|p| p.is_file())
        .context("no nginx: set SLUICE_NGINX, or install Debian's nginx (`make test-nginx` does)")
}

/// `$SLUICE_FLOOR_WASM`, or the release build's default location: the bench's floor filter.
pub fn floor_wasm_path() -> Result<PathBuf> {
    let path = match std::env::var_os("SLUICE_FLOOR_WASM") {
        Some(path) => PathBuf::from(path),
        None => repo_root().join("target/wasm32-wasip1/release/sluice_floor.wasm"),
    };
    if !path.is_file() {
        bail!(
            "the floor filter {} does not exist: run `make build-filter`",
            path.display()
        );
    }
    Ok(path)
}

/// A value for an nginx single-quoted string: `\` and `'` escaped with `\`, the two escapes nginx's
/// parser undoes there (it also turns `\t`, `\r` and `\n` into control characters, hence `\\` first).
pub fn nginx_single_quoted(value: &str) -> String {
    value.replace('\\', "\\\\").replace('\'', "\\'")
}

/// A running nginx (master and workers), stopped when dropped.
#[derive(Debug)]
pub struct Nginx {
    child: Child,
    dir: TempDir,
    workers: u32,
    /// The edge server (with the filter under test).
    pub listen_port: u16,
    /// The built-in upstream server.
    pub upstream_port: u16,
}

impl Nginx {
    /// Starts nginx and waits (at most [`STARTUP_TIMEOUT`]) until every worker has loaded the filter
    /// and a worker answers outside it. A worker that failed the filter's configuration is an error.
    pub fn start(options: NginxOptions) -> Result<Nginx> {
        let mut attempt = 1;
        loop {
            let mut nginx = Nginx::launch(&options)?;
            match nginx.wait_until_ready() {
                Ok(()) => return Ok(nginx),
                Err(err) if attempt < BIND_ATTEMPTS && nginx.lost_a_port_race() => {
                    eprintln!("nginx: a picked port was taken ({err:#}); retrying with new ports");
                    attempt += 1;
                }
                Err(err) => return Err(err),
            }
        }
    }

    /// Starts nginx with a filter configuration it must refuse, and returns what it logged once a
    /// worker reported the failure. A filter that every worker accepted is an error.
    pub fn start_expect_failure(options: NginxOptions) -> Result<NginxRefusal> {
        let mut nginx = Nginx::launch(&options)?;
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        while Instant::now() < deadline {
            let log = nginx.log();
            if log.contains(FAILED) {
                return Ok(NginxRefusal { log });
            }
            if let Some(status) = nginx.child.try_wait()? {
                return Ok(NginxRefusal {
                    log: format!("{log}\n(nginx exited: {status})"),
                });
            }
            if nginx.loaded_workers(&log) >= nginx.workers && nginx.answers() {
                bail!("nginx accepted a configuration it should have refused; its log:\n{log}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        bail!(
            "nginx neither refused nor ran the filter within {STARTUP_TIMEOUT:?}; its log:\n{}",
            nginx.log()
        )
    }

    fn launch(options: &NginxOptions) -> Result<Nginx> {
        let module = nginx_module()?;
        let wasm = match options.filter {
            Filter::Sluice => wasm_path()?,
            Filter::Floor => floor_wasm_path()?,
        };
        let ports = free_ports(2)?;
        let (listen_port, upstream_port) = (ports[0], ports[1]);
        let dir = temp_prefix()?;
        let values = [
            ("MODULE", module.display().to_string()),
            ("USER", user_line().to_owned()),
            ("PREFIX", dir.path().display().to_string()),
            ("WORKERS", options.workers.to_string()),
            ("WASM", wasm.display().to_string()),
            ("LISTEN_PORT", listen_port.to_string()),
            ("UPSTREAM_PORT", upstream_port.to_string()),
            ("PLUGIN_CONFIG", nginx_single_quoted(&options.plugin_config)),
            (
                "HEADERS_IN_ACCESS",
                if options.headers_in_access {
                    "on"
                } else {
                    "off"
                }
                .to_owned(),
            ),
            ("WASM_DIRECTIVES", options.wasm_directives.clone()),
        ]
        .map(|(k, v)| (k.to_owned(), v));
        let template_path = template();
        let template = std::fs::read_to_string(&template_path)
            .with_context(|| format!("reading {}", template_path.display()))?;
        let config = render(&template, &values)
            .with_context(|| format!("rendering {}", template_path.display()))?;
        Nginx::spawn(
            dir,
            &config,
            &[],
            options.workers,
            listen_port,
            upstream_port,
        )
    }

    /// Starts nginx on a whole configuration, the one `config` returns for the nginx's temp dir (e.g.
    /// `nginx/nginx.conf` with its ports, module path and run dir edited: its pid file and error log
    /// must be `<dir>/nginx.pid` and `<dir>/error.log`), with the repository root as its prefix (`-p`)
    /// and working directory: its other relative paths are the repository's. `workers` is its `worker_processes`,
    /// `listen_port` the server with the filter; waits as [`Nginx::start`] does.
    pub fn start_config(
        config: impl FnOnce(&Path) -> Result<String>,
        workers: u32,
        listen_port: u16,
        upstream_port: u16,
    ) -> Result<Nginx> {
        let dir = temp_prefix()?;
        let text = config(dir.path())?;
        let mut args = vec!["-p".to_owned(), repo_root().display().to_string()];
        if !user_line().is_empty() {
            args.extend(["-g".to_owned(), user_line().to_owned()]);
        }
        let mut nginx = Nginx::spawn(dir, &text, &args, workers, listen_port, upstream_port)?;
        nginx.wait_until_ready()?;
        Ok(nginx)
    }

    /// Writes `config` into `dir` as `nginx.conf` and starts nginx on it (`-p dir` unless `args` say
    /// otherwise; the error log is `dir/error.log` either way).
    fn spawn(
        dir: TempDir,
        config: &str,
        args: &[String],
        workers: u32,
        listen_port: u16,
        upstream_port: u16,
    ) -> Result<Nginx> {
        let binary = nginx_binary()?;
        let config_path = dir.path().join("nginx.conf");
        std::fs::write(&config_path, config)
            .with_context(|| format!("writing {}", config_path.display()))?;
        // Before the error_log directive is read, nginx writes to stderr (and to its compiled-in log
        // path, which `-e` moves into the temp dir).
        let stderr = File::create(dir.path().join("stderr.log")).context("creating stderr.log")?;

        let mut command = Command::new(&binary);
        if args.iter().any(|a| a == "-p") {
            // ngx_wasm_module opens a relative module path from the working directory, not the prefix.
            command.current_dir(repo_root());
        } else {
            command.arg("-p").arg(dir.path());
        }
        command
            .args(args)
            .arg("-e")
            .arg(dir.path().join("error.log"))
            .arg("-c")
            .arg(&config_path)
            .stdin(Stdio::null())
            .stdout(stderr.try_clone()?)
            .stderr(stderr);
        // SAFETY: prctl is async-signal-safe and touches no memory of the parent. SIGTERM (nginx's fast
        // shutdown, which stops the workers too) when the thread that started nginx dies, so an
        // interrupted test run leaves no nginx behind; a SIGKILL would orphan the workers.
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        Ok(Nginx {
            child,
            dir,
            workers,
            listen_port,
            upstream_port,
        })
    }

    fn wait_until_ready(&mut self) -> Result<()> {
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "nginx exited ({status}) before it was ready; its log:\n{}",
                    self.log()
                );
            }
            let log = self.log();
            if log.contains(FAILED) {
                bail!("a worker failed to start the filter; nginx's log:\n{log}");
            }
            if self.loaded_workers(&log) >= self.workers && self.answers() {
                // A worker configures the filter right after loading it, before it accepts.
                let log = self.log();
                if log.contains(FAILED) {
                    bail!("a worker failed to start the filter; nginx's log:\n{log}");
                }
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        bail!(
            "nginx was not ready within {STARTUP_TIMEOUT:?}; its log:\n{}",
            self.log()
        )
    }

    fn loaded_workers(&self, log: &str) -> u32 {
        u32::try_from(log.matches(LOADED).count()).unwrap_or(u32::MAX)
    }

    fn answers(&self) -> bool {
        get(&agent(), &self.url("/nginx-ready"), &[]).is_ok_and(|r| r.status == 200)
    }

    fn lost_a_port_race(&self) -> bool {
        self.log().contains("Address already in use")
    }

    /// `http://127.0.0.1:<listen_port><path>`: through the filter under test.
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.listen_port)
    }

    /// Everything nginx logged so far (its error log, then what it wrote to stderr).
    pub fn log(&self) -> String {
        let read = |name: &str| std::fs::read_to_string(self.dir.path().join(name));
        let mut log = read("error.log").unwrap_or_default();
        log.push_str(&read("stderr.log").unwrap_or_default());
        log
    }

    /// The lines of the error log at `[error]`, `[crit]`, `[alert]` or `[emerg]`, with the line after
    /// each (a Wasm trap's backtrace starts there): for asserting that a run logged no host-call failure.
    pub fn errors(&self) -> Vec<String> {
        let log = self.log();
        let lines: Vec<&str> = log.lines().collect();
        lines
            .iter()
            .enumerate()
            .filter(|(_, l)| {
                ["[error]", "[crit]", "[alert]", "[emerg]"]
                    .iter()
                    .any(|level| l.contains(level))
            })
            .map(|(i, l)| match lines.get(i + 1) {
                Some(next) if next.starts_with(' ') => format!("{l}\n{next}"),
                _ => (*l).to_owned(),
            })
            .collect()
    }

    /// The temp dir: the rendered `nginx.conf`, `error.log`, the pid file.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The master's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Stops nginx (SIGTERM, then SIGKILL after [`STOP_TIMEOUT`]) and returns how the master exited.
    pub fn stop(&mut self) -> Result<ExitStatus> {
        if let Some(status) = self.child.try_wait()? {
            return Ok(status);
        }
        let pid = libc::pid_t::try_from(self.child.id()).context("pid out of range")?;
        // SAFETY: kill has no memory effects; the pid is our own child, not yet reaped.
        unsafe {
            libc::kill(pid, libc::SIGTERM);
        }
        let deadline = Instant::now() + STOP_TIMEOUT;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        Ok(self.child.wait()?)
    }
}

/// A temp dir for one nginx: its prefix (or, with [`Nginx::start_config`], its log and pid file).
fn temp_prefix() -> Result<TempDir> {
    tempfile::Builder::new()
        .prefix("sluice-nginx-")
        .tempdir()
        .context("creating a temp dir for nginx")
}

/// `user root;` when the tests run as root, else nothing. As root the master would hand its workers to
/// `nobody`, who cannot enter the 0700 temp dir: they stay the tests' user, as they are for anyone else.
fn user_line() -> &'static str {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        "user root;"
    } else {
        ""
    }
}

/// `nginx/sluice.conf.tmpl`.
pub fn template() -> PathBuf {
    repo_root().join("nginx").join("sluice.conf.tmpl")
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.stop();
        if std::thread::panicking() {
            let log = self.log();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            eprintln!("--- last lines of nginx's log ---");
            for line in tail.iter().rev() {
                eprintln!("{line}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_quotes_and_backslashes_for_nginx() {
        assert_eq!(
            nginx_single_quoted(r#"{"a":"it's \"q\" \n"}"#),
            r#"{"a":"it\'s \\"q\\" \\n"}"#
        );
    }

    #[test]
    fn the_template_has_no_placeholder_the_fixture_does_not_fill() {
        let text = std::fs::read_to_string(template()).unwrap();
        let values: Vec<(String, String)> = [
            "MODULE",
            "USER",
            "PREFIX",
            "WORKERS",
            "WASM",
            "LISTEN_PORT",
            "UPSTREAM_PORT",
            "PLUGIN_CONFIG",
            "HEADERS_IN_ACCESS",
            "WASM_DIRECTIVES",
        ]
        .iter()
        .map(|k| ((*k).to_owned(), "x".to_owned()))
        .collect();
        render(&text, &values).unwrap();
    }
}
