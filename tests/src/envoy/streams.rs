//! Many requests at once as streams of one HTTP/2 connection (cleartext, prior knowledge: h2c), as a browser or a
//! script multiplexes them; Envoy's HTTP connection manager takes HTTP/2 on a listener of the default codec.

use std::time::Duration;

use anyhow::{Context, Result};

/// `n` requests `method path` with `headers` (and no body), all sent before any answer is awaited, on one HTTP/2
/// connection to `127.0.0.1:port`: their statuses, in the order sent. Each answer is awaited for at most `within`.
pub fn streams(
    port: u16,
    n: usize,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    within: Duration,
) -> Result<Vec<u16>> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .with_context(|| format!("connect to 127.0.0.1:{port}"))?;
        let (client, connection) = h2::client::handshake(tcp).await.context("h2 handshake")?;
        let driver = tokio::spawn(connection);
        let mut client = client.ready().await.context("h2 ready")?;
        let mut answers = Vec::with_capacity(n);
        for _ in 0..n {
            let mut request = http::Request::builder()
                .method(method)
                .uri(format!("http://127.0.0.1:{port}{path}"));
            for (name, value) in headers {
                request = request.header(*name, *value);
            }
            let (answer, _) = client.send_request(request.body(())?, true)?;
            answers.push(answer);
            client = client
                .ready()
                .await
                .context("h2 ready for the next stream")?;
        }
        let mut statuses = Vec::with_capacity(n);
        for (i, answer) in answers.into_iter().enumerate() {
            let response = tokio::time::timeout(within, answer)
                .await
                .with_context(|| format!("stream {i}: no answer within {within:?}"))?
                .with_context(|| format!("stream {i}"))?;
            statuses.push(response.status().as_u16());
        }
        driver.abort();
        Ok(statuses)
    })
}
