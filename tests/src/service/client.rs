//! A blocking HTTP client for the service's endpoints.

use anyhow::{Context, Result};

pub(crate) use crate::reply::agent;
pub use crate::reply::Reply;

pub(crate) fn send(
    agent: &ureq::Agent,
    method: &str,
    url: &str,
    token: Option<&str>,
    body: Option<&str>,
) -> Result<Reply> {
    let response = match (method, body) {
        ("PUT", Some(body)) => {
            let mut request = agent.put(url).header("content-type", "application/json");
            if let Some(token) = token {
                request = request.header("authorization", format!("Bearer {token}"));
            }
            request.send(body)
        }
        ("DELETE", _) => {
            let mut request = agent.delete(url);
            if let Some(token) = token {
                request = request.header("authorization", format!("Bearer {token}"));
            }
            request.call()
        }
        (_, Some(body)) => {
            let mut request = agent.post(url).header("content-type", "application/json");
            if let Some(token) = token {
                request = request.header("authorization", format!("Bearer {token}"));
            }
            request.send(body)
        }
        (_, None) => {
            let mut request = agent.get(url);
            if let Some(token) = token {
                request = request.header("authorization", format!("Bearer {token}"));
            }
            request.call()
        }
    }
    .with_context(|| format!("{method} {url}"))?;
    Reply::read(response, &format!("{method} {url}"))
}
