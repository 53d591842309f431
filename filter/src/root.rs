//! The root context: parses the configuration once, prepares shared state, and makes one
//! HTTP context per request.

use std::rc::Rc;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{ContextType, LogLevel};
use sluice_core::{Limiter, Store};

use crate::host::SharedData;
use crate::http::Request;
use crate::metrics::Metrics;

/// What every request of this VM shares: the limiter and the metric ids.
pub struct Shared {
    pub limiter: Limiter,
    pub metrics: Metrics,
}

#[derive(Default)]
pub struct Root {
    shared: Option<Rc<Shared>>,
}

impl Context for Root {}

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
        let limiter = Limiter::new(policy);
        prepare(&limiter);
        let metrics = Metrics::define(limiter.policy().rules.iter().map(|r| r.name.as_str()));
        let _ = hostcalls::log(
            LogLevel::Info,
            &format!(
                "sluice: configured {} rule(s), {} keys per rule",
                limiter.policy().rules.len(),
                limiter.policy().max_keys
            ),
        );
        self.shared = Some(Rc::new(Shared { limiter, metrics }));
        true
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        let shared = self.shared.clone()?;
        Some(Box::new(Request::new(shared)))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// Creates every set of every rule's key table before the first request.
///
/// proxy-wasm's compare-and-swap cannot create a key atomically (cas 0 writes unconditionally),
/// so two workers creating the same set at once could lose a count. The first VM to configure
/// (Envoy's main-thread VM, before any worker serves) creates them all; later VMs find them.
fn prepare(limiter: &Limiter) {
    let mut store = SharedData;
    for rule in 0..limiter.policy().rules.len() {
        let Some(table) = limiter.table(rule) else {
            continue;
        };
        if matches!(store.get(&table.set_key_at(0)), Ok(Some(_))) {
            continue;
        }
        for set in 0..table.sets() {
            let _ = store.set(&table.set_key_at(set), &[], 0);
        }
    }
}
