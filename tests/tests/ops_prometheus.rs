//! `ops/` against a running stack: real Prometheus (Debian's `prometheus`) scrapes a real Envoy with sluice and the
//! counter service on Redis with `ops/prometheus.yml`'s jobs, evaluates `ops/rules/sluice.yml` (a copy whose `for:`
//! durations are one second, evaluated every second), and the test checks:
//!
//! - every query of the dashboard (`ops/grafana/sluice.json`) returns data;
//! - load beyond a bulkhead's limit makes `SluiceShedding` fire, in Prometheus's own `/api/v1/alerts`;
//! - the counter service killed makes `SluiceServiceDown` fire, and the proxies' breakers open
//!   (`SluiceBreakerOpen`).
//!
//! With `SLUICE_OPS_RENDER=DIR`, the test also writes what each panel's queries returned (Prometheus's JSON) into
//! DIR, for `ops/render.py` to plot (docs/operations.md shows one rendering).
//!
//! Run with `make test` (it installs `prometheus` with `make deps`; `SLUICE_PROMETHEUS` names another binary).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use sluice_tests::envoy::{
    agent, free_ports, get, repo_root, sustain_until, wasm_path, DerivedTemplate, Envoy,
    EnvoyOptions, Load, Template,
};
use sluice_tests::eventually;
use sluice_tests::redis::Redis;
use sluice_tests::service::Service;

/// Prometheus on a loopback port, its data in a temp dir; killed when dropped.
struct Prometheus {
    child: Child,
    port: u16,
    dir: tempfile::TempDir,
}

