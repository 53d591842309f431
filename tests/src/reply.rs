//! One blocking HTTP client for every fixture: an agent, and a response read whole.

use std::time::Duration;

use anyhow::{Context, Result};

/// An agent that returns 4xx/5xx as replies (not errors), ignores any proxy settings of the environment,
/// and gives up on a request after 10 s. One agent per thread is one keep-alive connection.
pub fn agent() -> ureq::Agent {
    let config = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .proxy(None)
        .timeout_global(Some(Duration::from_secs(10)))
        .build();
    ureq::Agent::new_with_config(config)
}

/// A response, read whole.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    /// Header names in lower case, in the order received.
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Reply {
    /// Reads a response whole; `what` names the request in errors (`GET http://…`).
    pub fn read(mut response: ureq::http::Response<ureq::Body>, what: &str) -> Result<Reply> {
        let status = response.status().as_u16();
        let headers = response
            .headers()
            .iter()
            .map(|(n, v)| {
                let value = String::from_utf8_lossy(v.as_bytes()).into_owned();
                (n.as_str().to_ascii_lowercase(), value)
            })
            .collect();
        let body = response
            .body_mut()
            .read_to_string()
            .with_context(|| format!("reading the body of {what}"))?;
        Ok(Reply {
            status,
            headers,
            body,
        })
    }

    /// The first header named `name` (any case).
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }

    /// Whether any header name starts with one of the rate-limit prefixes.
    pub fn has_rate_limit_headers(&self) -> bool {
        self.headers.iter().any(|(n, _)| {
            n.starts_with("x-ratelimit") || n.starts_with("ratelimit") || n == "retry-after"
        })
    }

    /// The body as JSON.
    pub fn json(&self) -> Result<serde_json::Value> {
        serde_json::from_str(&self.body).with_context(|| format!("not JSON: {}", self.body))
    }
}
