//! Free loopback ports for Redis (and, for a cluster node, its bus port: the port + 10000).

use std::net::TcpListener;

use anyhow::{bail, Result};

/// A port on 127.0.0.1 that is free now, with `port + 10000` free too when `with_bus`.
/// Another process may take it before Redis binds it: callers retry on a start failure.
pub fn free_port(with_bus: bool) -> Result<u16> {
    for _ in 0..200 {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let port = listener.local_addr()?.port();
        if !with_bus {
            return Ok(port);
        }
        if port < 55_000 && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return Ok(port);
        }
    }
    bail!("no free loopback port (with its cluster bus port) after 200 tries")
}
