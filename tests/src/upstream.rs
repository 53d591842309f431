//! An HTTP/1.1 upstream of a test's own, on a free loopback port: it answers every request with a
//! status the test sets, or holds it unanswered until the test releases it. It counts the requests
//! it received, so that a test can see what a proxy sent it (a retry, a request a breaker let
//! through) and what it did not (an ejected host).
//!
//! ```no_run
//! use sluice_tests::upstream::{Mode, Upstream};
//!
//! let upstream = Upstream::start(Mode::Hold)?;   // holds every request
//! // ... point a cluster at 127.0.0.1:upstream.port(), send requests ...
//! upstream.release(503);                          // the held ones answered 503; new ones still held
//! upstream.set_mode(Mode::Answer(200));           // from now on, 200 at once
//! # Ok::<(), anyhow::Error>(())
//! ```

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

/// What the upstream does with a request it receives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Answers this status at once.
    Answer(u16),
    /// Holds it unanswered until [`Upstream::release`] (or for [`HOLD_AT_MOST`]).
    Hold,
}

/// The longest a request is held without a release: then it is answered 504, so that no thread
/// outlives its test by much.
pub const HOLD_AT_MOST: Duration = Duration::from_secs(30);

#[derive(Debug)]
struct State {
    mode: Mode,
    received: u64,
    held: usize,
    /// Raised by each release; a request held waits for one raised after it arrived.
    releases: u64,
    release_status: u16,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    released: Condvar,
    stopped: AtomicBool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// A running upstream; stops accepting when dropped (and answers what it still holds).
#[derive(Debug)]
pub struct Upstream {
    port: u16,
    shared: Arc<Shared>,
}

impl Upstream {
    /// An upstream on a free loopback port, in `mode`.
    pub fn start(mode: Mode) -> Result<Upstream> {
        let listener = TcpListener::bind("127.0.0.1:0").context("binding a test upstream")?;
        let port = listener.local_addr()?.port();
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                mode,
                received: 0,
                held: 0,
                releases: 0,
                release_status: 200,
            }),
            released: Condvar::new(),
            stopped: AtomicBool::new(false),
        });
        let accepting = Arc::clone(&shared);
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                if accepting.stopped.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(stream) = stream else { continue };
                let shared = Arc::clone(&accepting);
                std::thread::spawn(move || serve(stream, &shared));
            }
        });
        Ok(Upstream { port, shared })
    }

    /// Its port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// What it does with the requests it receives from now on (those held stay held).
    pub fn set_mode(&self, mode: Mode) {
        self.shared.lock().mode = mode;
    }

    /// Answers every request held now with `status`.
    pub fn release(&self, status: u16) {
        let mut state = self.shared.lock();
        state.releases += 1;
        state.release_status = status;
        self.shared.released.notify_all();
    }

    /// How many requests it received (each attempt of a retried request is one).
    pub fn received(&self) -> u64 {
        self.shared.lock().received
    }

    /// How many requests it holds now (one the proxy gave up on stays counted until released).
    pub fn held(&self) -> usize {
        self.shared.lock().held
    }

    /// Waits until it received `count` requests in all, for at most `within`: whether it did.
    pub fn received_reaching(&self, count: u64, within: Duration) -> bool {
        crate::eventually(within, || self.received() >= count)
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.shared.stopped.store(true, Ordering::SeqCst);
        self.release(503);
        // Wake the accepting thread so that it sees the stop.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

/// One connection: requests (a GET's head; any body is read by its content-length) answered in
/// turn until the peer closes it or the upstream stops.
fn serve(mut stream: TcpStream, shared: &Shared) {
    let _ = stream.set_read_timeout(Some(HOLD_AT_MOST + Duration::from_secs(30)));
    let mut buffer = Vec::new();
    loop {
        let Some(head_end) = read_head(&mut stream, &mut buffer) else {
            return;
        };
        let head = String::from_utf8_lossy(&buffer[..head_end]).to_ascii_lowercase();
        let body = head
            .lines()
            .find_map(|line| line.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse::<usize>().ok())
            .unwrap_or(0);
        while buffer.len() < head_end + body {
            let mut chunk = [0u8; 4096];
            match stream.read(&mut chunk) {
                Ok(0) | Err(_) => return,
                Ok(n) => buffer.extend_from_slice(&chunk[..n]),
            }
        }
        buffer.drain(..head_end + body);
        if shared.stopped.load(Ordering::SeqCst) {
            return;
        }
        let status = answer(shared);
        let text = format!("upstream {status}\n");
        let reply = format!(
            "HTTP/1.1 {status} Test\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\r\n{text}",
            text.len()
        );
        if stream.write_all(reply.as_bytes()).is_err() {
            return;
        }
    }
}

/// Counts the request and decides its status: at once, or once released.
fn answer(shared: &Shared) -> u16 {
    let mut state = shared.lock();
    state.received += 1;
    match state.mode {
        Mode::Answer(status) => status,
        Mode::Hold => {
            let arrived = state.releases;
            state.held += 1;
            let deadline = Instant::now() + HOLD_AT_MOST;
            while state.releases == arrived {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    state.held -= 1;
                    return 504;
                }
                state = shared
                    .released
                    .wait_timeout(state, left)
                    .map(|(guard, _)| guard)
                    .unwrap_or_else(|poisoned| poisoned.into_inner().0);
            }
            state.held -= 1;
            state.release_status
        }
    }
}

/// Reads until `buffer` holds a whole request head; its length (through the blank line), or
/// `None` once the peer closed the connection.
fn read_head(stream: &mut TcpStream, buffer: &mut Vec<u8>) -> Option<usize> {
    loop {
        if let Some(at) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
            return Some(at + 4);
        }
        let mut chunk = [0u8; 4096];
        match stream.read(&mut chunk) {
            Ok(0) | Err(_) => return None,
            Ok(n) => buffer.extend_from_slice(&chunk[..n]),
        }
    }
}
