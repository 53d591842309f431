//! The shipped configurations, started as shipped: `envoy/demo.yaml` and `envoy/production.yaml` with only their fixed
//! ports, their `.wasm` path and (when a test asks) sluice's JSON configuration turned into placeholders, and any
//! template of `envoy/` with exact text edits (e.g. `xff_num_trusted_hops: 0` made `1` for Envoy behind a load
//! balancer). Every edit must match exactly as often as expected, so a test fails loudly when the file it edits changed
//! shape.
//!
//! ```no_run
//! use sluice_tests::envoy::{Demo, Envoy};
//!
//! let demo = Demo::shipped()?;                      // envoy/demo.yaml
//! let plugin = demo.plugin_config_json.clone();     // sluice's configuration as shipped
//! let envoy = Envoy::start(demo.options(plugin, 2, 1)?)?; // the counter service on 127.0.0.1:1 (closed)
//! let production = Demo::production()?;             // envoy/production.yaml, the same way
//! # Ok::<(), anyhow::Error>(())
//! ```

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use tempfile::TempDir;

use super::paths::{repo_root, wasm_path};
use super::process::EnvoyOptions;
use super::template::Template;
use crate::certs::Authority;
use crate::service::ServiceTls;

/// Template text written to a temp file (removed on drop), to start like any template.
#[derive(Debug)]
pub struct DerivedTemplate {
    _dir: TempDir,
    path: PathBuf,
}

impl DerivedTemplate {
    /// `text` as a template file.
    pub fn new(text: &str) -> Result<DerivedTemplate> {
        let dir = tempfile::Builder::new()
            .prefix("sluice-template-")
            .tempdir()
            .context("creating a temp dir for a template")?;
        let path = dir.path().join("envoy.yaml.tmpl");
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        Ok(DerivedTemplate { _dir: dir, path })
    }

    /// The shipped `template` with `edits` applied: each `(from, to)` must occur exactly once.
    pub fn edited(template: &Template, edits: &[(&str, &str)]) -> Result<DerivedTemplate> {
        let path = template.path();
        let mut text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading Envoy template {}", path.display()))?;
        for (from, to) in edits {
            text = replace_exactly(&text, from, to, 1)
                .with_context(|| format!("editing {}", path.display()))?;
        }
        DerivedTemplate::new(&text)
    }

    /// The template to put in [`EnvoyOptions::template`].
    pub fn template(&self) -> Template {
        Template::File(self.path.clone())
    }
}

/// Replaces `from` by `to` in `text`; `from` must occur exactly `times` times.
pub fn replace_exactly(text: &str, from: &str, to: &str, times: usize) -> Result<String> {
    let found = text.matches(from).count();
    if found != times {
        bail!("expected {from:?} {times} time(s), found it {found} time(s)");
    }
    Ok(text.replace(from, to))
}

/// `envoy/demo.yaml` as a template: its fixed ports (10000, 10001, 9901, 8081), its relative `.wasm` path and its
/// sluice configuration replaced by placeholders, nothing else touched. [`Demo::production`] does the same for
/// `envoy/production.yaml`.
#[derive(Debug)]
pub struct Demo {
    template: DerivedTemplate,
    /// sluice's configuration as the file ships it (the JSON of its `configuration` value).
    pub plugin_config_json: String,
    /// The CA the file's counter-service clusters trust, made for this start (`production.yaml` speaks TLS to the
    /// service; the demo does not).
    service_ca: Option<ServiceCa>,
}

/// The CA of a production-shaped start (only its file shows in `Debug`).
struct ServiceCa(Authority);

impl std::fmt::Debug for ServiceCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("ServiceCa").field(&self.0.ca_file()).finish()
    }
}

impl Demo {
    /// The demo as it is in the repository.
    pub fn shipped() -> Result<Demo> {
        let path = repo_root().join("envoy/demo.yaml");
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        Demo::from_text(&text)
            .with_context(|| format!("turning {} into a template", path.display()))
    }

