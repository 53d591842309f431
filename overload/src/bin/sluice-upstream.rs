//! An upstream of fixed capacity for the overload benchmark: `--workers K` requests are served at
//! once, each takes `--service-ms S` (a sleep), and the rest wait in an unbounded FIFO queue (a fair
//! semaphore), so latency grows with the load, as behind a real overloaded service. Capacity is
//! K / S requests per second (8 / 25 ms = 320/s).
//!
//! - `GET /stats`: `{"served", "max_queue", "in_service", "queued", "arrived", "failed",
//!   "service_ms_mean", "workers"}`, not queued;
//! - `GET /capacity?workers=N`: serves N at once from now on (the capacity changes in the middle
//!   of a run: requests in service finish, no new one starts until fewer than N are), not queued;
//! - any path under `/health`: 200 at once, not queued;
//! - anything else: queued, then 200 `ok` (or 500 for a `--fail-rate` share, every n-th, for
//!   success-rate shedding).
//!
//! A request whose client goes away (Envoy's route timeout) is still served when its turn comes,
//! as a thread-pool server does: abandoned work keeps costing capacity. `--drop-abandoned` instead
//! removes it from the queue (and stops its service) the moment the client leaves.
//!
//! Prints `{"port":N}` on stdout once listening (`--port 0` picks a free port).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{header, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::serve::ListenerExt;
use axum::Router;
use clap::Parser;
use std::collections::VecDeque;
use std::sync::Mutex;

use tokio::sync::oneshot;

#[derive(Parser, Debug)]
#[command(about = "An HTTP/1.1 upstream of fixed capacity (K workers, S ms each, FIFO queue)")]
struct Args {
    /// Port on 127.0.0.1 (0: a free one; the port is printed as {"port":N}).
    #[arg(long, default_value_t = 0)]
    port: u16,
    /// Requests served at once.
    #[arg(long, default_value_t = 8)]
    workers: usize,
    /// Service time of one request, in milliseconds.
    #[arg(long, default_value_t = 25)]
    service_ms: u64,
    /// Fraction of requests (0 to 1) answered 500 instead of 200, every n-th.
    #[arg(long, default_value_t = 0.0)]
    fail_rate: f64,
    /// Drop a request from the queue (or from service) when its client goes away, instead of
    /// serving it anyway.
    #[arg(long)]
    drop_abandoned: bool,
}

/// A FIFO of requests waiting for one of `capacity` workers, whose capacity can change at any time.
#[derive(Default)]
struct Gate {
    capacity: usize,
    busy: usize,
    waiting: VecDeque<oneshot::Sender<()>>,
}

impl Gate {
    /// Hands free workers to the waiters, oldest first (a waiter whose client left is skipped).
    fn fill(&mut self) {
        while self.busy < self.capacity {
            let Some(next) = self.waiting.pop_front() else {
                break;
            };
            if next.send(()).is_ok() {
                self.busy += 1;
            }
        }
    }
}

/// A worker, given back when dropped.
struct Worker<'a>(&'a Mutex<Gate>);

impl Drop for Worker<'_> {
    fn drop(&mut self) {
        let mut gate = self.0.lock().unwrap_or_else(|p| p.into_inner());
        gate.busy -= 1;
        gate.fill();
    }
}

async fn acquire(gate: &Mutex<Gate>) -> Worker<'_> {
    let wait = {
        let mut g = gate.lock().unwrap_or_else(|p| p.into_inner());
        if g.busy < g.capacity && g.waiting.is_empty() {
            g.busy += 1;
            None
        } else {
            let (tx, rx) = oneshot::channel();
            g.waiting.push_back(tx);
            Some(rx)
        }
    };
    if let Some(rx) = wait {
        // The sender is only dropped after a send or with the gate (never, while serving).
        let _ = rx.await;
    }
    Worker(gate)
}

struct Upstream {
    workers: Mutex<Gate>,
    service: Duration,
    fail_rate: f64,
    drop_abandoned: bool,
    arrived: AtomicU64,
    served: AtomicU64,
    failed: AtomicU64,
    queued: AtomicUsize,
    max_queue: AtomicUsize,
    in_service: AtomicUsize,
    /// Microseconds spent in service, over every served request.
    busy_us: AtomicU64,
    /// The mean overshoot of the timer, in microseconds.
    overshoot_us: AtomicU64,
}

/// +1 on a gauge for as long as it lives (so a request dropped while waiting leaves it right).
struct Held<'a>(&'a AtomicUsize);

