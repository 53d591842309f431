//! What the limiter may ask of a request, and a request as plain values for tests and tools.

/// What the limiter may ask of a request. The filter answers from host calls, tests from values.
pub trait RequestView {
    /// Upper-case method, e.g. `GET`.
    fn method(&self) -> &str;
    /// The path as the client sent it, without its query string.
    fn path(&self) -> &str;
    /// The path as an upstream reads it ([`crate::path::normalize`]): what rules match and key on.
    fn normal_path(&self) -> &str;
    /// The client address, already resolved through trusted hops.
    fn client_ip(&mut self) -> Option<&str>;
    /// Every value of a request header, by lower-case name, in order (empty when absent).
    /// A value that is not UTF-8 comes as [`crate::key::header_value`] makes it.
    fn header(&mut self, name: &str) -> Vec<String>;
    /// The `:authority` (host and port) as sent.
    fn host(&mut self) -> Option<&str>;
    /// Every value of a query parameter, percent-decoded, in order (empty when absent).
    fn query(&mut self, name: &str) -> Vec<String>;
    /// A claim of the JWT Envoy's `jwt_authn` filter verified for this request (a string; a
    /// dotted name walks into objects), `None` when no verified token carries it.
    fn claim(&mut self, name: &str) -> Option<String>;
}

/// The values of `name` in a query string (`a=1&b=2`), percent-decoded.
pub fn query_values(query: &str, name: &str) -> Vec<String> {
    form_urlencoded::parse(query.as_bytes())
        .filter(|(k, _)| k == name)
        .map(|(_, v)| v.into_owned())
        .collect()
}

/// A request as plain values, for tests and tools.
#[derive(Debug, Clone, Default)]
pub struct PlainRequest {
    pub method: String,
    pub path: String,
    pub client_ip: Option<String>,
    pub headers: Vec<(String, String)>,
    /// Verified JWT claims (what `jwt_authn` would have written), by name.
    pub claims: Vec<(String, String)>,
    /// The normalized path, made once when a rule asks.
    pub normal: std::cell::OnceCell<String>,
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

    pub fn with_claim(mut self, name: &str, value: &str) -> PlainRequest {
        self.claims.push((name.into(), value.into()));
        self
    }
}

impl RequestView for PlainRequest {
    fn method(&self) -> &str {
        &self.method
    }

    fn path(&self) -> &str {
        self.path
            .split_once('?')
            .map_or(&self.path, |(path, _)| path)
    }

    fn normal_path(&self) -> &str {
        self.normal
            .get_or_init(|| crate::path::normalize(&self.path).into_owned())
    }

    fn client_ip(&mut self) -> Option<&str> {
        self.client_ip.as_deref()
    }

    fn header(&mut self, name: &str) -> Vec<String> {
        self.headers
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
            .collect()
    }

    fn host(&mut self) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == ":authority" || n == "host")
            .map(|(_, v)| v.as_str())
    }

    fn query(&mut self, name: &str) -> Vec<String> {
        self.path
            .split_once('?')
            .map(|(_, q)| query_values(q, name))
            .unwrap_or_default()
    }

    fn claim(&mut self, name: &str) -> Option<String> {
        self.claims
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
    }
}
