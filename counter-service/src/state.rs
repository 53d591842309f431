//! What every handler shares: the settings, the credentials, Redis, the scripts, the metrics,
//! what this replica remembers of the live overrides.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use crate::backend::Backend;
use crate::client_certs::CertNames;
use crate::credentials::Credentials;
use crate::metrics::Metrics;
use crate::override_cache;
use crate::scripts::Scripts;
use crate::settings::Settings;
use sluice_core::policy::Policy;

#[derive(Clone)]
pub struct AppState {
    pub settings: Arc<Settings>,
    /// Who may call `/v1`: replaced whole when its file is read again ([`crate::reload`]).
    pub credentials: Arc<RwLock<Arc<Credentials>>>,
    /// Who may call the admin API (`--admin-tokens-file`), replaced likewise; `None`: it is
    /// disabled.
    pub admin: Option<Arc<RwLock<Arc<Credentials>>>>,
    /// Which client certificates are which proxy credential (`--client-certs-file`), replaced
    /// likewise; `None`: a certificate is nobody on `/v1`.
    pub client_certs: Option<Arc<RwLock<Arc<CertNames>>>>,
    /// Which client certificates are which admin (`--admin-client-certs-file`), likewise.
    pub admin_client_certs: Option<Arc<RwLock<Arc<CertNames>>>>,
    /// The proxies' configuration (`--policy`): admin changes are checked against it.
    pub policy: Option<Arc<Policy>>,
    pub backend: Arc<Backend>,
    pub scripts: Arc<Scripts>,
    pub metrics: Arc<Metrics>,
    pub overrides: Arc<override_cache::Cache>,
    /// `GET /v1/status`'s memory.
    pub status: Arc<crate::status_cache::StatusCache>,
    /// The proxies' top keys this replica was sent (`GET /admin/v1/top`).
    pub top: Arc<crate::top::Board>,
    in_flight: Arc<AtomicUsize>,
}

impl AppState {
    /// The state for these settings: checks them and reads the token files. Does not wait for
    /// Redis (see [`Backend::new`]).
    pub fn new(settings: Settings) -> Result<AppState, StartError> {
        let credentials = settings.credentials().map_err(StartError::Settings)?;
        let admin = settings.admin_credentials().map_err(StartError::Settings)?;
        if let Some(admin) = &admin {
            let shared = admin.tokens().into_iter().any(|token| {
                let mut header = b"Bearer ".to_vec();
                header.extend_from_slice(token);
                !matches!(credentials, Credentials::Open | Credentials::NoToken)
                    && credentials.authenticate(Some(&header)).is_some()
            });
            if shared {
                tracing::warn!(
                    "an admin token is also a proxy token: whoever holds it can call both \
                     /v1 and the admin API; give the admins tokens of their own"
                );
            }
        }
        let client_certs = settings.client_certs().map_err(StartError::Settings)?;
        let admin_client_certs = settings
            .admin_client_certs()
            .map_err(StartError::Settings)?;
        if let (Some(proxies), Some(admins)) = (&client_certs, &admin_client_certs) {
            if admins
                .sans()
                .any(|san| proxies.sans().any(|other| other == san))
            {
                tracing::warn!(
                    "a SAN is in both --client-certs-file and --admin-client-certs-file: a \
                     certificate with it can call both /v1 and the admin API; give the admins \
                     certificates of their own"
                );
            }
        }
        let policy = settings.policy().map_err(StartError::Settings)?;
        let metrics = Arc::new(Metrics::new());
        let backend = Backend::new(&settings, metrics.clone()).map_err(StartError::Settings)?;
        Ok(AppState {
            settings: Arc::new(settings),
            credentials: Arc::new(RwLock::new(Arc::new(credentials))),
            admin: admin.map(|admin| Arc::new(RwLock::new(Arc::new(admin)))),
            client_certs: client_certs.map(|certs| Arc::new(RwLock::new(Arc::new(certs)))),
            admin_client_certs: admin_client_certs
                .map(|certs| Arc::new(RwLock::new(Arc::new(certs)))),
            policy: policy.map(Arc::new),
            backend: Arc::new(backend),
            scripts: Arc::new(Scripts::new()),
            metrics,
            overrides: Arc::default(),
            status: Arc::default(),
            top: Arc::default(),
            in_flight: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// Who may call `/v1` now.
    pub fn proxies(&self) -> Arc<Credentials> {
        read(&self.credentials)
    }

    /// Who may call the admin API now; `None` when it is disabled.
    pub fn admins(&self) -> Option<Arc<Credentials>> {
        self.admin.as_ref().map(|admin| read(admin))
    }

    /// Which client certificates are which proxy credential now; `None` without a mapping.
    pub fn proxy_certs(&self) -> Option<Arc<CertNames>> {
        self.client_certs.as_ref().map(|certs| read(certs))
    }

    /// Which client certificates are which admin now; `None` without a mapping.
    pub fn admin_certs(&self) -> Option<Arc<CertNames>> {
        self.admin_client_certs.as_ref().map(|certs| read(certs))
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

/// The value behind a lock that is only ever replaced whole (a poisoned lock still holds one).
fn read<T>(lock: &RwLock<Arc<T>>) -> Arc<T> {
    match lock.read() {
        Ok(value) => value.clone(),
        Err(poisoned) => poisoned.into_inner().clone(),
    }
}

/// Why the service cannot start with these settings.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A flag is invalid (the message names it), or a token, password, CA or certificate file
    /// cannot be read or used.
    #[error("{0}")]
    Settings(String),
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
