//! What every handler shares: the settings, the credentials, Redis, the scripts, the metrics.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::backend::{Backend, BackendError};
use crate::credentials::Credentials;
use crate::metrics::Metrics;
use crate::scripts::Scripts;
use crate::settings::Settings;

#[derive(Clone)]
pub struct AppState {
    pub settings: Arc<Settings>,
    pub credentials: Arc<Credentials>,
    pub backend: Arc<Backend>,
    pub scripts: Arc<Scripts>,
    pub metrics: Arc<Metrics>,
    in_flight: Arc<AtomicUsize>,
}

impl AppState {
    /// The state for these settings: checks them and reads the token files. Does not wait for
    /// Redis (see [`Backend::new`]).
    pub fn new(settings: Settings) -> Result<AppState, StartError> {
        let credentials = settings.credentials().map_err(StartError::Settings)?;
        let metrics = Arc::new(Metrics::new());
        let backend = Backend::new(&settings, metrics.clone()).map_err(StartError::Redis)?;
        Ok(AppState {
            settings: Arc::new(settings),
            credentials: Arc::new(credentials),
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

/// Why the service cannot start with these settings.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A flag is invalid (the message names it), or a token file cannot be read.
    #[error("{0}")]
    Settings(String),
    /// `--redis-url` is not a Redis URL.
    #[error("--redis-url: {0}")]
    Redis(BackendError),
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
