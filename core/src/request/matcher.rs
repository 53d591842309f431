//! Which requests a rule or a bulkhead applies to.

use std::net::IpAddr;

use crate::request::net::Cidr;
use crate::request::RequestView;

/// Which requests a rule applies to. Every part set must match; empty parts match everything.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Matcher {
    pub path_prefix: Option<String>,
    /// Exact paths (without the query string).
    pub paths: Vec<String>,
    /// Path templates: `/users/{id}/export`, a `{name}` standing for one segment.
    pub templates: Vec<Template>,
    /// Upper-case method names.
    pub methods: Vec<String>,
    /// Lower-case host names without a trailing dot (`:authority` without its port, lower case,
    /// its trailing dot removed); `*.example.com` matches any subdomain.
    pub hosts: Vec<String>,
    /// Headers by lower-case name: present, absent, or equal to a value.
    pub headers: Vec<(String, HeaderTest)>,
    /// Client address blocks.
    pub client_cidrs: Vec<Cidr>,
}

/// What a matcher asks of one header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderTest {
    Present,
    Absent,
    Equals(String),
}

/// A path template: literal segments and one-segment placeholders.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    segments: Vec<Option<String>>,
}

impl Template {
    /// `/users/{id}/export`. A placeholder is a whole segment; its name documents it.
    pub fn parse(text: &str) -> Result<Template, String> {
        if !text.starts_with('/') {
            return Err(format!("must start with '/', got {text:?}"));
        }
        let segments = text[1..]
            .split('/')
            .map(|segment| {
                if segment.starts_with('{') && segment.ends_with('}') && segment.len() > 2 {
                    Ok(None)
                } else if segment.contains(['{', '}']) {
                    Err(format!(
                        "{text:?}: a placeholder is a whole segment, such as /users/{{id}}"
                    ))
                } else {
                    Ok(Some(segment.to_string()))
                }
            })
            .collect::<Result<_, _>>()?;
        Ok(Template { segments })
    }

    pub fn matches(&self, path: &str) -> bool {
        let Some(rest) = path.strip_prefix('/') else {
            return false;
        };
        let mut parts = rest.split('/');
        for segment in &self.segments {
            match (segment, parts.next()) {
                (_, None) => return false,
                (None, Some("")) => return false,
                (None, Some(_)) => {}
                (Some(literal), Some(part)) if literal != part => return false,
                _ => {}
            }
        }
        parts.next().is_none()
    }
}

impl Matcher {
    /// Whether it reads the client address.
    pub fn needs_client_ip(&self) -> bool {
        !self.client_cidrs.is_empty()
    }

    /// Whether a request is the rule's. Paths match the normalized path (what the upstream
    /// serves) or the path as sent: a trick that changes one cannot escape the rule.
    pub fn matches(&self, request: &mut dyn RequestView) -> bool {
        if let Some(prefix) = &self.path_prefix {
            // The path as sent first: when it matches, nothing needs normalizing.
            if !request.path().starts_with(prefix.as_str())
                && !request.normal_path().starts_with(prefix.as_str())
            {
                return false;
            }
        }
        if !self.paths.is_empty()
            && !self
                .paths
                .iter()
                .any(|p| p == request.path() || p == request.normal_path())
        {
            return false;
        }
        if !self.templates.is_empty()
            && !self
                .templates
                .iter()
                .any(|t| t.matches(request.path()) || t.matches(request.normal_path()))
        {
            return false;
        }
        if !self.methods.is_empty() && !self.methods.iter().any(|m| m == request.method()) {
            return false;
        }
        if !self.hosts.is_empty() {
            let host = request.host().map(host_name).unwrap_or_default();
            if !self.hosts.iter().any(|h| host_matches(h, &host)) {
                return false;
            }
        }
        for (name, test) in &self.headers {
            let values = request.header(name);
            let ok = match test {
                HeaderTest::Present => !values.is_empty(),
                HeaderTest::Absent => values.is_empty(),
                HeaderTest::Equals(want) => values.iter().any(|v| v == want),
            };
            if !ok {
                return false;
            }
        }
        if !self.client_cidrs.is_empty() {
            let ip: Option<IpAddr> = request.client_ip().and_then(|ip| ip.parse().ok());
            if !ip.is_some_and(|ip| self.client_cidrs.iter().any(|c| c.contains(ip))) {
                return false;
            }
        }
        true
    }
}

/// The host of an `:authority`, lower case, without its port (`[::1]:80` gives `[::1]`) and
/// without a trailing dot: `api.example.com.` (the fully qualified spelling, which DNS and
/// upstreams take for `api.example.com`) is `api.example.com`.
pub fn host_name(authority: &str) -> String {
    let host = if authority.starts_with('[') {
        authority
            .split_once(']')
            .map_or(authority, |(h, _)| &authority[..h.len() + 1])
    } else {
        authority.split(':').next().unwrap_or(authority)
    };
    host.trim_end_matches('.').to_ascii_lowercase()
}

fn host_matches(pattern: &str, host: &str) -> bool {
    match pattern.strip_prefix("*.") {
        Some(domain) => host
            .strip_suffix(domain)
            .is_some_and(|sub| sub.len() > 1 && sub.ends_with('.')),
        None => pattern == host,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_match_whole_segments() {
        let t = Template::parse("/users/{id}/export").unwrap();
        assert!(t.matches("/users/42/export"));
        assert!(!t.matches("/users//export"));
        assert!(!t.matches("/users/42/export/more"));
        assert!(!t.matches("/users/42"));
        assert!(!t.matches("/users/42/exports"));
        assert!(Template::parse("/users/{id/x").is_err());
        assert!(Template::parse("users/{id}").is_err());
    }

    #[test]
    fn a_trailing_dot_is_the_same_host() {
        for authority in [
            "api.example.com.",
            "API.Example.COM.:8443",
            "api.example.com..",
            "api.example.com",
        ] {
            assert_eq!(host_name(authority), "api.example.com", "{authority:?}");
        }
        assert!(host_matches("*.example.com", &host_name("a.example.com.")));
        assert_eq!(host_name("[::1]:80"), "[::1]");
        assert_eq!(host_name("."), "");
    }

    #[test]
    fn hosts_ignore_case_and_port_and_wildcards_need_a_subdomain() {
        assert_eq!(host_name("API.Example.com:8443"), "api.example.com");
        assert_eq!(host_name("[::1]:80"), "[::1]");
        assert!(host_matches("*.example.com", "api.example.com"));
        assert!(!host_matches("*.example.com", "example.com"));
        assert!(!host_matches("*.example.com", "badexample.com"));
        assert!(host_matches("example.com", "example.com"));
    }
}
