//! The Envoy configuration templates in `envoy/` and their `{{PLACEHOLDER}}` rendering.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};

use super::paths::repo_root;

/// Which Envoy configuration to start.
#[derive(Debug, Clone)]
pub enum Template {
    /// `envoy/sluice.yaml.tmpl`: sluice in front of the built-in upstream.
    Sluice,
    /// `envoy/sluice-service.yaml.tmpl`: as [`Template::Sluice`], plus the cluster `sluice_service` (the counter
    /// service on 127.0.0.1); needs the `SERVICE_PORT` placeholder.
    SluiceService,
    /// `envoy/shedding.yaml.tmpl`: sluice in front of an upstream whose latency and errors each request chooses
    /// (Envoy's fault filter: `x-envoy-fault-delay-request`, `x-envoy-fault-abort-request`), echoing the
    /// degradation header it received; with the cluster `sluice_service`, so it needs the `SERVICE_PORT`
    /// placeholder.
    Shedding,
    /// `envoy/native-local-ratelimit.yaml.tmpl`: Envoy's own local_ratelimit filter instead of sluice;
    /// needs the `MAX_TOKENS`, `TOKENS_PER_FILL` and `FILL_INTERVAL` placeholders.
    NativeLocalRateLimit,
    /// `envoy/no-limiter.yaml.tmpl`: no rate limiter.
    NoLimiter,
    /// Any other template file.
    File(PathBuf),
}

impl Template {
    /// The template's file.
    pub fn path(&self) -> PathBuf {
        let envoy = repo_root().join("envoy");
        match self {
            Template::Sluice => envoy.join("sluice.yaml.tmpl"),
            Template::SluiceService => envoy.join("sluice-service.yaml.tmpl"),
            Template::Shedding => envoy.join("shedding.yaml.tmpl"),
            Template::NativeLocalRateLimit => envoy.join("native-local-ratelimit.yaml.tmpl"),
            Template::NoLimiter => envoy.join("no-limiter.yaml.tmpl"),
            Template::File(path) => path.clone(),
        }
    }
}

/// Replaces every `{{KEY}}` by its value; a placeholder left without a value is an error that names it.
pub fn render(template: &str, values: &[(String, String)]) -> Result<String> {
    let mut out = template.to_owned();
    for (key, value) in values {
        out = out.replace(&format!("{{{{{key}}}}}"), value);
    }
    if let Some(left) = first_placeholder(&out) {
        bail!("placeholder {left} has no value");
    }
    Ok(out)
}

/// The first `{{NAME}}` (upper case, digits, `_`) in `text`.
fn first_placeholder(text: &str) -> Option<&str> {
    let mut from = 0;
    while let Some(start) = text[from..].find("{{").map(|i| from + i) {
        let name_len = text[start + 2..]
            .find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(text.len() - start - 2);
        let end = start + 2 + name_len;
        if name_len > 0 && text[end..].starts_with("}}") {
            return Some(&text[start..end + 2]);
        }
        from = start + 2;
    }
    None
}

/// Reads and renders a template.
pub fn render_file(template: &Template, values: &[(String, String)]) -> Result<String> {
    let path = template.path();
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("reading Envoy template {}", path.display()))?;
    render(&text, values).with_context(|| format!("rendering {}", path.display()))
}

/// A value for a YAML single-quoted scalar: the one escape there is `''` for `'`.
pub fn yaml_single_quoted(value: &str) -> String {
    value.replace('\'', "''")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(k: &str, v: &str) -> (String, String) {
        (k.to_owned(), v.to_owned())
    }

    #[test]
    fn fills_every_occurrence() {
        let out = render("{{A}}:{{B}}:{{A}}", &[kv("A", "1"), kv("B", "2")]).unwrap();
        assert_eq!(out, "1:2:1");
    }

    #[test]
    fn names_a_missing_placeholder() {
        let err = render("port: {{ADMIN_PORT}}", &[]).unwrap_err();
        assert_eq!(err.to_string(), "placeholder {{ADMIN_PORT}} has no value");
    }

    #[test]
    fn leaves_other_braces_alone() {
        assert_eq!(render("{{ a }} {{", &[]).unwrap(), "{{ a }} {{");
    }

    #[test]
    fn escapes_quotes_for_yaml() {
        assert_eq!(yaml_single_quoted(r#"{"a":"it's"}"#), r#"{"a":"it''s"}"#);
    }
}