impl<'a> Held<'a> {
    fn new(gauge: &'a AtomicUsize) -> (Self, usize) {
        let now = gauge.fetch_add(1, Ordering::Relaxed) + 1;
        (Self(gauge), now)
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Upstream {
    /// Waits for a worker (FIFO), serves for the service time, and says whether the answer is a failure.
    async fn work(&self) -> bool {
        let n = self.arrived.fetch_add(1, Ordering::Relaxed);
        let permit = {
            let (_waiting, now) = Held::new(&self.queued);
            self.max_queue.fetch_max(now, Ordering::Relaxed);
            acquire(&self.workers).await
        };
        {
            let _serving = Held::new(&self.in_service);
            // Tokio's timer rounds a sleep up to its next millisecond tick (25 ms sleeps ~26): sleep for
            // the service time less the mean overshoot seen so far, so that the mean is the service time.
            let overshoot = Duration::from_micros(self.overshoot_us.load(Ordering::Relaxed));
            let asked = self.service.saturating_sub(overshoot);
            let began = Instant::now();
            tokio::time::sleep(asked).await;
            let took = began.elapsed();
            self.busy_us
                .fetch_add(took.as_micros() as u64, Ordering::Relaxed);
            // An exponential moving average (1/16) of how much longer than asked a sleep took.
            let seen = took.saturating_sub(asked).as_micros() as i64;
            let old = self.overshoot_us.load(Ordering::Relaxed) as i64;
            let new = (old + (seen - old) / 16).max(0);
            self.overshoot_us.store(new as u64, Ordering::Relaxed);
        }
        drop(permit);
        self.served.fetch_add(1, Ordering::Relaxed);
        let failed = sluice_overload::fails(n, self.fail_rate);
        if failed {
            self.failed.fetch_add(1, Ordering::Relaxed);
        }
        failed
    }

    fn stats(&self) -> serde_json::Value {
        let served = self.served.load(Ordering::Relaxed);
        let busy_ms = self.busy_us.load(Ordering::Relaxed) as f64 / 1000.0;
        serde_json::json!({
            "service_ms_mean": if served > 0 { (busy_ms / served as f64 * 1000.0).round() / 1000.0 } else { 0.0 },
            "served": served,
            "max_queue": self.max_queue.load(Ordering::Relaxed),
            "in_service": self.in_service.load(Ordering::Relaxed),
            "queued": self.queued.load(Ordering::Relaxed),
            "arrived": self.arrived.load(Ordering::Relaxed),
            "failed": self.failed.load(Ordering::Relaxed),
            "workers": self.workers.lock().map_or(0, |g| g.capacity),
        })
    }
}

fn text(status: StatusCode, body: &'static str) -> Response {
    (status, [(header::CONTENT_TYPE, "text/plain")], body).into_response()
}

async fn handle(State(up): State<Arc<Upstream>>, method: Method, uri: Uri) -> Response {
    let path = uri.path();
    if path == "/stats" && method == Method::GET {
        return axum::Json(up.stats()).into_response();
    }
    if path == "/capacity" {
        let workers = uri
            .query()
            .and_then(|q| q.strip_prefix("workers="))
            .and_then(|n| n.parse::<usize>().ok())
            .filter(|&n| n > 0);
        let Some(workers) = workers else {
            return text(
                StatusCode::BAD_REQUEST,
                "expected /capacity?workers=N, N > 0\n",
            );
        };
        let mut gate = up.workers.lock().unwrap_or_else(|p| p.into_inner());
        gate.capacity = workers;
        gate.fill();
        return text(StatusCode::OK, "ok\n");
    }
    if path.starts_with("/health") {
        return text(StatusCode::OK, "ok\n");
    }
    let failed = if up.drop_abandoned {
        up.work().await
    } else {
        // A task of its own: dropping this handler (the client left) does not cancel the work.
        let up = up.clone();
        // A panicked task (none is expected) answers as a failure.
        tokio::spawn(async move { up.work().await })
            .await
            .unwrap_or(true)
    };
    if failed {
        text(StatusCode::INTERNAL_SERVER_ERROR, "fail\n")
    } else {
        text(StatusCode::OK, "ok\n")
    }
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    if args.workers == 0 || !(0.0..=1.0).contains(&args.fail_rate) {
        eprintln!("sluice-upstream: --workers must be > 0 and --fail-rate within 0..=1");
        std::process::exit(2);
    }
    let upstream = Arc::new(Upstream {
        workers: Mutex::new(Gate {
            capacity: args.workers,
            ..Gate::default()
        }),
        service: Duration::from_millis(args.service_ms),
        fail_rate: args.fail_rate,
        drop_abandoned: args.drop_abandoned,
        arrived: AtomicU64::new(0),
        served: AtomicU64::new(0),
        failed: AtomicU64::new(0),
        queued: AtomicUsize::new(0),
        max_queue: AtomicUsize::new(0),
        in_service: AtomicUsize::new(0),
        busy_us: AtomicU64::new(0),
        overshoot_us: AtomicU64::new(0),
    });
    let app = Router::new().fallback(handle).with_state(upstream);
    let addr = SocketAddr::from(([127, 0, 0, 1], args.port));
    let listener = match tokio::net::TcpListener::bind(addr).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("sluice-upstream: cannot listen on {addr}: {e}");
            std::process::exit(1);
        }
    };
    let port = listener.local_addr().map(|a| a.port()).unwrap_or(args.port);
    println!("{}", serde_json::json!({ "port": port }));
    eprintln!(
        "sluice-upstream: 127.0.0.1:{port}, {} workers x {} ms ({:.0} req/s), fail rate {}{}",
        args.workers,
        args.service_ms,
        args.workers as f64 * 1000.0 / args.service_ms.max(1) as f64,
        args.fail_rate,
        if args.drop_abandoned {
            ", abandoned requests dropped"
        } else {
            ""
        }
    );
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    if let Err(e) = axum::serve(listener, app).await {
        eprintln!("sluice-upstream: {e}");
        std::process::exit(1);
    }
}
