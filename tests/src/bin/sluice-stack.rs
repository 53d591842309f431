//! `sluice-stack`: the whole stack for a developer, from the test fixtures: Redis, the counter service on it, and
//! N Envoys with sluice from a configuration of `envoy/demo.yaml`'s shape, all on 127.0.0.1. Prints one JSON line
//! with what it started, then stays in the foreground until SIGINT, SIGTERM or SIGHUP, or until its stdin closes
//! (when stdin is a pipe or a socket; a terminal or `/dev/null` is not watched), and stops everything it started.
//! Whatever it started also dies with it if it is killed (`PR_SET_PDEATHSIG`), and it stops everything when
//! Redis, the service or an Envoy exits on its own.
//!
//! `make run` starts the demo with it, and `bench/service.py` and `bench/latency.py` their Redis and counter
//! service. The environment names the parts as for the tests: `SLUICE_ENVOY`, `SLUICE_WASM`,
//! `SLUICE_REDIS_SERVER`, `SLUICE_SERVICE_BIN`; `SLUICE_TOKEN` the service's token and `RUST_LOG` its log filter.

use std::fs::{File, OpenOptions};
use std::io::{IsTerminal, Read, Write};
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use sluice_tests::certs::Authority;
use sluice_tests::envoy::{replace_exactly, repo_root, Demo, Envoy};
use sluice_tests::redis::Redis;
use sluice_tests::service::{Service, ServiceOptions, ServiceTls};

const USAGE: &str = "\
usage: sluice-stack [--proxies N] [--config FILE] [--concurrency N] [--free-ports] [--redis-port PORT]
                    [--run-dir DIR] [--tls] [--hints] [-- SERVICE-FLAG...]

  --proxies N        Envoys to start, 0 to 8 (default 1); all share the counter service
  --config FILE      the Envoys' configuration, of envoy/demo.yaml's shape (default: envoy/demo.yaml)
  --concurrency N    worker threads per Envoy (default 2)
  --free-ports       the service and every Envoy on free loopback ports; otherwise the configuration's own
                     ports (edge 10000, upstream 10001, admin 9901, service 8081); each further proxy's
                     edge and upstream 100 higher, its admin 10 higher (the second: 10100, 10101, 9911)
  --redis-port PORT  Redis's port (default: a free one)
  --run-dir DIR      where the token file and the pid file go, and the logs when it stops (default: a temp dir)
  --tls              the counter service over HTTPS: a CA made for this run (RUN-DIR/tls/ca.pem) signs its
                     certificate for sluice-service.internal and 127.0.0.1 (RUN-DIR/tls/service.pem, .key), and
                     every Envoy's cluster sluice_service sends that name and trusts only that CA
  --hints            print the demo's curl lines to stderr once everything is up
  -- SERVICE-FLAG... more flags for the counter service, e.g. -- --redis-timeout-ms 1000";

/// Envoys at most: a bound, far above what a laptop runs.
const MAX_PROXIES: usize = 8;
/// `envoy/demo.yaml`'s own ports: edge, admin, upstream, and the counter service's.
const DEMO_LISTEN: u16 = 10000;
const DEMO_ADMIN: u16 = 9901;
const DEMO_UPSTREAM: u16 = 10001;
const DEMO_SERVICE: u16 = 8081;
/// How far each further proxy's ports are moved: edge and upstream by 100 (10100, 10101), admin by 10 (9911).
const PORT_STEP: u16 = 100;
const ADMIN_STEP: u16 = 10;
const POLL: Duration = Duration::from_millis(100);
/// The name the counter service's certificate carries with `--tls`, and that the Envoys send and require
/// (`envoy/production.yaml`'s).
const SERVICE_NAME: &str = "sluice-service.internal";
/// The cluster `sluice_service` of `envoy/demo.yaml`'s shape, as it starts.
const SERVICE_CLUSTER: &str = "  - name: sluice_service\n    type: STATIC\n";

/// The files of `--tls`, under the run directory's `tls/`.
struct TlsFiles {
    ca_file: PathBuf,
    cert_file: PathBuf,
    key_file: PathBuf,
    ca_pem: String,
}

