//! One running service process.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tempfile::TempDir;

use super::binary::service_binary;
use super::client::{agent, send, Reply};

/// How to start the service.
#[derive(Debug, Clone)]
pub struct ServiceOptions {
    /// `--redis-url`: one URL, or comma-separated cluster nodes.
    pub redis_url: String,
    /// The token (`SLUICE_TOKEN`).
    pub token: String,
    /// More flags, e.g. `["--redis-timeout-ms", "200"]`.
    pub args: Vec<String>,
    /// Where to listen; `None`: a free loopback port.
    pub bind: Option<SocketAddr>,
    /// The service's `RUST_LOG`.
    pub log_filter: String,
    /// HTTPS: the certificate and key it serves (`--tls-cert-file`, `--tls-key-file`) and the
    /// authority the fixture's own client trusts; `None`: plain HTTP.
    pub tls: Option<ServiceTls>,
    /// More environment variables (e.g. `SLUICE_REDIS_PASSWORD`).
    pub env: Vec<(String, String)>,
    /// Envoy's rate limit service too, on a free loopback port (`--grpc-bind`), with this
    /// descriptor configuration (`--rls-config`).
    pub rls_config: Option<PathBuf>,
}

/// What a service started with HTTPS serves, and what its test client trusts.
#[derive(Debug, Clone)]
pub struct ServiceTls {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    pub ca_pem: String,
}

impl ServiceOptions {
    pub fn new(redis_url: impl Into<String>) -> ServiceOptions {
        ServiceOptions {
            redis_url: redis_url.into(),
            token: format!("test-token-{}", std::process::id()),
            args: Vec::new(),
            bind: None,
            log_filter: "info".to_owned(),
            tls: None,
            env: Vec::new(),
            rls_config: None,
        }
    }

    /// Serves Envoy's rate limit service too, with the descriptors of `config` (a file).
    pub fn rls(mut self, config: impl Into<PathBuf>) -> ServiceOptions {
        self.rls_config = Some(config.into());
        self
    }

    /// Serves HTTPS with `tls`'s certificate; the fixture's client trusts its authority.
    pub fn tls(mut self, tls: ServiceTls) -> ServiceOptions {
        self.tls = Some(tls);
        self
    }

    pub fn arg(mut self, arg: impl Into<String>) -> ServiceOptions {
        self.args.push(arg.into());
        self
    }

    /// One more environment variable for the service.
    pub fn env(mut self, name: &str, value: &str) -> ServiceOptions {
        self.env.push((name.to_owned(), value.to_owned()));
        self
    }
}

/// A running `sluice-counter-service`, killed on drop.
pub struct Service {
    options: ServiceOptions,
    binary: PathBuf,
    dir: TempDir,
    address: Option<SocketAddr>,
    grpc_address: Option<SocketAddr>,
    child: Option<Child>,
    agent: ureq::Agent,
}

impl Service {
    /// Starts the service for the Redis at `redis_url` with a generated token.
    pub fn start(redis_url: &str) -> Result<Service> {
        Service::start_with(ServiceOptions::new(redis_url))
    }

    /// Starts the service on a free loopback port and waits until `/healthz` answers 200.
    pub fn start_with(options: ServiceOptions) -> Result<Service> {
        let agent = match &options.tls {
            Some(tls) => crate::certs::agent_trusting(&tls.ca_pem)?,
            None => agent(),
        };
        let mut service = Service {
            options,
            binary: service_binary()?,
            dir: tempfile::Builder::new()
                .prefix("sluice-service-")
                .tempdir()?,
            address: None,
            grpc_address: None,
            child: None,
            agent,
        };
        service.restart()?;
        Ok(service)
    }

    /// `127.0.0.1:<port>` (kept across restarts).
    pub fn address(&self) -> Option<SocketAddr> {
        self.address
    }

    /// Where the rate limit service listens (kept across restarts), if it was asked for.
    pub fn grpc_address(&self) -> Option<SocketAddr> {
        self.grpc_address
    }

    /// `http://127.0.0.1:<port>` (`https://` when it serves TLS).
    pub fn url(&self) -> String {
        let scheme = match self.options.tls {
            Some(_) => "https",
            None => "http",
        };
        match self.address {
            Some(address) => format!("{scheme}://{address}"),
            None => format!("{scheme}://127.0.0.1:0"),
        }
    }

    pub fn token(&self) -> &str {
        &self.options.token
    }

