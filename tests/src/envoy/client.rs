//! Requests to Envoy over keep-alive connections: one [`ureq::Agent`] per thread is one connection.

use anyhow::{Context, Result};

pub use crate::reply::{agent, Reply};

/// `GET url` with `headers`.
pub fn get(agent: &ureq::Agent, url: &str, headers: &[(&str, &str)]) -> Result<Reply> {
    let mut request = agent.get(url);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let what = format!("GET {url}");
    let response = request.call().with_context(|| what.clone())?;
    Reply::read(response, &what)
}
