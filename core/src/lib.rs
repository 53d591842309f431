//! sluice's pure core: limits and their algorithms, the policy model, key building, headers and
//! the sync protocol. No I/O and no clock: time is an argument.

pub mod config;
pub mod exchange;
pub mod limit;
pub mod limiter;
pub mod overrides;
pub mod policy;
pub mod reply;
/// The wire contract, shared with the counter service.
pub use sluice_protocol as protocol;
pub mod request;
pub mod shed;
pub mod store;
pub mod sync;
pub mod top;
pub mod worker;

pub use config::{parse, ConfigError};
pub use exchange::{Effect, Exchange, Moment, Reply, Step};
pub use limit::token_bucket::{LimitState, Verdict};
pub use limit::{Algorithm, Limit, Period};
pub use limiter::decision::{Decision, Evaluation, Outcome, Quota};
pub use limiter::{Conditions, Limiter};
pub use policy::Policy;
pub use request::{PlainRequest, RequestView};
pub use store::{MemoryStore, Store, StoreError};