impl Prometheus {
    fn start(config: &str, rules: &str) -> Result<Prometheus> {
        let binary = std::env::var_os("SLUICE_PROMETHEUS")
            .filter(|p| !p.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("prometheus"));
        let dir = tempfile::Builder::new()
            .prefix("sluice-prometheus-")
            .tempdir()?;
        std::fs::write(dir.path().join("prometheus.yml"), config)?;
        std::fs::write(dir.path().join("sluice.yml"), rules)?;
        let port = free_ports(1)?[0];
        let log = std::fs::File::create(dir.path().join("prometheus.log"))?;
        let child = Command::new(&binary)
            .arg(format!(
                "--config.file={}",
                dir.path().join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| {
                format!(
                    "starting {} (Debian's prometheus: make deps)",
                    binary.display()
                )
            })?;
        let prometheus = Prometheus { child, port, dir };
        let ready = eventually(Duration::from_secs(20), || {
            get(&agent(), &prometheus.url("/-/ready"), &[]).is_ok_and(|r| r.status == 200)
        });
        if !ready {
            bail!("Prometheus not ready: {}", prometheus.log());
        }
        Ok(prometheus)
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }

    fn api(&self, path_and_query: &str) -> Value {
        let reply = get(&agent(), &self.url(path_and_query), &[]).unwrap();
        serde_json::from_str(&reply.body).unwrap_or(Value::Null)
    }

    /// An instant query's result vector.
    fn query(&self, promql: &str) -> Vec<Value> {
        let answer = self.api(&format!("/api/v1/query?query={}", encode(promql)));
        answer["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// The alerts firing now, by name.
    fn firing(&self) -> Vec<String> {
        let answer = self.api("/api/v1/alerts");
        let mut names: Vec<String> = answer["data"]["alerts"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|a| a["state"] == "firing")
            .filter_map(|a| a["labels"]["alertname"].as_str().map(str::to_owned))
            .collect();
        names.sort();
        names.dedup();
        names
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Percent-encoding for a query parameter.
fn encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn ops(path: &str) -> String {
    let path = repo_root().join("ops").join(path);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `ops/prometheus.yml` with its targets replaced by the test's ports, scraping and evaluating every second.
fn prometheus_config(envoy_admin: u16, service: u16, rules: &Path) -> String {
    let shipped = ops("prometheus.yml");
    let mut config = shipped
        .replace("127.0.0.1:9921", &format!("127.0.0.1:{envoy_admin}"))
        .replace("127.0.0.1:8081", &format!("127.0.0.1:{service}"))
        .replace("scrape_interval: 15s", "scrape_interval: 1s")
        .replace("evaluation_interval: 15s", "evaluation_interval: 1s")
        .replace("scrape_timeout: 10s", "scrape_timeout: 1s");
    config = config.replace("rules/sluice.yml", &rules.display().to_string());
    assert_ne!(config, shipped, "ops/prometheus.yml changed shape");
    config
}

/// `ops/rules/sluice.yml` with every `for:` one second: what the test can wait for.
fn rules_for_test() -> String {
    ops("rules/sluice.yml")
        .lines()
        .map(|line| match line.trim_start().strip_prefix("for: ") {
            Some(_) => format!("{}for: 1s", &line[..line.len() - line.trim_start().len()]),
            None => line.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every PromQL expression of the dashboard's panels, with its panel's title. A panel may end an expression in
/// `or on() vector(0)` (a line at 0 in Grafana while a counter has no series yet); that fallback always has data, so
/// it is cut off here: the check is of the metric itself.
fn dashboard_queries() -> Vec<(String, String)> {
    let dashboard: Value = serde_json::from_str(&ops("grafana/sluice.json")).unwrap();
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        let title = panel["title"].as_str().unwrap_or("").to_owned();
        for target in panel["targets"].as_array().into_iter().flatten() {
            if let Some(expr) = target["expr"].as_str() {
                let expr = expr.replace("$__rate_interval", "1m");
                let expr = expr.trim_end_matches(" or on() vector(0)").to_owned();
                queries.push((title.clone(), expr));
            }
        }
    }
    queries
}

const CACHED_RULE: &str = "per-client";

fn sluice_config(token: &str) -> String {
    json!({
        "headers": "both",
        "service": {"cluster": "sluice_service", "authority": "sluice_service", "token": token,
                    "timeout_ms": 100, "sync_interval_ms": 100, "breaker_failures": 3,
                    "breaker_cooldown_ms": 1000},
        "rules": [
            {"name": "per-ip", "match": {"path_prefix": "/"}, "key": ["client_ip"],
             "limits": [{"requests": 40, "per": "second", "burst": 40}]},
            {"name": CACHED_RULE, "key": ["header:x-client"], "consistency": "cached",
             "limits": [{"requests": 1000, "per": "second", "burst": 1000}]}
        ],
        "shedding": {
            "class_header": "x-class",
            "classes": {"free": 0.7, "critical": null},
            "default_class": "free",
            "bulkheads": [{"name": "api", "match": {"path_prefix": "/"}, "limit": {"static": 4}}]
        }
    })
    .to_string()
}

#[test]
fn prometheus_scrapes_the_stack_every_dashboard_query_has_data_and_the_alerts_fire() {
    // The labels the rules and the dashboard read come from these extractors, which production.yaml ships.
    let production = std::fs::read_to_string(repo_root().join("envoy/production.yaml")).unwrap();
    assert!(
        production.contains(&ops("envoy-stats-tags.yaml")),
        "production.yaml lacks ops/envoy-stats-tags.yaml"
    );
    let redis = Redis::start().unwrap();
    let mut service = Service::start(&redis.url()).unwrap();
    let service_port = service.address().unwrap().port();
    // One error answered by the service (a sync with a wrong token): its errors counter has a series for the
    // dashboard's "service errors" query to find.
    let refused = service
        .request("POST", "/v1/sync", Some("not-the-token"), Some("{}"))
        .unwrap();
    assert_eq!(refused.status, 401, "{refused:?}");
    let template = DerivedTemplate::edited(
        &Template::Shedding,
        &[(
            "stats_flush_on_admin: true\n",
            &format!(
                "stats_flush_on_admin: true\n{}",
                ops("envoy-stats-tags.yaml")
            ),
        )],
    )
    .unwrap();
    let envoy = Envoy::start(EnvoyOptions {
        template: template.template(),
        plugin_config_json: sluice_config(service.token()),
        concurrency: 2,
        placeholders: vec![
            ("SERVICE_PORT".into(), service_port.to_string()),
            ("WASM".into(), wasm_path().unwrap().display().to_string()),
        ],
    })
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let rules_path = dir.path().join("sluice.yml");
    std::fs::write(&rules_path, rules_for_test()).unwrap();
    let admin_port: u16 = envoy
        .admin_url("")
        .rsplit(':')
        .next()
        .and_then(|p| p.trim_end_matches('/').parse().ok())
        .unwrap();
    let prometheus = Prometheus::start(
        &prometheus_config(admin_port, service_port, &rules_path),
        &rules_for_test(),
    )
    .unwrap();

    // Load: four connections of one client admitted and denied by per-ip; twelve slow ones (300 ms upstream) on a
    // bulkhead of four: shed. Until the shedding alert fires.
    let started = now_s();
    let stop = AtomicBool::new(false);
    let fast = Load {
        headers: vec![("x-client".into(), "alice".into())],
        ..Load::new(envoy.url("/api/fast"), 2, Duration::from_secs(45))
    };
    let slow = Load {
        headers: vec![
            ("x-envoy-fault-delay-request".into(), "300".into()),
            ("x-client".into(), "bob".into()),
        ],
        ..Load::new(envoy.url("/api/slow"), 12, Duration::from_secs(45))
    };
    let fired = std::thread::scope(|scope| {
        scope.spawn(|| sustain_until(&fast, &stop));
        scope.spawn(|| sustain_until(&slow, &stop));
        let fired = eventually(Duration::from_secs(20), || {
            prometheus.firing().iter().any(|a| a == "SluiceShedding")
        });
        // A rendering shows the load for longer than the alert needs.
        if std::env::var_os("SLUICE_OPS_RENDER").is_some_and(|d| !d.is_empty()) {
            std::thread::sleep(Duration::from_secs(20));
        }
        stop.store(true, Ordering::Relaxed);
        fired
    });
    assert!(
        fired,
        "SluiceShedding did not fire: {:?}",
        prometheus.api("/api/v1/alerts")
    );

    let empty: Vec<_> = dashboard_queries()
        .into_iter()
        .filter(|(_, expr)| prometheus.query(expr).is_empty())
        .collect();
    assert!(
        empty.is_empty(),
        "dashboard queries without data: {empty:#?}"
    );

    service.kill();
    assert!(
        eventually(Duration::from_secs(15), || {
            let firing = prometheus.firing();
            firing.iter().any(|a| a == "SluiceServiceDown")
                && firing.iter().any(|a| a == "SluiceBreakerOpen")
        }),
        "{:?}",
        prometheus.api("/api/v1/alerts")
    );
    if let Some(dir) = std::env::var_os("SLUICE_OPS_RENDER").filter(|d| !d.is_empty()) {
        let path = Path::new(&dir).join("panels.json");
        std::fs::write(&path, panels_over(&prometheus, started).to_string()).unwrap();
        eprintln!(
            "panels: {} (python3 ops/render.py {})",
            path.display(),
            path.display()
        );
    }
    drop(redis);
}

/// Every panel of the dashboard over the run, as `ops/render.py` reads it: its title, unit, and each query's series
/// (the legend filled from the labels, `[seconds since start, value]` points).
fn panels_over(prometheus: &Prometheus, started: f64) -> Value {
    let dashboard: Value = serde_json::from_str(&ops("grafana/sluice.json")).unwrap();
    let end = now_s();
    let mut panels = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        let mut series = Vec::new();
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"]
                .as_str()
                .unwrap_or("")
                .replace("$__rate_interval", "5s");
            let legend = target["legendFormat"].as_str().unwrap_or("");
            let answer = prometheus.api(&format!(
                "/api/v1/query_range?query={}&start={started:.3}&end={end:.3}&step=1",
                encode(&expr)
            ));
            for result in answer["data"]["result"].as_array().into_iter().flatten() {
                let mut name = legend.to_owned();
                for (label, value) in result["metric"].as_object().into_iter().flatten() {
                    name = name.replace(&format!("{{{{{label}}}}}"), value.as_str().unwrap_or(""));
                }
                let points: Vec<Value> = result["values"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|p| {
                        let t = p[0].as_f64()? - started;
                        let v: f64 = p[1].as_str()?.parse().ok()?;
                        v.is_finite().then(|| json!([t, v]))
                    })
                    .collect();
                series.push(json!({"legend": name, "points": points}));
            }
        }
        panels.push(json!({
            "title": panel["title"],
            "unit": panel["fieldConfig"]["defaults"]["unit"],
            "series": series,
        }));
    }
    json!({"panels": panels})
}

fn now_s() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}
