//! Harness proxies talking to a real counter service: their HTTP callouts are posted to the
//! service by a few caller threads (so a slow answer never stalls arrivals) and the answers handed
//! back to the proxy that called. Used by the examples that run fleets of harness proxies
//! (accuracy, Redis cost) and by the suites that do (clock trouble).
//!
//! Include it with `#[path = "support/bridge.rs"] mod bridge;` (from tests/) or
//! `#[path = "../tests/support/bridge.rs"] mod bridge;` (from examples/).

#![allow(dead_code)]

use std::collections::HashSet;
use std::sync::{mpsc, Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use anyhow::Result;
use sluice_host::Proxy;

/// A callout to forward: (proxy index, call token, path, body).
type Job = (usize, u32, String, Vec<u8>);

/// A callout's answer from the service.
pub struct Answer {
    /// Which proxy called.
    pub proxy: usize,
    pub token: u32,
    /// The path it called (`/v1/sync`, `/v1/check`).
    pub path: String,
    pub status: u16,
    pub body: Vec<u8>,
}

/// Caller threads between a fleet of harness proxies and the service at `url`.
pub struct Bridge {
    jobs: Option<mpsc::Sender<Job>>,
    answers: mpsc::Receiver<Answer>,
    forwarded: HashSet<(usize, u32)>,
    pool: Vec<JoinHandle<()>>,
}

impl Bridge {
    /// `callers` threads posting to `url` with the bearer `token`; a call unanswered within
    /// `timeout` (or refused) is answered 503 with no body, as a dead service would be.
    pub fn new(url: &str, token: &str, callers: usize, timeout: Duration) -> Bridge {
        let (jobs, job_rx) = mpsc::channel::<Job>();
        let job_rx = Arc::new(Mutex::new(job_rx));
        let (answer_tx, answers) = mpsc::channel::<Answer>();
        let pool = (0..callers.max(1))
            .map(|_| {
                let job_rx = job_rx.clone();
                let answer_tx = answer_tx.clone();
                let url = url.to_string();
                let token = token.to_string();
                thread::spawn(move || {
                    let agent = ureq::Agent::new_with_config(
                        ureq::Agent::config_builder()
                            .http_status_as_error(false)
                            .timeout_global(Some(timeout))
                            .build(),
                    );
                    while let Ok((proxy, call_token, path, body)) = next_job(&job_rx) {
                        let reply = agent
                            .post(&format!("{url}{path}"))
                            .header("authorization", &format!("Bearer {token}"))
                            .header("content-type", "application/json")
                            .send(&body[..]);
                        let (status, body) = match reply {
                            Ok(mut r) => (
                                r.status().as_u16(),
                                r.body_mut().read_to_vec().unwrap_or_default(),
                            ),
                            Err(_) => (503, Vec::new()),
                        };
                        let _ = answer_tx.send(Answer {
                            proxy,
                            token: call_token,
                            path,
                            status,
                            body,
                        });
                    }
                })
            })
            .collect();
        Bridge {
            jobs: Some(jobs),
            answers,
            forwarded: HashSet::new(),
            pool,
        }
    }

    /// Fires each proxy's due timers, forwards its new callouts, and hands back every answer
    /// that arrived. `set_clocks` runs first and before each answer: it moves the proxies'
    /// virtual clocks to the present (each by its own offset, if it likes).
    pub fn pump(&mut self, proxies: &[Proxy], set_clocks: &dyn Fn()) -> Result<()> {
        self.pump_observed(proxies, set_clocks, &mut |_, _| {})
    }

    /// [`Bridge::pump`], and `observe` sees each answer after it was handed back (with whether
    /// the proxy took it).
    pub fn pump_observed(
        &mut self,
        proxies: &[Proxy],
        set_clocks: &dyn Fn(),
        observe: &mut dyn FnMut(&Answer, bool),
    ) -> Result<()> {
        set_clocks();
        for (i, proxy) in proxies.iter().enumerate() {
            proxy.fire_due().map_err(|e| anyhow::anyhow!("{e}"))?;
            for call in proxy.pending_calls() {
                if self.forwarded.insert((i, call.token)) {
                    let path = call.header(":path").unwrap_or("/").to_string();
                    if let Some(jobs) = &self.jobs {
                        let _ = jobs.send((i, call.token, path, call.body.clone()));
                    }
                }
            }
        }
        while let Ok(answer) = self.answers.try_recv() {
            set_clocks();
            let proxy = &proxies[answer.proxy];
            let delivered = proxy
                .answer_call(answer.token, u32::from(answer.status), &[], &answer.body)
                .is_ok();
            self.forwarded.remove(&(answer.proxy, answer.token));
            observe(&answer, delivered);
        }
        Ok(())
    }

    /// Stops the callers once the calls already forwarded are posted.
    pub fn finish(mut self) {
        self.jobs = None;
        for caller in self.pool.drain(..) {
            let _ = caller.join();
        }
    }
}

fn next_job(rx: &Mutex<mpsc::Receiver<Job>>) -> Result<Job, mpsc::RecvError> {
    let guard = rx.lock().unwrap_or_else(|p| p.into_inner());
    guard.recv()
}

/// A small, seeded xorshift generator: the same arrivals on every run.
pub struct Rng(pub u64);

impl Rng {
    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
    }
}
