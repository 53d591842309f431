//! One request written byte for byte over its own connection: for request targets an HTTP client would clean up
//! before sending (`/./api/x`, `/x/../api/x`, `//api/x`, `%2e`), so the test knows exactly what Envoy received.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::reply::Reply;

/// Sends `GET <target> HTTP/1.1` to `127.0.0.1:port` exactly as given (with `Host`, `Connection: close` and
/// `headers`), reads the response to the end and returns it. The body is returned as received (a chunked body
/// keeps its chunk framing).
pub fn raw_get(port: u16, target: &str, headers: &[(&str, &str)]) -> Result<Reply> {
    let headers: Vec<(&str, &[u8])> = headers.iter().map(|(n, v)| (*n, v.as_bytes())).collect();
    raw_get_bytes(port, target, &headers)
}

/// [`raw_get`] with header values as bytes: values that are not UTF-8, or a header repeated.
pub fn raw_get_bytes(port: u16, target: &str, headers: &[(&str, &[u8])]) -> Result<Reply> {
    raw_get_to(port, target, &format!("127.0.0.1:{port}"), headers)
}

/// [`raw_get_bytes`] with `Host: host` (`api.example.com.`, a host with a trailing dot).
pub fn raw_get_to(port: u16, target: &str, host: &str, headers: &[(&str, &[u8])]) -> Result<Reply> {
    let what = format!("raw GET {target} (Host {host}) on port {port}");
    let mut stream =
        TcpStream::connect(("127.0.0.1", port)).with_context(|| format!("{what}: connecting"))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    stream.set_write_timeout(Some(Duration::from_secs(10)))?;
    let mut request = format!("GET {target} HTTP/1.1\r\nHost: {host}\r\n").into_bytes();
    for (name, value) in headers {
        request.extend_from_slice(name.as_bytes());
        request.extend_from_slice(b": ");
        request.extend_from_slice(value);
        request.extend_from_slice(b"\r\n");
    }
    request.extend_from_slice(b"Connection: close\r\n\r\n");
    stream
        .write_all(&request)
        .with_context(|| format!("{what}: writing"))?;
    let mut bytes = Vec::new();
    stream
        .read_to_end(&mut bytes)
        .with_context(|| format!("{what}: reading"))?;
    parse_response(&bytes).with_context(|| what.clone())
}

/// An HTTP/1.1 response: status line, headers, and whatever follows the blank line.
fn parse_response(bytes: &[u8]) -> Result<Reply> {
    let text = String::from_utf8_lossy(bytes);
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        bail!(
            "no complete response head in {} byte(s): {text:?}",
            bytes.len()
        );
    };
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse::<u16>().ok())
        .with_context(|| format!("not a status line: {status_line:?}"))?;
    let headers = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    Ok(Reply {
        status,
        headers,
        body: body.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_response() {
        let reply = parse_response(
            b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 2\r\ncontent-length: 2\r\n\r\n{}",
        )
        .unwrap();
        assert_eq!(reply.status, 429);
        assert_eq!(reply.header("retry-after"), Some("2"));
        assert_eq!(reply.body, "{}");
        assert!(parse_response(b"HTTP/1.1 200 OK\r\n").is_err());
    }
}
