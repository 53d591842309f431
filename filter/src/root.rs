//! The root context: parses the configuration once, prepares shared state, runs the sync on
//! ticks, and makes one HTTP context per request.

use std::hash::{BuildHasher, Hasher};
use std::rc::Rc;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{ContextType, LogLevel};
use sluice_core::{Limiter, Store};

use crate::announce::Announcer;
use crate::host::SharedData;
use crate::http::Request;
use crate::metrics::Metrics;
use crate::shared::Shared;
use crate::shedder::Shedder;
use crate::syncer::Syncer;

#[derive(Default)]
pub struct Root {
    shared: Option<Rc<Shared>>,
    syncer: Syncer,
    proxy_id: String,
    /// When this root context last stamped its key tables in the registry.
    tables_at_us: u64,
    /// Its tables the registry did not track at the last stamp (it was full).
    untracked: Vec<String>,
    /// When this worker last published or logged its rules' top keys (`sluice_core::top`).
    top_at_us: u64,
}

impl Context for Root {
    fn on_done(&mut self) -> bool {
        // The VM is going away: what its requests counted since the last tick is not lost.
        if let Some(shared) = &self.shared {
            shared.metrics.flush();
        }
        true
    }

    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        if let Some(shared) = self.shared.clone() {
            self.syncer
                .answered(&shared, token_id, num_headers, body_size);
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let config = self.get_plugin_configuration().unwrap_or_default();
        let policy = match sluice_core::parse(&config) {
            Ok(policy) => policy,
            Err(error) => {
                let _ = hostcalls::log(
                    LogLevel::Error,
                    &format!("sluice: invalid configuration: {error}"),
                );
                return false;
            }
        };
        let secret = secret();
        let limiter = Limiter::with_secret(policy, secret);
        crate::shared::prepare(&limiter);
        let service = limiter.policy().service.clone();
        let metrics = Metrics::define(
            limiter.rules().map(|r| r.rule.name.as_str()),
            service.is_some(),
        );
        if service.is_some() && limiter.policy().needs_service() {
            self.syncer.start();
            self.proxy_id = proxy_id();
        }
        let _ = hostcalls::log(
            LogLevel::Info,
            &format!(
                "sluice: configured {} rule(s), {} keys per rule{}",
                limiter.policy().rules.len(),
                limiter.policy().max_keys,
                service.map_or(String::new(), |s| format!(
                    ", syncing with {} every {} ms as {}",
                    s.upstream.describe(),
                    s.sync_interval_ms,
                    self.proxy_id
                )),
            ),
        );
        let shedder = limiter.policy().shedding.as_ref().map(Shedder::new);
        // One tick for everything, set once (nginx traps a second setting): core picks the
        // finest any part needs, 1 s at most, so the counters reach the host's stats within
        // about a second.
        let _ = hostcalls::set_tick_period(std::time::Duration::from_millis(limiter.tick_ms()));
        let now = crate::host::now_us();
        self.keep_tables(&limiter, now);
        self.shared = Some(Rc::new(Shared::new(
            limiter,
            secret,
            metrics,
            self.proxy_id.clone(),
            Announcer::new(self.syncer.queue()),
            shedder,
        )));
        true
    }

    fn on_tick(&mut self) {
        if let Some(shared) = self.shared.clone() {
            let now = crate::host::now_us();
            shared.shaper.tick(now);
            self.syncer.tick(&shared, &self.proxy_id);
            let limiter = shared.limiter();
            // A tick may come late or early by a little: stamp at 0.9 heartbeat or more.
            let every = sluice_core::limit::registry::HEARTBEAT_EVERY_US / 10 * 9;
            if now.saturating_sub(self.tables_at_us) >= every {
                self.keep_tables(&limiter, now);
            }
            // Its rules' top keys: to the proxy's summary for the sync, or (no service) logged.
            for line in sluice_core::top::tick(&limiter, &mut self.top_at_us, now, &mut SharedData)
            {
                crate::host::log_info(&line);
            }
            if let (Some(shedder), Some(shedding)) =
                (&shared.shedder, limiter.policy().shedding.as_ref())
            {
                shedder.tick(shedding, limiter.policy());
            }
            // The requests' counters reach Envoy's stats here, a tick after they moved (the
            // tick is 1 s at most: see `on_configure`).
            shared.metrics.flush();
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        let shared = self.shared.clone()?;
        Some(Box::new(Request::new(shared, context_id)))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

impl Root {
    /// Stamps its key tables ([`crate::shared::keep_tables`]); says when the registry leaves
    /// some untracked, and when they are tracked again.
    fn keep_tables(&mut self, limiter: &Limiter, now: u64) {
        self.tables_at_us = now;
        let Some(untracked) = crate::shared::keep_tables(limiter, now) else {
            return;
        };
        if untracked == self.untracked {
            return;
        }
        if untracked.is_empty() {
            crate::host::log_warn("sluice: every key table in use is tracked again");
        } else {
            crate::host::log_warn(&format!(
                "sluice: the key table registry is full ({} tables): {} table(s) in use not tracked \
                 until room is made, and not emptied if unused before that: {}",
                sluice_core::limit::registry::MAX_TABLES,
                untracked.len(),
                untracked
                    .iter()
                    .take(5)
                    .map(String::as_str)
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        self.untracked = untracked;
    }
}

const PROXY_ID_KEY: &str = "sluice/proxy-id";
const SECRET_KEY: &str = "sluice/secret";

/// This proxy's identity towards the counter service: random, made once per process and
/// shared by its workers.
fn proxy_id() -> String {
    let id = once_per_proxy(PROXY_ID_KEY, || format!("p-{:016x}", random()).into_bytes());
    String::from_utf8(id).unwrap_or_else(|_| format!("p-{:016x}", random()))
}

/// The secret that keys the hash placing keys in the key tables: random, made once per process
/// and shared by its workers, never sent anywhere.
fn secret() -> [u64; 2] {
    let bytes = once_per_proxy(SECRET_KEY, || {
        [random().to_le_bytes(), random().to_le_bytes()].concat()
    });
    let half = |at: usize| {
        bytes
            .get(at..at + 8)
            .and_then(|b| b.try_into().ok())
            .map_or(0, u64::from_le_bytes)
    };
    [half(0), half(8)]
}

/// 64 random bits from the host (WASI `random_get`, through std's hasher seeding).
fn random() -> u64 {
    std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish()
}

/// The value of a shared-data key that the first VM to configure makes and every later VM
/// reads (Envoy configures its main-thread VM before any worker's).
fn once_per_proxy(key: &str, make: impl FnOnce() -> Vec<u8>) -> Vec<u8> {
    let mut store = SharedData;
    if let Ok(Some((value, _))) = store.get(key) {
        if !value.is_empty() {
            return value;
        }
    }
    let value = make();
    let _ = store.set(key, &value, 0);
    match store.get(key) {
        Ok(Some((stored, _))) if !stored.is_empty() => stored,
        _ => value,
    }
}
