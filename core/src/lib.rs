//! sluice's pure core: limits and their algorithms, the policy model, key building, headers and
//! the sync protocol. No I/O and no clock: time is an argument.

pub mod algorithm;
pub mod bucket;
pub mod claims;
pub mod config;
pub mod decision;
pub mod exchange;
pub mod headers;
pub mod key;
pub mod limit;
pub mod limiter;
pub mod live;
pub mod log;
pub mod matcher;
pub mod net;
pub mod overrides;
pub mod path;
pub mod pending;
pub mod policy;
pub mod reply;
/// The wire contract, shared with the counter service.
pub use sluice_protocol as protocol;
pub mod request;
pub mod round;
pub mod shed;
pub mod store;
pub mod table;
pub mod tables;
pub mod window;

pub use bucket::{Bucket, Verdict};
pub use config::{parse, ConfigError};
pub use decision::{Decision, Evaluation, Outcome, Quota};
pub use exchange::{Effect, Exchange, Moment, Reply, Step};
pub use limit::{Algorithm, Limit, Period};
pub use limiter::{Conditions, Limiter};
pub use policy::Policy;
pub use request::{PlainRequest, RequestView};
pub use store::{MemoryStore, Store, StoreError};
pub mod breaker;
pub mod proxy_sync;
