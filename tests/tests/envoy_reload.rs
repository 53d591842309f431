//! Configuration reloads in a real Envoy (the pinned wheel, V8): the edge listener comes from a file Envoy watches
//! (LDS from the filesystem, `envoy/reload.yaml.tmpl` and `envoy/reload-lds.yaml.tmpl`); a new configuration is
//! pushed by renaming a new file over it, as a control plane writing files would.
//!
//! - `under_load`: a change that leaves rule `a` as it was and lowers rule `b`'s limit, pushed under steady load:
//!   no request fails (no 5xx, no transport error), `a`'s exhausted key stays denied (its count carried over), `b`
//!   takes its new limit.
//! - `old_tables_are_emptied`: successive changes of a rule's shape, each new table filled with keys: Envoy's heap
//!   (admin `/memory`, `allocated`) grows by one table per change until the old tables' grace period is over, then
//!   comes back to within two tables of where it started, instead of keeping every old table until Envoy restarts.
//!
//! `make test` runs the short version (a few reloads); `make test-reload` the long one (`SLUICE_RELOADS=20`,
//! `SLUICE_RELOAD_KEYS=1000`). Envoy runs with `--drain-time-s 5`, so an old filter chain is gone five seconds
//! after a reload. Traffic goes to loopback only; every wait has a deadline.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use sluice_tests::envoy::{
    agent, envoy_binary, free_ports, get, render, repo_root, sustain, wasm_path, Load, Stats,
};
use sluice_tests::eventually;

/// Envoy's `--drain-time-s`: how long an old filter chain's connections may finish (asked to close as they
/// answer) before Envoy closes them. With 1 s under this load, Envoy closed a few keep-alive connections it had not
/// yet asked to close, with a request in flight (RELIABILITY.md); 5 s leaves none.
const DRAIN_TIME_S: &str = "5";

/// An Envoy whose edge listener is reloaded from a file; killed on drop.
struct Reloadable {
    child: Child,
    dir: tempfile::TempDir,
    listen_port: u16,
    admin_port: u16,
    /// LDS updates Envoy accepted so far (the first load included).
    loaded: u64,
}

impl Reloadable {
    fn start(plugin: &Value) -> Result<Reloadable> {
        let ports = free_ports(3)?;
        let dir = tempfile::Builder::new()
            .prefix("sluice-reload-")
            .tempdir()?;
        let lds = dir.path().join("lds");
        std::fs::create_dir(&lds)?;
        let values = vec![
            ("ADMIN_PORT".to_owned(), ports[1].to_string()),
            ("UPSTREAM_PORT".to_owned(), ports[2].to_string()),
            (
                "LDS_PATH".to_owned(),
                lds.join("lds.yaml").display().to_string(),
            ),
            ("LDS_DIR".to_owned(), lds.display().to_string()),
        ];
        let bootstrap = render(&template("reload.yaml.tmpl")?, &values)?;
        let config = dir.path().join("envoy.yaml");
        std::fs::write(&config, bootstrap)?;
        let mut envoy = Reloadable {
            child: Command::new(envoy_binary()?)
                .arg("-c")
                .arg(&config)
                .args(["--concurrency", "2", "--drain-time-s", DRAIN_TIME_S])
                .args(["--log-level", "info", "--disable-hot-restart"])
                .stdin(Stdio::null())
                .stdout(std::fs::File::create(dir.path().join("envoy.log"))?)
                .stderr(std::fs::File::create(dir.path().join("envoy.err"))?)
                .spawn()
                .context("starting Envoy")?,
            dir,
            listen_port: ports[0],
            admin_port: ports[1],
            loaded: 0,
        };
        // The file must be there when Envoy starts: written before it reads its bootstrap.
        envoy.write_listener(plugin)?;
        envoy.wait_loaded(1)?;
        Ok(envoy)
    }

    fn lds_dir(&self) -> PathBuf {
        self.dir.path().join("lds")
    }

    /// Writes the listener with `plugin` beside the watched file and renames it over it.
    fn write_listener(&self, plugin: &Value) -> Result<()> {
        let values = vec![
            ("LISTEN_PORT".to_owned(), self.listen_port.to_string()),
            ("WASM".to_owned(), wasm_path()?.display().to_string()),
            (
                "PLUGIN_CONFIG".to_owned(),
                plugin.to_string().replace('\'', "''"),
            ),
        ];
        let text = render(&template("reload-lds.yaml.tmpl")?, &values)?;
        let next = self.lds_dir().join("lds.yaml.next");
        std::fs::write(&next, text)?;
        std::fs::rename(&next, self.lds_dir().join("lds.yaml"))?;
        Ok(())
    }

    /// Pushes a new configuration and waits until Envoy took it and its listener is warm.
    fn push(&mut self, plugin: &Value) -> Result<()> {
        self.write_listener(plugin)?;
        self.wait_loaded(self.loaded + 1)
    }

