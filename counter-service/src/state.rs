//! What every handler shares: the settings, Redis, the scripts, the metrics.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::backend::{Backend, BackendError};
use crate::metrics::Metrics;
use crate::scripts::Scripts;
use crate::settings::Settings;

#[derive(Clone)]
pub struct AppState {
    pub settings: Arc<Settings>,
    pub backend: Arc<Backend>,
    pub scripts: Arc<Scripts>,
    pub metrics: Arc<Metrics>,
    in_flight: Arc<AtomicUsize>,
}

impl AppState {
    /// The state for these settings. Does not wait for Redis (see [`Backend::new`]).
    pub fn new(settings: Settings) -> Result<AppState, BackendError> {
        let metrics = Arc::new(Metrics::new());
        let backend = Backend::new(&settings, metrics.clone())?;
        Ok(AppState {
            settings: Arc::new(settings),
            backend: Arc::new(backend),
            scripts: Arc::new(Scripts::new()),
            metrics,
            in_flight: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// Counts a request in flight until the guard drops.
    pub fn enter(&self) -> InFlight {
        let now = self.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
        self.metrics.in_flight.set(now as i64);
        InFlight {
            state: self.clone(),
        }
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }
}

/// One request in flight (see [`AppState::enter`]).
pub struct InFlight {
    state: AppState,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let now = self
            .state
            .in_flight
            .fetch_sub(1, Ordering::Relaxed)
            .saturating_sub(1);
        self.state.metrics.in_flight.set(now as i64);
    }
}