/// A CA of this run's own and the certificate it signs for the service (the key readable by the owner only).
fn make_tls_files(run_dir: &Path) -> Result<TlsFiles> {
    let dir = run_dir.join("tls");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let ca = Authority::new("demo")?;
    let issued = ca.issue("service", &[SERVICE_NAME, "127.0.0.1"])?;
    let files = TlsFiles {
        ca_file: dir.join("ca.pem"),
        cert_file: dir.join("service.pem"),
        key_file: dir.join("service.key"),
        ca_pem: ca.ca_pem.clone(),
    };
    std::fs::write(&files.ca_file, &ca.ca_pem)
        .with_context(|| format!("writing {}", files.ca_file.display()))?;
    std::fs::write(&files.cert_file, &issued.cert_pem)
        .with_context(|| format!("writing {}", files.cert_file.display()))?;
    let key = std::fs::read_to_string(&issued.key_file)?;
    write_private(&files.key_file, &key)?;
    Ok(files)
}

/// `yaml` (`envoy/demo.yaml`'s shape) with its cluster `sluice_service` speaking TLS: the service's name sent (SNI)
/// and required of its certificate, `ca_file` the one CA trusted.
fn with_tls_to_the_service(yaml: &str, ca_file: &Path) -> Result<String> {
    let tls = format!(
        "{SERVICE_CLUSTER}    transport_socket:\n      name: envoy.transport_sockets.tls\n      typed_config:\n        \
         \"@type\": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext\n        \
         sni: {SERVICE_NAME}\n        common_tls_context:\n          validation_context:\n            \
         trusted_ca: {{ filename: \"{}\" }}\n            match_typed_subject_alt_names:\n            \
         - san_type: DNS\n              matcher: {{ exact: {SERVICE_NAME} }}\n",
        ca_file.display()
    );
    replace_exactly(yaml, SERVICE_CLUSTER, &tls, 1).context("the cluster sluice_service")
}

#[derive(Debug)]
struct Args {
    proxies: usize,
    config: PathBuf,
    concurrency: u32,
    free_ports: bool,
    redis_port: Option<u16>,
    run_dir: Option<PathBuf>,
    tls: bool,
    hints: bool,
    service_args: Vec<String>,
}

fn parse_args(mut args: impl Iterator<Item = String>) -> Result<Option<Args>> {
    let mut parsed = Args {
        proxies: 1,
        config: repo_root().join("envoy/demo.yaml"),
        concurrency: 2,
        free_ports: false,
        redis_port: None,
        run_dir: None,
        tls: false,
        hints: false,
        service_args: Vec::new(),
    };
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().with_context(|| format!("{name} needs a value"));
        match arg.as_str() {
            "-h" | "--help" => return Ok(None),
            "--proxies" => {
                parsed.proxies = value("--proxies")?.parse().context("--proxies")?;
                if parsed.proxies > MAX_PROXIES {
                    bail!("--proxies: at most {MAX_PROXIES}");
                }
            }
            "--config" => parsed.config = value("--config")?.into(),
            "--concurrency" => {
                parsed.concurrency = value("--concurrency")?.parse().context("--concurrency")?;
            }
            "--free-ports" => parsed.free_ports = true,
            "--redis-port" => {
                parsed.redis_port = Some(value("--redis-port")?.parse().context("--redis-port")?);
            }
            "--run-dir" => parsed.run_dir = Some(value("--run-dir")?.into()),
            "--tls" => parsed.tls = true,
            "--hints" => parsed.hints = true,
            "--" => {
                parsed.service_args = args.by_ref().collect();
            }
            other => bail!("unknown argument {other:?}"),
        }
    }
    Ok(Some(parsed))
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_signal: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

/// SIGINT, SIGTERM and SIGHUP set [`STOP`] (restarting interrupted reads); the children get the default handlers
/// back when they exec.
fn catch_stop_signals() -> Result<()> {
    for signal in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: a zeroed sigaction is valid; the handler only stores to an atomic, which is async-signal-safe.
        let failed = unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, std::ptr::null_mut()) != 0
        };
        if failed {
            bail!("sigaction({signal}): {}", std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// When stdin is a pipe or a socket: a flag set once it reaches its end (the caller closed it or died).
fn watch_stdin() -> Result<Option<Arc<AtomicBool>>> {
    let stdin = std::io::stdin();
    if stdin.is_terminal() {
        return Ok(None);
    }
    let kind = File::from(stdin.as_fd().try_clone_to_owned()?)
        .metadata()?
        .file_type();
    if !(kind.is_fifo() || kind.is_socket()) {
        return Ok(None);
    }
    let closed = Arc::new(AtomicBool::new(false));
    let flag = closed.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 1024];
        let mut stdin = std::io::stdin().lock();
        loop {
            match stdin.read(&mut buf) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        flag.store(true, Ordering::SeqCst);
    });
    Ok(Some(closed))
}