    fn wait_loaded(&mut self, updates: u64) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                bail!("Envoy exited ({status}); its log:\n{}", self.log());
            }
            if let Ok(stats) = self.stats() {
                let rejected = stats.counter("listener_manager.lds.update_rejected");
                if rejected.unwrap_or(0) > 0 {
                    bail!("Envoy rejected a listener update; its log:\n{}", self.log());
                }
                let done = stats.counter("listener_manager.lds.update_success") >= Some(updates);
                let warm = stats.counter("listener_manager.total_listeners_warming") == Some(0);
                let active = stats.counter("listener_manager.total_listeners_active") >= Some(2);
                if done && warm && active {
                    self.loaded = updates;
                    return Ok(());
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        bail!(
            "Envoy did not load listener update {updates} within 30 s; its log:\n{}",
            self.log()
        )
    }

    fn stats(&self) -> Result<Stats> {
        let url = format!("http://127.0.0.1:{}/stats", self.admin_port);
        Ok(Stats::parse(&get(&agent(), &url, &[])?.body))
    }

    /// Envoy's heap in use (admin `/memory`, `allocated`): where shared data lives.
    fn allocated(&self) -> Result<u64> {
        let url = format!("http://127.0.0.1:{}/memory", self.admin_port);
        let memory = get(&agent(), &url, &[])?.json()?;
        memory["allocated"]
            .as_str()
            .and_then(|s| s.parse().ok())
            .context("no allocated in /memory")
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.listen_port)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("envoy.log")).unwrap_or_default()
            + &std::fs::read_to_string(self.dir.path().join("envoy.err")).unwrap_or_default()
    }
}

impl Drop for Reloadable {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            let log = self.log();
            let lines: Vec<&str> = log.lines().collect();
            eprintln!("--- last lines of Envoy's log ---");
            for line in &lines[lines.len().saturating_sub(40)..] {
                eprintln!("{line}");
            }
        }
    }
}

fn template(name: &str) -> Result<String> {
    let path: PathBuf = repo_root().join("envoy").join(name);
    std::fs::read_to_string(&path).with_context(|| format!("reading {}", Path::display(&path)))
}

