//! What the limiter may ask of a request, and a request as plain values for tests and tools.

pub mod claims;
pub mod matcher;
pub mod net;
pub mod path;

use std::fmt::Write;

/// What the limiter may ask of a request. The filter answers from host calls, tests from values.
pub trait RequestView {
    /// Upper-case method, e.g. `GET`.
    fn method(&self) -> &str;
    /// The path as the client sent it, without its query string.
    fn path(&self) -> &str;
    /// The path as an upstream reads it ([`crate::request::path::normalize`]): what rules match and key on.
    fn normal_path(&self) -> &str;
    /// The client address, already resolved through trusted hops.
    fn client_ip(&mut self) -> Option<&str>;
    /// Every value of a request header, by lower-case name, in order (empty when absent).
    /// A value that is not UTF-8 comes as [`header_value`] makes it.
    fn header(&mut self, name: &str) -> Vec<String>;
    /// The first value of a request header, for a header read as one value (`content-type`):
    /// a host can read it alone, without every header's.
    fn first_header(&mut self, name: &str) -> Option<String> {
        self.header(name).into_iter().next()
    }
    /// The `:authority` (host and port) as sent.
    fn host(&mut self) -> Option<&str>;
    /// The query string as sent (after `?`, without it), if any: [`query_values`] reads it.
    fn query_string(&self) -> Option<&str>;
    /// A claim of the JWT Envoy's `jwt_authn` filter verified for this request, as its canonical
    /// text ([`crate::request::claims`]; a dotted name walks into objects), `None` when no verified token
    /// carries it or it cannot be read.
    fn claim(&mut self, name: &str) -> Option<String>;
}

/// The distinct values (at most [`MAX_VALUES`]: the first ones and the last) of
/// parameter `name` in a query string, percent-decoded. Parameters are separated by `&` or `;`
/// (`a=1;b=2`: Rack and other frameworks split on both). With `exact`, a name matches only as
/// written; otherwise in any case (`API_KEY`, `Api_Key` for `api_key`, as ASP.NET Core matches
/// them). Names are percent-decoded first (`api%5Fkey` is `api_key`). One pass, whatever the
/// number of parameters.
pub fn query_values(query: &str, name: &str, exact: bool) -> Vec<String> {
    let values = query
        .split(['&', ';'])
        .flat_map(|segment| form_urlencoded::parse(segment.as_bytes()))
        .filter(|(k, _)| {
            if exact {
                k == name
            } else {
                same_name_any_case(k, name)
            }
        })
        .map(|(_, v)| unmarked(&v).into_owned());
    distinct_of(values)
}

/// The distinct values (at most [`MAX_VALUES`]: the first ones and the last, as a repeated
/// header's) of cookie `name` in a request's `Cookie` header values. Pairs are separated by `;`
/// (and HTTP/2's several `cookie` headers are read in order, as one), every pair of every header
/// is read, however many (only the values kept are bounded): a cookie buried behind thousands of
/// junk pairs is still the cookie its backend reads, never missing. A name matches exactly
/// (cookie names are case-sensitive), the value is trimmed of spaces and of one pair of double
/// quotes (RFC 6265's `cookie-value`), then percent-decoded as [`cookie_bytes`] says (`sid=%61bc`
/// is `sid=abc`, as a backend that decodes cookies reads it). A duplicate name counts the request
/// against each of its values, as a repeated header does: a junk first cookie cannot escape an
/// exhausted real one. A pair holding a comma or white space inside is also read as the pairs
/// they separate ([`more_separator`]), and the request counted against those values too:
/// `a=1, sid=x` and `a=1 sid=x` are `a` alone to RFC 6265, but `sid=x` to Python's
/// `http.cookies` (and to parsers of RFC 2965, which separates cookies by commas too). A pair
/// without `=`, or an empty value, is not a value: a request with nothing else reads as missing
/// (never exempt). The header is read as the bytes the client sent (as [`header_value`] kept
/// them), and a value whose bytes are not UTF-8 is keyed by their hex, as such a header is: two
/// such values are two keys, never one. Linear in the header: a pair holding such a separator is
/// read once more.
pub fn cookie_values(headers: &[String], name: &str) -> Vec<String> {
    let mut found = Distinct::default();
    for header in headers {
        let header = as_sent(header);
        for pair in header.split(|&b| b == b';') {
            cookie_pair(pair, name, &mut found);
            let inner = pair.trim_ascii();
            if inner.iter().any(|&b| more_separator(b)) {
                for part in inner.split(|&b| more_separator(b)) {
                    cookie_pair(part, name, &mut found);
                }
            }
        }
    }
    found.finish()
}

