//! Building a rule's key from a request.

use crate::policy::{KeyPart, Rule};

/// What the limiter may ask of a request. The filter answers from host calls, tests from values.
pub trait RequestView {
    /// Upper-case method, e.g. `GET`.
    fn method(&self) -> &str;
    /// The path without its query string.
    fn path(&self) -> &str;
    /// The client address, already resolved through trusted hops.
    fn client_ip(&mut self) -> Option<&str>;
    /// A request header by lower-case name.
    fn header(&mut self, name: &str) -> Option<String>;
}

/// Separates key parts; a control character no header value may hold.
pub const SEPARATOR: char = '\u{1f}';

/// The rule's key for this request (`rule name`, then each part), or `None` when a part is
/// missing: such a request is not counted by the rule.
pub fn build(rule: &Rule, request: &mut dyn RequestView) -> Option<String> {
    let mut key = String::with_capacity(64);
    key.push_str(&rule.name);
    for part in &rule.key {
        key.push(SEPARATOR);
        match part {
            KeyPart::ClientIp => key.push_str(request.client_ip()?),
            KeyPart::Header(name) => key.push_str(&request.header(name)?),
            KeyPart::Path => key.push_str(request.path()),
            KeyPart::Method => key.push_str(request.method()),
            KeyPart::Const(value) => key.push_str(value),
        }
    }
    Some(key)
}

/// A request as plain values, for tests and tools.
#[derive(Debug, Clone, Default)]
pub struct PlainRequest {
    pub method: String,
    pub path: String,
    pub client_ip: Option<String>,
    pub headers: Vec<(String, String)>,
}

impl PlainRequest {
    pub fn get(path: &str) -> PlainRequest {
        PlainRequest {
            method: "GET".into(),
            path: path.into(),
            ..PlainRequest::default()
        }
    }

    pub fn from_ip(mut self, ip: &str) -> PlainRequest {
        self.client_ip = Some(ip.into());
        self
    }

    pub fn with_header(mut self, name: &str, value: &str) -> PlainRequest {
        self.headers.push((name.to_ascii_lowercase(), value.into()));
        self
    }
}

impl RequestView for PlainRequest {
    fn method(&self) -> &str {
        &self.method
    }

    fn path(&self) -> &str {
        &self.path
    }

    fn client_ip(&mut self) -> Option<&str> {
        self.client_ip.as_deref()
    }

    fn header(&mut self, name: &str) -> Option<String> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
    }
}