fn env_number(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The status of `GET url` with `x-key: key` on a new connection (so on the newest filter chain).
fn status(url: &str, key: &str) -> u16 {
    get(&agent(), url, &[("x-key", key)])
        .map(|r| r.status)
        .unwrap_or_else(|e| panic!("GET {url} ({key}): {e:#}"))
}

fn rule(name: &str, requests: u64) -> Value {
    json!({"name": name, "match": {"path_prefix": format!("/{name}/")}, "key": ["header:x-key"],
           "limits": [{"requests": requests, "per": "hour"}]})
}

#[test]
fn under_load() {
    let config = |b: u64| {
        json!({"headers": "none", "max_keys": 1024, "rules": [
            rule("a", 20), rule("b", b),
            {"name": "steady", "match": {"path_prefix": "/steady/"}, "key": ["header:x-key"],
             "limits": [{"requests": 1_000_000_000u64, "per": "second"}]}]})
    };
    let mut envoy = Reloadable::start(&config(5)).unwrap();
    let a = envoy.url("/a/x");
    let admitted = (0..21).filter(|_| status(&a, "a1") == 200).count();
    assert_eq!(admitted, 20, "rule a admits 20 of key a1 before the reload");

    let mut load = Load::new(envoy.url("/steady/x"), 4, Duration::from_secs(6));
    load.headers = vec![("x-key".to_owned(), "steady".to_owned())];
    load.max_requests = 200_000;
    let pushed = std::thread::scope(|scope| {
        let running = scope.spawn(|| sustain(&load));
        std::thread::sleep(Duration::from_secs(2));
        let pushed = Instant::now();
        envoy.push(&config(2)).unwrap();
        let took = pushed.elapsed();
        // Right after the reload, on a new connection: a's count carried over, b's new limit holds.
        assert_eq!(status(&a, "a1"), 429, "a's exhausted key after the reload");
        assert_eq!(status(&a, "a2"), 200, "a's fresh key after the reload");
        let b: Vec<u16> = (0..3).map(|_| status(&envoy.url("/b/x"), "b1")).collect();
        assert_eq!(b, vec![200, 200, 429], "b's new limit (2) after the reload");
        let sustained = running.join().unwrap();
        (sustained, took)
    });
    let (sustained, took) = pushed;
    let statuses = sustained.statuses();
    let errors = sustained.errors();
    eprintln!(
        "under_load: reload took {took:?}; {} requests, statuses {statuses:?}, {} transport errors, slowest {:?}",
        sustained.samples.len(),
        errors.len(),
        sustained.slowest().map(|(latency, _)| latency)
    );
    assert!(
        errors.is_empty(),
        "transport errors during the reload: {errors:?}"
    );
    assert_eq!(
        statuses.keys().copied().collect::<Vec<_>>(),
        vec![200],
        "every request under load answered 200"
    );
    assert!(sustained.samples.len() > 100, "load too thin: {statuses:?}");
}

#[test]
fn old_tables_are_emptied() {
    let reloads = env_number("SLUICE_RELOADS", 5);
    let keys = env_number("SLUICE_RELOAD_KEYS", 400);
    let max_keys = env_number("SLUICE_RELOAD_MAX_KEYS", 1024);
    // Two sliding logs of about 1,000 timestamps: about 16 KB a record, so a few hundred keys make a table of
    // several MB (fewer timestamps for a larger max_keys: a rule's logs may take 64 MiB). Each reload changes the
    // hour limit: a new shape, a new table.
    let log = (64 << 20) / (max_keys * 16);
    let log = log.min(1000);
    assert!(
        log > reloads,
        "max_keys {max_keys} leaves room for {log} timestamps"
    );
    let config = |i: usize| {
        json!({"headers": "none", "max_keys": max_keys, "rules": [
            {"name": "m", "match": {"path_prefix": "/m/"}, "key": ["header:x-key"],
             "limits": [{"requests": log, "per": "minute", "algorithm": "sliding_log"},
                        {"requests": log - i, "per": "hour", "algorithm": "sliding_log"}]}]})
    };
    let mut envoy = Reloadable::start(&config(0)).unwrap();
    let url = envoy.url("/m/x");
    let fill = |round: usize| {
        let next = AtomicUsize::new(0);
        std::thread::scope(|scope| {
            for _ in 0..4 {
                scope.spawn(|| {
                    let agent = agent();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= keys {
                            break;
                        }
                        let key = format!("r{round}-k{i}");
                        let reply = get(&agent, &url, &[("x-key", &key)]).unwrap();
                        assert_eq!(reply.status, 200, "{key}");
                    }
                });
            }
        });
    };
    let start = envoy.allocated().unwrap();
    fill(0);
    let one_table = envoy.allocated().unwrap().saturating_sub(start);
    for i in 1..=reloads {
        envoy.push(&config(i)).unwrap();
        fill(i);
    }
    let peak = envoy.allocated().unwrap();
    let mb = |b: u64| b as f64 / 1e6;
    eprintln!(
        "old_tables_are_emptied: {reloads} reloads, {keys} keys each: one table {:.1} MB; at start {:.1} MB, \
         after the reloads {:.1} MB",
        mb(one_table),
        mb(start),
        mb(peak)
    );
    assert!(
        peak.saturating_sub(start) >= one_table * reloads as u64 / 2,
        "the reloads' tables were not filled: one table {one_table} B, peak {peak} B, start {start} B"
    );
    // Every old table emptied: the grace period (10 s) after the old filter chains were drained (5 s), and a few
    // ticks. Requests go on meanwhile (they share the workers with the sweeps): the slowest is reported.
    let (probe, probe_url) = (agent(), envoy.url("/probe"));
    let mut slowest = Duration::ZERO;
    let emptied_tables = || {
        envoy
            .log()
            .lines()
            .filter(|l| l.contains("sluice: old key table") && l.ends_with(", done"))
            .count()
    };
    let mut done = 0;
    eventually(Duration::from_secs(60), || {
        for _ in 0..10 {
            let sent = Instant::now();
            let reply = get(&probe, &probe_url, &[]).unwrap();
            assert_eq!(reply.status, 200);
            slowest = slowest.max(sent.elapsed());
        }
        done = emptied_tables();
        done >= reloads
    });
    // The last table's memory handed back (the allocator may take a moment).
    let bound = start + 2 * one_table;
    let mut now = peak;
    let within = eventually(Duration::from_secs(5), || {
        now = envoy.allocated().unwrap_or(u64::MAX);
        now <= bound
    });
    // Each batch's log line says how long the worker spent emptying it.
    let log = envoy.log();
    let batches: Vec<u64> = log
        .lines()
        .filter(|l| l.contains("sluice: old key table"))
        .filter_map(|l| l.split(") in ").nth(1)?.split(' ').next()?.parse().ok())
        .collect();
    eprintln!(
        "old_tables_are_emptied: then {:.1} MB ({done} old tables emptied, {} batches, the longest {} µs); slowest \
         request meanwhile {slowest:?}",
        mb(now),
        batches.len(),
        batches.iter().max().unwrap_or(&0)
    );
    assert!(
        within,
        "old tables kept: {now} B allocated, start {start} B, one table {one_table} B, {done} tables emptied"
    );
    assert!(done >= reloads, "{done} old tables emptied of {reloads}");
}