/// What is running; dropped Envoys first, Redis last (fields drop in order).
struct Stack {
    envoys: Vec<Envoy>,
    service: Service,
    redis: Redis,
}

impl Stack {
    /// The first part that is no longer running, with its log.
    fn exited(&mut self) -> Option<(String, PathBuf)> {
        for (i, envoy) in self.envoys.iter_mut().enumerate() {
            if !envoy.is_running() {
                return Some((format!("Envoy {}", i + 1), envoy.log_path()));
            }
        }
        if !self.service.is_running() {
            return Some(("the counter service".into(), self.service.log_path()));
        }
        if !self.redis.is_running() {
            return Some(("Redis".into(), self.redis.log_path()));
        }
        None
    }

    fn describe(&self, token_file: &Path, run_dir: &Path) -> Value {
        let service_port = self.service.address().map(|a| a.port());
        json!({
            "pid": std::process::id(),
            "run_dir": run_dir,
            "token_file": token_file,
            "redis": {
                "port": self.redis.port(),
                "pid": self.redis.pid(),
                "url": self.redis.url(),
                "log": self.redis.log_path(),
            },
            "service": {
                "port": service_port,
                "pid": self.service.pid(),
                "url": self.service.url(),
                "log": self.service.log_path(),
            },
            "envoys": self.envoys.iter().map(|envoy| json!({
                "port": envoy.listen_port,
                "admin_port": envoy.admin_port,
                "upstream_port": envoy.upstream_port,
                "pid": envoy.pid(),
                "log": envoy.log_path(),
                "config": envoy.dir().join("envoy.yaml"),
            })).collect::<Vec<_>>(),
        })
    }

    /// Stops everything, Envoys first; with `keep_logs`, each log is copied there first.
    fn stop(mut self, keep_logs: Option<&Path>) {
        for (i, envoy) in self.envoys.drain(..).enumerate() {
            if let Some(dir) = keep_logs {
                copy_log(&envoy.log_path(), &dir.join(format!("envoy-{}.log", i + 1)));
            }
            drop(envoy);
        }
        self.service.kill();
        self.redis.stop();
        if let Some(dir) = keep_logs {
            copy_log(&self.service.log_path(), &dir.join("service.log"));
            copy_log(&self.redis.log_path(), &dir.join("redis.log"));
        }
    }
}

fn copy_log(from: &Path, to: &Path) {
    if let Err(error) = std::fs::copy(from, to) {
        eprintln!("sluice-stack: keeping {}: {error}", to.display());
    }
}

