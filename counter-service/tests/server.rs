//! The server itself (`server::serve`, what the binary runs) on a loopback port: a client that
//! never finishes its headers is cut off, connections past the cap wait for a free slot, and a
//! stop drains.

mod common;

use std::io::ErrorKind;
use std::time::{Duration, Instant};

use common::{get_request, receive, send, settings, Server};

/// No Redis is needed for `/healthz`; the URL is never dialed.
const NO_REDIS: &str = "redis://127.0.0.1:1";

fn starts_with_200(bytes: &[u8]) -> bool {
    bytes.starts_with(b"HTTP/1.1 200")
}

/// A client that sends half of its headers and then nothing used to hold its connection (and
/// a task) forever.
#[test]
fn a_slow_client_is_closed_after_the_header_read_timeout() {
    let server = Server::start(settings(NO_REDIS, &["--header-read-timeout-ms", "300"]));
    let mut slow = server.connect();
    send(
        &mut slow,
        "POST /v1/sync HTTP/1.1\r\nHost: sluice\r\nContent-Le",
    );
    let started = Instant::now();
    // generous: closed well within 10 s (the timeout is 300 ms)
    match receive(&mut slow, Duration::from_secs(10)) {
        Ok(bytes) if bytes.is_empty() => {}
        Ok(bytes) => {
            // a 408 before the close is fine too; then the close follows
            assert!(bytes.starts_with(b"HTTP/1.1 408"), "{bytes:?}");
            let rest = receive(&mut slow, Duration::from_secs(10)).unwrap();
            assert!(rest.is_empty(), "{rest:?}");
        }
        Err(error) => assert!(
            !matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
            "still open after {:?}",
            started.elapsed()
        ),
    }
    // a client that sends nothing at all is closed as well
    let mut silent = server.connect();
    let answer = receive(&mut silent, Duration::from_secs(10));
    assert!(
        matches!(&answer, Ok(bytes) if bytes.is_empty())
            || matches!(&answer, Err(e) if e.kind() == ErrorKind::ConnectionReset),
        "{answer:?}"
    );
    // and the server still serves
    let mut client = server.connect();
    send(&mut client, &get_request("/healthz"));
    let reply = receive(&mut client, Duration::from_secs(10)).unwrap();
    assert!(
        starts_with_200(&reply),
        "{}",
        String::from_utf8_lossy(&reply)
    );
    server.stop().unwrap();
}

#[test]
fn connections_past_the_cap_wait_for_a_free_slot() {
    let server = Server::start(settings(
        NO_REDIS,
        &[
            "--max-connections",
            "1",
            "--header-read-timeout-ms",
            "60000",
        ],
    ));
    // the first connection is served, and kept alive: it holds the only slot
    let mut first = server.connect();
    send(&mut first, &get_request("/healthz"));
    let reply = receive(&mut first, Duration::from_secs(10)).unwrap();
    assert!(
        starts_with_200(&reply),
        "{}",
        String::from_utf8_lossy(&reply)
    );
    // the second waits in the backlog: no answer while the first is open
    let mut second = server.connect();
    send(&mut second, &get_request("/healthz"));
    let waiting = receive(&mut second, Duration::from_millis(500));
    assert!(
        matches!(&waiting, Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)),
        "served past the cap: {waiting:?}"
    );
    // the first closes: the second is served
    drop(first);
    let reply = receive(&mut second, Duration::from_secs(10)).unwrap();
    assert!(
        starts_with_200(&reply),
        "{}",
        String::from_utf8_lossy(&reply)
    );
    // a stop drains: the idle kept-alive connection does not hold it up
    let started = Instant::now();
    server.stop().unwrap();
    assert!(started.elapsed() < Duration::from_secs(10));
    let closed = receive(&mut second, Duration::from_secs(10));
    assert!(
        matches!(&closed, Ok(bytes) if bytes.is_empty())
            || matches!(&closed, Err(e) if e.kind() == ErrorKind::ConnectionReset),
        "{closed:?}"
    );
}