    /// A demo configuration of `demo.yaml`'s shape (e.g. an older revision of the file).
    pub fn from_text(yaml: &str) -> Result<Demo> {
        let mut text = ports_and_wasm(
            yaml,
            &[
                ("10000", "LISTEN_PORT", 1),
                ("10001", "UPSTREAM_PORT", 2),
                ("9901", "ADMIN_PORT", 1),
                ("8081", "SERVICE_PORT", 1),
            ],
        )?;
        let value_lines: Vec<String> = text
            .lines()
            .filter(|line| line.trim_start().starts_with("value: '") && line.ends_with('\''))
            .map(str::to_owned)
            .collect();
        let [line] = value_lines.as_slice() else {
            bail!(
                "expected one `value: '<sluice's JSON>'` line, found {}",
                value_lines.len()
            );
        };
        let quoted = line.trim_start().trim_start_matches("value: ");
        let plugin_config_json = quoted[1..quoted.len() - 1].replace("''", "'");
        serde_json::from_str::<serde_json::Value>(&plugin_config_json)
            .with_context(|| format!("sluice's configuration is not JSON: {plugin_config_json}"))?;
        let indent = &line[..line.len() - line.trim_start().len()];
        text = replace_exactly(
            &text,
            line,
            &format!("{indent}value: '{{{{PLUGIN_CONFIG}}}}'"),
            1,
        )?;
        Ok(Demo {
            template: DerivedTemplate::new(&text)?,
            plugin_config_json,
            service_ca: None,
        })
    }

    /// What to start: the demo (or the production example) with sluice's configuration `plugin_config_json` (e.g.
    /// [`Demo::plugin_config_json`]), `concurrency` workers, and its cluster `sluice_service` on
    /// `127.0.0.1:service_port`.
    pub fn options(
        &self,
        plugin_config_json: String,
        concurrency: u32,
        service_port: u16,
    ) -> Result<EnvoyOptions> {
        let mut options = shipped_options(
            &self.template,
            plugin_config_json,
            concurrency,
            service_port,
        )?;
        if let Some(ServiceCa(ca)) = &self.service_ca {
            options
                .placeholders
                .push(("SERVICE_CA".to_owned(), ca.ca_file().display().to_string()));
        }
        Ok(options)
    }

    /// The certificate and key a counter service serves to be trusted by this configuration's proxies: a certificate
    /// for `sluice-service.internal` (and 127.0.0.1, for the fixture's own health checks) from the CA the file's
    /// clusters were given; `None` for a configuration that speaks plain HTTP to the service.
    pub fn service_tls(&self) -> Result<Option<ServiceTls>> {
        let Some(ServiceCa(ca)) = &self.service_ca else {
            return Ok(None);
        };
        let issued = ca.issue("service", &[SERVICE_NAME, "127.0.0.1"])?;
        Ok(Some(ServiceTls {
            cert_file: issued.cert_file,
            key_file: issued.key_file,
            ca_pem: ca.ca_pem.clone(),
        }))
    }
}

/// The name `envoy/production.yaml`'s proxies require of the counter service's certificate (and send as SNI).
const SERVICE_NAME: &str = "sluice-service.internal";
/// Where `envoy/production.yaml` reads the CA it trusts the counter service by (what `make run TLS=1` writes).
const SHIPPED_SERVICE_CA: &str = "filename: \".run/demo/tls/ca.pem\"";

/// `envoy/production.yaml`, the production-shaped example, as a template of the same kind: its fixed ports (edge 10200,
/// upstream 10201, admin 9921, counter service 8081), its relative `.wasm` path and its sluice configuration (the JSON
/// block of its `configuration`) replaced by placeholders, nothing else touched: the JWT filter, the header removal,
/// the routes and the clusters as shipped. [`Demo::plugin_config_json`] is that JSON on one line (the block's lines
/// joined: the same JSON).
impl Demo {
    /// `envoy/production.yaml` as it is in the repository.
    pub fn production() -> Result<Demo> {
        let path = repo_root().join("envoy/production.yaml");
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        Demo::production_from_text(&text)
            .with_context(|| format!("turning {} into a template", path.display()))
    }

    /// A configuration of `production.yaml`'s shape.
    pub fn production_from_text(yaml: &str) -> Result<Demo> {
        Demo::production_shaped(yaml, 0)
    }

