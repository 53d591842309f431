//! sluice's counter service: keeps the global truth of every limit in Redis and answers the
//! proxies' batched syncs (`POST /v1/sync`) with quota leases, the fleet's load level and the live
//! overrides operators set through the admin API (`/admin/v1`), and strict checks
//! (`POST /v1/check`).
//!
//! Stateless: any number of replicas can share one Redis or Redis Cluster.

pub mod admin;
pub mod app;
pub mod auth;
pub mod backend;
pub mod backpressure;
pub mod body;
pub mod check_handler;
pub mod client_certs;
pub mod credentials;
pub mod error;
pub mod fleet;
pub mod hangup;
pub mod key_admin;
pub mod keys;
pub mod metrics;
pub mod override_cache;
pub mod overrides;
pub mod probes;
pub mod redis_access;
pub mod reload;
pub mod rls;
pub mod scripts;
pub mod server;
pub mod settings;
pub mod state;
pub mod status;
pub mod status_cache;
pub mod sync_handler;
pub mod tls;
pub mod top;
pub mod validate;

pub use app::app;
pub use backend::{Backend, BackendError};
pub use error::AppError;
pub use settings::Settings;
pub use state::{AppState, StartError};