/// The token: `$SLUICE_TOKEN`, else the one in sluice's configuration, else a fresh random one.
fn pick_token(plugin_config: Option<&Value>) -> Result<String> {
    if let Some(token) = std::env::var("SLUICE_TOKEN").ok().filter(|t| !t.is_empty()) {
        return Ok(token);
    }
    if let Some(token) = plugin_config.and_then(|c| c["service"]["token"].as_str()) {
        return Ok(token.to_owned());
    }
    let mut bytes = [0u8; 16];
    File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Writes `text` to `path`, readable by the owner only.
fn write_private(path: &Path, text: &str) -> Result<()> {
    OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .with_context(|| format!("writing {}", path.display()))
}

fn start(
    args: &Args,
    demo: Option<&Demo>,
    plugin_config: &str,
    token: &str,
    tls: Option<&TlsFiles>,
) -> Result<Stack> {
    let redis = match args.redis_port {
        Some(port) => Redis::start_on(port, &[]),
        None => Redis::start(),
    }
    .context("starting Redis")?;
    let mut options = ServiceOptions::new(redis.url());
    options.token = token.to_owned();
    options.args = args.service_args.clone();
    if !args.free_ports {
        options.bind = Some(SocketAddr::from(([127, 0, 0, 1], DEMO_SERVICE)));
    }
    if let Some(filter) = std::env::var("RUST_LOG").ok().filter(|f| !f.is_empty()) {
        options.log_filter = filter;
    }
    if let Some(tls) = tls {
        options = options.tls(ServiceTls {
            cert_file: tls.cert_file.clone(),
            key_file: tls.key_file.clone(),
            ca_pem: tls.ca_pem.clone(),
        });
    }
    let service = Service::start_with(options).context("starting the counter service")?;
    let service_port = service.address().context("the service's address")?.port();
    let mut envoys = Vec::new();
    if let Some(demo) = demo {
        for k in 0..args.proxies {
            let mut options =
                demo.options(plugin_config.to_owned(), args.concurrency, service_port)?;
            if !args.free_ports {
                let k = k as u16;
                for (name, port) in [
                    ("LISTEN_PORT", DEMO_LISTEN + PORT_STEP * k),
                    ("ADMIN_PORT", DEMO_ADMIN + ADMIN_STEP * k),
                    ("UPSTREAM_PORT", DEMO_UPSTREAM + PORT_STEP * k),
                ] {
                    options
                        .placeholders
                        .push((name.to_owned(), port.to_string()));
                }
            }
            let envoy =
                Envoy::start(options).with_context(|| format!("starting Envoy {}", k + 1))?;
            envoys.push(envoy);
        }
    }
    Ok(Stack {
        envoys,
        service,
        redis,
    })
}

fn run(args: Args) -> Result<bool> {
    let temp;
    let run_dir = match &args.run_dir {
        Some(dir) => {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            std::path::absolute(dir)?
        }
        None => {
            temp = tempfile::Builder::new().prefix("sluice-stack-").tempdir()?;
            temp.path().to_path_buf()
        }
    };
    let tls = args.tls.then(|| make_tls_files(&run_dir)).transpose()?;
    let demo = if args.proxies > 0 {
        let mut text = std::fs::read_to_string(&args.config)
            .with_context(|| format!("reading {}", args.config.display()))?;
        if let Some(tls) = &tls {
            text = with_tls_to_the_service(&text, &tls.ca_file)
                .with_context(|| format!("{}: TLS to the service", args.config.display()))?;
        }
        Some(Demo::from_text(&text).with_context(|| {
            format!(
                "{} is not of envoy/demo.yaml's shape",
                args.config.display()
            )
        })?)
    } else {
        None
    };
    let plugin: Option<Value> = demo
        .as_ref()
        .map(|d| serde_json::from_str(&d.plugin_config_json))
        .transpose()?;
    let token = pick_token(plugin.as_ref())?;
    // The Envoys present the service's token, whichever it is: sluice's configuration as shipped, or with the
    // token replaced.
    let plugin_config = match (&demo, plugin) {
        (Some(demo), Some(mut value)) => match value.get_mut("service") {
            Some(service) if service["token"].as_str() != Some(token.as_str()) => {
                service["token"] = Value::String(token.clone());
                value.to_string()
            }
            _ => demo.plugin_config_json.clone(),
        },
        _ => String::new(),
    };
    let token_file = run_dir.join("token");
    write_private(&token_file, &token)?;
    let pid_file = run_dir.join("sluice-stack.pid");
    std::fs::write(&pid_file, std::process::id().to_string())?;

    let stdin_closed = watch_stdin()?;
    let result = start(&args, demo.as_ref(), &plugin_config, &token, tls.as_ref());
    let mut stack = match result {
        Ok(stack) => stack,
        Err(error) => {
            let _ = std::fs::remove_file(&pid_file);
            return Err(error);
        }
    };
    let mut description = stack.describe(&token_file, &run_dir);
    if let Some(tls) = &tls {
        description["service"]["ca_file"] = json!(tls.ca_file);
        description["service"]["tls_name"] = json!(SERVICE_NAME);
    }
    let mut line = description.to_string();
    line.push('\n');
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(line.as_bytes())?;
    stdout.flush()?;
    drop(stdout);
    if args.hints {
        eprintln!("{}", hints(&stack, &run_dir, tls.as_ref()));
    }

    let mut failed = false;
    let reason = loop {
        if STOP.load(Ordering::SeqCst) {
            break "a signal".to_owned();
        }
        if stdin_closed
            .as_ref()
            .is_some_and(|c| c.load(Ordering::SeqCst))
        {
            break "stdin closed".to_owned();
        }
        if let Some((name, log)) = stack.exited() {
            failed = true;
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(20).collect();
            eprintln!("sluice-stack: {name} exited; the end of its log:");
            for l in tail.iter().rev() {
                eprintln!("  {l}");
            }
            break format!("{name} exited");
        }
        std::thread::sleep(POLL);
    };
    stack.stop(args.run_dir.as_deref().map(|_| run_dir.as_path()));
    let _ = std::fs::remove_file(&pid_file);
    eprintln!("sluice-stack: stopped everything it started ({reason})");
    Ok(!failed)
}

/// What to try on the demo, with the ports the stack got.
fn hints(stack: &Stack, run_dir: &Path, tls: Option<&TlsFiles>) -> String {
    let service = stack.service.address().map_or(0, |a| a.port());
    let redis = stack.redis.port();
    let Some(first) = stack.envoys.first() else {
        return format!(
            "counter service on 127.0.0.1:{service}, Redis on 127.0.0.1:{redis}; no Envoy"
        );
    };
    let (edge, admin) = (first.listen_port, first.admin_port);
    let mut text = String::from("sluice demo is up:\n");
    for (i, envoy) in stack.envoys.iter().enumerate() {
        text += &format!(
            "  Envoy {} with sluice  127.0.0.1:{}, admin 127.0.0.1:{}\n",
            i + 1,
            envoy.listen_port,
            envoy.admin_port
        );
    }
    text += &format!(
        "  counter service     127.0.0.1:{service} (token in {}), Redis on 127.0.0.1:{redis}\n",
        run_dir.join("token").display()
    );
    let metrics = match tls {
        Some(tls) => {
            text += &format!(
                "  over TLS            its certificate for {SERVICE_NAME} from the CA in {}; envoy/production.yaml \
                 trusts it too\n",
                tls.ca_file.display()
            );
            format!(
                "curl -s --cacert {} https://127.0.0.1:{service}/metrics",
                tls.ca_file.display()
            )
        }
        None => format!("curl -s http://127.0.0.1:{service}/metrics"),
    };
    text += &format!(
        r#"Rule "demo"   (local):  5 requests per minute per client IP on /api/ (then one more every 12 s).
Rule "shared" (cached): 10 requests per minute on /shared/ for everyone, shared by every proxy through the
                        counter service. /healthz is never limited.

  curl -i http://127.0.0.1:{edge}/api/hello     # 200, x-ratelimit-remaining: 4, ratelimit: "demo";r=4;t=12
  for i in 1 2 3 4 5; do curl -s -o /dev/null -w '%{{http_code}} ' http://127.0.0.1:{edge}/api/hello; done; echo
                                               # 200 200 200 200 429: the 6th request within the minute is denied
  curl -i http://127.0.0.1:{edge}/api/hello     # 429, retry-after: 12, {{"error":"rate_limited","rule":"demo",...}}
  curl -i http://127.0.0.1:{edge}/healthz       # 200, bypassed: no rate-limit headers

  for i in $(seq 12); do curl -s -o /dev/null -w '%{{http_code}} ' http://127.0.0.1:{edge}/shared/x; sleep 0.2; done; echo
                                               # 10 × 200, then 429 429: the shared 10 per minute is spent
  {metrics} | grep -E '^sluice_(syncs|granted_tokens)_total'
                                               # the service's view: syncs and tokens granted to proxies
  curl -s http://127.0.0.1:{admin}/stats | grep wasmcustom.sluice   # allowed, denied per rule; sync.ok, breaker.open
"#
    );
    match stack.envoys.get(1) {
        Some(second) => {
            let other = second.listen_port;
            text += &format!(
                r#"  for i in $(seq 10); do for p in {edge} {other}; do curl -s -o /dev/null -w '%{{http_code}} ' http://127.0.0.1:$p/shared/x; done; done; echo
                                               # (a minute later, once the budget refilled) 10 × 200 in all, from both
"#
            );
        }
        None => {
            text += "  (make run PROXIES=2, or --proxies 2: a second Envoy on the next ports, same rules and service)\n";
        }
    }
    text += "\nCtrl-C stops everything.";
    text
}

fn main() -> ExitCode {
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(Some(args)) => args,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(error) => {
            eprintln!("sluice-stack: {error:#}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    if let Err(error) = catch_stop_signals() {
        eprintln!("sluice-stack: {error:#}");
        return ExitCode::FAILURE;
    }
    match run(args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(error) => {
            eprintln!("sluice-stack: {error:#}");
            ExitCode::FAILURE
        }
    }
}