    /// The service's log file (stderr; inside a temp dir removed on drop).
    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("service.log")
    }

    /// The process id, while the service runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The service's log (stderr) so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// The value of the first sample of `/metrics` whose line names `name` (a counter's
    /// `sluice_..._total`, a gauge); 0 if the service does not run or has no such sample.
    pub fn metric(&self, name: &str) -> u64 {
        let Ok(reply) = self.get("/metrics") else {
            return 0;
        };
        reply
            .body
            .lines()
            .find(|l| l.contains(name) && !l.starts_with('#'))
            .and_then(|l| l.split_whitespace().last())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    }

    /// `GET path` without a token.
    pub fn get(&self, path: &str) -> Result<Reply> {
        send(
            &self.agent,
            "GET",
            &format!("{}{path}", self.url()),
            None,
            None,
        )
    }

    /// `POST path` with `body` and the service's token.
    pub fn post(&self, path: &str, body: &str) -> Result<Reply> {
        self.post_with_token(path, body, Some(self.token()))
    }

    /// `POST path` with `body` and the given token (or none).
    pub fn post_with_token(&self, path: &str, body: &str, token: Option<&str>) -> Result<Reply> {
        send(
            &self.agent,
            "POST",
            &format!("{}{path}", self.url()),
            token,
            Some(body),
        )
    }

    /// `method path` (GET, POST, PUT, DELETE) with `body` and the given token (or none): the
    /// admin API.
    pub fn request(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<&str>,
    ) -> Result<Reply> {
        send(
            &self.agent,
            method,
            &format!("{}{path}", self.url()),
            token,
            body,
        )
    }

    /// Whether the process is running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.as_mut().map(|c| c.try_wait()), Some(Ok(None)))
    }

    /// Kills the service (SIGKILL) and waits for it to exit.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Asks the service to stop (SIGTERM) and waits up to `within` for it to exit; its status.
    pub fn terminate(&mut self, within: Duration) -> Result<std::process::ExitStatus> {
        let Some(mut child) = self.child.take() else {
            bail!("the service is not running");
        };
        // SAFETY: kill(2) on the pid of a child we own and have not reaped.
        unsafe {
            libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
        }
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = child.try_wait()? {
                return Ok(status);
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                bail!("the service did not exit within {within:?} of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Starts the service again (on the same port once it had one) and waits for `/healthz`.
    pub fn restart(&mut self) -> Result<()> {
        self.kill();
        let bind = match self.address.or(self.options.bind) {
            Some(address) => address.to_string(),
            None => "127.0.0.1:0".to_owned(),
        };
        let log = File::create(self.dir.path().join("service.log"))?;
        let mut command = Command::new(&self.binary);
        command
            .args(["--bind", &bind, "--redis-url", &self.options.redis_url])
            // The environment, not a flag: flags show in the process list.
            .env("SLUICE_TOKEN", &self.options.token)
            .args(&self.options.args)
            .args(self.options.tls.iter().flat_map(|tls| {
                [
                    "--tls-cert-file".as_ref(),
                    tls.cert_file.as_os_str(),
                    "--tls-key-file".as_ref(),
                    tls.key_file.as_os_str(),
                ]
            }))
            .args(
                self.options
                    .rls_config
                    .iter()
                    .flat_map(|config| {
                        let grpc = self
                            .grpc_address
                            .map_or("127.0.0.1:0".to_owned(), |a| a.to_string());
                        [
                            "--grpc-bind".into(),
                            grpc.into(),
                            "--rls-config".into(),
                            config.as_os_str().to_owned(),
                        ]
                    })
                    .collect::<Vec<std::ffi::OsString>>(),
            )
            .env("RUST_LOG", &self.options.log_filter)
            .envs(self.options.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log);
        // SAFETY: prctl is async-signal-safe; the service dies with the thread that started it.
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = command
            .spawn()
            .with_context(|| format!("starting {}", self.binary.display()))?;
        let stdout = child.stdout.take().context("no stdout")?;
        self.child = Some(child);

        // The service prints `... listening on <address>` once bound; keep draining after.
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(address) = line.rsplit(' ').next() {
                    if line.contains("listening on") {
                        let grpc = line.contains("rate limit service");
                        let _ = tx.send((grpc, address.to_owned()));
                    }
                }
            }
        });
        let wanted = 1 + usize::from(self.options.rls_config.is_some());
        for _ in 0..wanted {
            let (grpc, address) = match rx.recv_timeout(Duration::from_secs(20)) {
                Ok(line) => line,
                Err(_) => {
                    self.kill();
                    bail!("the service did not start listening: {}", self.log());
                }
            };
            let address = Some(address.parse().context("the service's listening address")?);
            match grpc {
                true => self.grpc_address = address,
                false => self.address = address,
            }
        }
        self.wait_for_health(Duration::from_secs(10))
    }

    fn wait_for_health(&mut self, within: Duration) -> Result<()> {
        let deadline = Instant::now() + within;
        loop {
            if matches!(self.get("/healthz"), Ok(reply) if reply.status == 200) {
                return Ok(());
            }
            if Instant::now() > deadline {
                self.kill();
                bail!("/healthz did not answer 200 in {within:?}: {}", self.log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.kill();
    }
}