    /// `yaml` (`production.yaml`'s shape) with the endpoints of each cluster named in `clusters` replaced by the
    /// loopback ports given (upstreams of the test's own, e.g. failing ones), in order; the cluster's breakers,
    /// outlier detection and everything else as they are. Each cluster must have its one shipped endpoint.
    pub fn production_with_endpoints(yaml: &str, clusters: &[(&str, &[u16])]) -> Result<Demo> {
        let mut text = yaml.to_owned();
        for (cluster, ports) in clusters {
            let endpoint = |port: &str| {
                format!(
                    "        - endpoint:\n            address:\n              socket_address: \
                     {{ address: 127.0.0.1, port_value: {port} }}\n"
                )
            };
            let head =
                format!("      cluster_name: {cluster}\n      endpoints:\n      - lb_endpoints:\n");
            let endpoints: String = ports.iter().map(|p| endpoint(&p.to_string())).collect();
            text = replace_exactly(
                &text,
                &format!("{head}{}", endpoint("10201")),
                &format!("{head}{endpoints}"),
                1,
            )
            .with_context(|| format!("the endpoints of cluster {cluster}"))?;
        }
        Demo::production_shaped(&text, clusters.len())
    }

    /// `production.yaml`'s shape, `pointed_away` of its clusters no longer at the upstream listener.
    fn production_shaped(yaml: &str, pointed_away: usize) -> Result<Demo> {
        let text = ports_and_wasm(
            yaml,
            &[
                ("10200", "LISTEN_PORT", 1),
                // The upstream listener and the three clusters that point at it.
                ("10201", "UPSTREAM_PORT", 4 - pointed_away),
                ("9921", "ADMIN_PORT", 1),
                // The sync's cluster and the public status's.
                ("8081", "SERVICE_PORT", 2),
            ],
        )?;
        // sluice's JSON is a block scalar: `value: |`, then the lines indented deeper than it.
        let lines: Vec<&str> = text.lines().collect();
        let starts: Vec<usize> = (0..lines.len())
            .filter(|&i| lines[i].trim() == "value: |")
            .collect();
        let [start] = starts.as_slice() else {
            bail!(
                "expected one `value: |` line (sluice's JSON as a block), found {}",
                starts.len()
            );
        };
        let indent = |line: &str| line.len() - line.trim_start().len();
        let key_indent = indent(lines[*start]);
        let block: Vec<&str> = lines[start + 1..]
            .iter()
            .take_while(|line| line.trim().is_empty() || indent(line) > key_indent)
            .copied()
            .collect();
        // JSON strings hold no line breaks, so joining the trimmed lines keeps the JSON as it is.
        let plugin_config_json = block
            .iter()
            .map(|line| line.trim())
            .filter(|line| !line.is_empty())
            .collect::<Vec<_>>()
            .join(" ");
        serde_json::from_str::<serde_json::Value>(&plugin_config_json)
            .with_context(|| format!("sluice's configuration is not JSON: {plugin_config_json}"))?;
        let mut rendered: Vec<String> = lines[..*start].iter().map(|l| l.to_string()).collect();
        rendered.push(format!(
            "{}value: '{{{{PLUGIN_CONFIG}}}}'",
            &lines[*start][..key_indent]
        ));
        rendered.extend(
            lines[start + 1 + block.len()..]
                .iter()
                .map(|l| l.to_string()),
        );
        // Both clusters of the counter service trust the CA `make run TLS=1` writes: a CA of this start's own.
        let text = replace_exactly(
            &(rendered.join("\n") + "\n"),
            SHIPPED_SERVICE_CA,
            "filename: \"{{SERVICE_CA}}\"",
            2,
        )?;
        Ok(Demo {
            template: DerivedTemplate::new(&text)?,
            plugin_config_json,
            service_ca: Some(ServiceCa(Authority::new("production-service")?)),
        })
    }
}

/// `yaml` with its fixed ports (`(port, placeholder, how often)`, each written `port_value: <port> }`) and its relative
/// `.wasm` path made placeholders.
fn ports_and_wasm(yaml: &str, ports: &[(&str, &str, usize)]) -> Result<String> {
    let mut text = yaml.to_owned();
    for (port, placeholder, times) in ports {
        text = replace_exactly(
            &text,
            &format!("port_value: {port} }}"),
            &format!("port_value: {{{{{placeholder}}}}} }}"),
            *times,
        )?;
    }
    replace_exactly(
        &text,
        "filename: \"target/wasm32-wasip1/release/sluice_filter.wasm\"",
        "filename: \"{{WASM}}\"",
        1,
    )
}

