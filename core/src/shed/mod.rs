//! Load shedding: per-bulkhead in-flight limits (static or adaptive), priority classes,
//! deadlines, success-rate rejection, a bounded wait, a fleet level and degradation levels.
//! Rate limits protect the upstream from one client and answer 429; shedding protects it from
//! everyone at once and answers 503.
//!
//! ```text
//! request ──admit──▶ Admitted (holds a slot) ──stream ends──▶ release
//!            │  └──▶ Queue ──tick / a slot frees──▶ Admitted
//!            │                └──wait runs out / pushed out──▶ 503
//!            └─────▶ Shed: 503 + Retry-After
//! tick ──▶ samples folded into the window ──window over──▶ controller step ──▶ gauge
//! ```

pub mod admission;
pub mod controller;
pub mod histogram;
pub mod policy;
pub mod queue;
pub mod state;
pub mod tick;

pub use admission::{admit, release, Admission, Pressure, Seat, ShedReason};
pub use policy::{Level, ShedMode, Shedding};
pub use queue::{Queued, WaitQueue, Waiter};
pub use state::Gauge;
pub use tick::{load_report, tick, Samples};
