//! Free loopback ports, asked of the kernel.

use std::net::TcpListener;

use anyhow::{Context, Result};

/// `n` distinct free ports on 127.0.0.1. The listeners are held until all are picked, then released for
/// Envoy to bind; another process may take one in between, so callers retry on a bind failure.
pub fn free_ports(n: usize) -> Result<Vec<u16>> {
    let listeners = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").context("binding 127.0.0.1:0"))
        .collect::<Result<Vec<_>>>()?;
    listeners
        .iter()
        .map(|l| Ok(l.local_addr()?.port()))
        .collect()
}