/// The options of a shipped configuration made a template: the built `.wasm` and the counter service's port.
fn shipped_options(
    template: &DerivedTemplate,
    plugin_config_json: String,
    concurrency: u32,
    service_port: u16,
) -> Result<EnvoyOptions> {
    Ok(EnvoyOptions {
        template: template.template(),
        plugin_config_json,
        concurrency,
        placeholders: vec![
            ("WASM".to_owned(), wasm_path()?.display().to_string()),
            ("SERVICE_PORT".to_owned(), service_port.to_string()),
        ],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_exactly_as_often_as_told() {
        assert_eq!(replace_exactly("a b a", "a", "c", 2).unwrap(), "c b c");
        let err = replace_exactly("a b a", "a", "c", 1).unwrap_err();
        assert_eq!(
            err.to_string(),
            "expected \"a\" 1 time(s), found it 2 time(s)"
        );
    }

    /// The ports, the `.wasm` path and sluice's configuration are placeholders.
    fn assert_every_placeholder(text: &str) {
        for placeholder in [
            "LISTEN_PORT",
            "UPSTREAM_PORT",
            "ADMIN_PORT",
            "SERVICE_PORT",
            "WASM",
        ] {
            assert!(
                text.contains(&format!("{{{{{placeholder}}}}}")),
                "{placeholder}"
            );
        }
        assert!(text.contains("value: '{{PLUGIN_CONFIG}}'"), "{text}");
    }

    #[test]
    fn the_demo_becomes_a_template() {
        let demo = Demo::shipped().unwrap();
        let text = std::fs::read_to_string(&demo.template.path).unwrap();
        assert_every_placeholder(&text);
        let config: serde_json::Value = serde_json::from_str(&demo.plugin_config_json).unwrap();
        assert_eq!(config["client_ip"]["trusted_hops"], 0, "{config}");
    }

    #[test]
    fn the_production_config_becomes_a_template_and_sluice_accepts_its_configuration() {
        let production = Demo::production().unwrap();
        let text = std::fs::read_to_string(&production.template.path).unwrap();
        assert_every_placeholder(&text);
        assert!(
            !text.contains("\"shedding\""),
            "the JSON block is gone: {text}"
        );
        assert!(!production.plugin_config_json.contains('\n'));
        let policy = sluice_core::parse(production.plugin_config_json.as_bytes()).unwrap();
        let shedding = policy.shedding.expect("a shedding section");
        let bulkheads: Vec<&str> = shedding.bulkheads.iter().map(|b| b.name.as_str()).collect();
        assert_eq!(bulkheads, ["api", "search", "payments"]);
        assert_eq!(shedding.class_header.as_deref(), Some("x-sluice-class"));
    }

    #[test]
    fn a_production_cluster_points_at_a_tests_endpoints_and_nothing_else_changes() {
        let yaml = std::fs::read_to_string(repo_root().join("envoy/production.yaml")).unwrap();
        let edited = Demo::production_with_endpoints(&yaml, &[("api", &[4001, 4002])]).unwrap();
        let text = std::fs::read_to_string(&edited.template.path).unwrap();
        assert_every_placeholder(&text);
        assert_eq!(text.matches("port_value: {{UPSTREAM_PORT}} }").count(), 3);
        let api = &text[text.find("cluster_name: api").unwrap()..];
        let api = &api[..api.find("- name: search").unwrap()];
        assert_eq!(api.matches("- endpoint:").count(), 2, "{api}");
        assert!(api.contains("port_value: 4001 }") && api.contains("port_value: 4002 }"));
        let shipped = Demo::production().unwrap();
        let shipped = std::fs::read_to_string(&shipped.template.path).unwrap();
        let breakers = |t: &str| {
            t[t.find("  clusters:").unwrap()..t.find("cluster_name: api").unwrap()].to_owned()
        };
        assert_eq!(breakers(&text), breakers(&shipped));
        let err = Demo::production_with_endpoints(&yaml, &[("nowhere", &[4001])]).unwrap_err();
        assert!(format!("{err:#}").contains("cluster nowhere"), "{err:#}");
    }
}