/// Whether `byte` separates cookies to some backends, inside a `;`-separated pair: a comma (RFC
/// 2965) and ASCII white space, `\t` to `\r` and the space (Python's `http.cookies`, which reads
/// `a=1, sid=x` as `a` of `1,` and `sid` of `x`).
pub fn more_separator(byte: u8) -> bool {
    matches!(byte, b',' | b' ' | b'\t'..=b'\r')
}

/// The value of one `name=value` pair into `found`, when its name is `name` (as written or
/// percent-decoded) and its value is not empty: [`cookie_values`]' reading of a pair.
#[inline]
fn cookie_pair(pair: &[u8], name: &str, found: &mut Distinct) {
    let Some(eq) = pair.iter().position(|&b| b == b'=') else {
        return;
    };
    let (key, rest) = pair.split_at(eq);
    let (key, value) = (
        key.trim_ascii(),
        rest.get(1..).unwrap_or_default().trim_ascii(),
    );
    if key != name.as_bytes()
        && !(key.iter().any(|b| matches!(b, b'%' | b'+')) && cookie_bytes(key) == name.as_bytes())
    {
        return;
    }
    let value = value
        .strip_prefix(b"\"")
        .and_then(|v| v.strip_suffix(b"\""))
        .unwrap_or(value);
    if !value.is_empty() {
        found.push(header_value(&cookie_bytes(value)));
    }
}

/// A cookie's name or value as sluice keys it: percent-decoded (a `%` without two hex digits
/// kept), as `query:` values are; then `+` as a space, so that `+`, `%2B` and `%20` are one
/// (backends differ in which of them they decode, and none keeps a session's `a+b` apart from
/// its `a b`).
pub fn cookie_bytes(text: &[u8]) -> Vec<u8> {
    let mut decoded: Vec<u8> = percent_encoding::percent_decode(text).collect();
    for b in &mut decoded {
        if *b == b'+' {
            *b = b' ';
        }
    }
    decoded
}

/// A header's bytes as the client sent them, [`header_value`] undone: the [`MARK`] it put in
/// front taken off, and a header that was not UTF-8 decoded from its hex.
fn as_sent(header: &str) -> std::borrow::Cow<'_, [u8]> {
    use std::borrow::Cow;
    let Some(rest) = header.strip_prefix(MARK) else {
        return Cow::Borrowed(header.as_bytes());
    };
    if rest.starts_with(MARK) {
        return Cow::Borrowed(rest.as_bytes());
    }
    let Some(hex) = rest.strip_prefix("hex:") else {
        return Cow::Borrowed(header.as_bytes());
    };
    let digit = |b: u8| (b as char).to_digit(16);
    let bytes: Option<Vec<u8>> = hex
        .as_bytes()
        .chunks(2)
        .map(|pair| match pair {
            [high, low] => Some((digit(*high)? * 16 + digit(*low)?) as u8),
            _ => None,
        })
        .collect();
    match bytes {
        Some(bytes) => Cow::Owned(bytes),
        None => Cow::Borrowed(header.as_bytes()),
    }
}

/// Whether two names are the same in any case: ASCII without allocation; otherwise by Unicode
/// lower case or upper case (the Kelvin sign `K` is `k` in lower case), either way.
fn same_name_any_case(a: &str, b: &str) -> bool {
    if a.eq_ignore_ascii_case(b) {
        return true;
    }
    if a.is_ascii() && b.is_ascii() {
        return false;
    }
    let lower = |s: &str| s.chars().flat_map(char::to_lowercase).collect::<Vec<_>>();
    let upper = |s: &str| s.chars().flat_map(char::to_uppercase).collect::<Vec<_>>();
    lower(a) == lower(b) || upper(a) == upper(b)
}

/// A request as plain values, for tests and tools.
#[derive(Debug, Clone, Default)]
pub struct PlainRequest {
    pub method: String,
    pub path: String,
    pub client_ip: Option<String>,
    pub headers: Vec<(String, String)>,
    /// Verified JWT claims (what `jwt_authn` would have written), by name, as their canonical
    /// text ([`crate::request::claims`]: a number `12345`, an object `{"id":1}`).
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
            .get_or_init(|| crate::request::path::normalize(&self.path).into_owned())
    }

    fn client_ip(&mut self) -> Option<&str> {
        self.client_ip.as_deref()
    }

    fn header(&mut self, name: &str) -> Vec<String> {
        self.headers
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, v)| header_value(v.as_bytes()))
            .collect()
    }

    fn host(&mut self) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == ":authority" || n == "host")
            .map(|(_, v)| v.as_str())
    }

    fn query_string(&self) -> Option<&str> {
        self.path.split_once('?').map(|(_, q)| q)
    }

    fn claim(&mut self, name: &str) -> Option<String> {
        self.claims
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
            .filter(|v| !v.is_empty())
    }
}

/// Starts what sluice writes into a key itself (digests, markers). A value a client sends that
/// starts with it gets one more in front ([`unmarked`]), so no value equals a marker.
/// The value of a key part the request does not have (no such header, query parameter or verified
/// claim, no client address): the request is counted in this one bucket of the rule (per value of
/// the other parts), unless the rule says `"when_missing": "skip"`. Shown as `missing` in logs.
pub const MISSING: &str = "\u{1e}missing";

pub const MARK: char = '\u{1e}';

/// A header value as a key part: itself when it is UTF-8 ([`unmarked`]); otherwise [`MARK`],
/// `hex:` and its bytes in hex, so that two different values never share a bucket.
pub fn header_value(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(text) => unmarked(text).into_owned(),
        Err(_) => {
            let mut out = String::with_capacity(5 + 2 * bytes.len());
            out.push(MARK);
            out.push_str("hex:");
            for byte in bytes {
                let _ = write!(out, "{byte:02x}");
            }
            out
        }
    }
}

/// A value a client sent, as a key part: itself, or when it starts with [`MARK`], one more
/// [`MARK`] in front, so that it never equals a marker sluice writes itself ([`MISSING`], a
/// digest, the hex of a value that is not UTF-8).
pub fn unmarked(value: &str) -> std::borrow::Cow<'_, str> {
    if value.starts_with(MARK) {
        let mut out = String::with_capacity(value.len() + MARK.len_utf8());
        out.push(MARK);
        out.push_str(value);
        std::borrow::Cow::Owned(out)
    } else {
        std::borrow::Cow::Borrowed(value)
    }
}

/// Most distinct values of one repeated header or query parameter a key is built from: the
/// first ones and the last (the value an upstream reads is one of those).
pub const MAX_VALUES: usize = 4;

/// The values a key is built from: distinct, at most [`MAX_VALUES`].
pub(crate) fn distinct(values: Vec<String>) -> Vec<String> {
    distinct_of(values)
}

/// [`distinct`] of values as they come, holding at most [`MAX_VALUES`] of them and the last (a
/// query of thousands of repeated parameters is read once, not collected).
pub(crate) fn distinct_of(values: impl IntoIterator<Item = String>) -> Vec<String> {
    let mut found = Distinct::default();
    for value in values {
        found.push(value);
    }
    found.finish()
}

/// [`distinct_of`] filled one value at a time: at most [`MAX_VALUES`] of them and the last.
#[derive(Default)]
struct Distinct {
    out: Vec<String>,
    more: bool,
    last: Option<String>,
}

impl Distinct {
    fn push(&mut self, value: String) {
        if !self.out.contains(&value) {
            if self.out.len() < MAX_VALUES {
                self.out.push(value.clone());
            } else {
                self.more = true;
            }
        }
        self.last = Some(value);
    }

    fn finish(self) -> Vec<String> {
        let mut out = self.out;
        if self.more {
            out.truncate(MAX_VALUES - 1);
            if let Some(last) = self.last {
                if !out.contains(&last) {
                    out.push(last);
                }
            }
        }
        out
    }
}
