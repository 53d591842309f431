//! The proxy's half of the sync with the counter service (the service's half is
//! `counter-service/src/sync_handler.rs` and `lua/sync.lua`): [`proxy`], the proxy-wide sync state
//! in shared data (who syncs this round, leases applied to records); [`round`], one round from
//! batch to answer (compose, settle, undo, keep in doubt); [`outbox`], the keys waiting for a
//! round; [`breaker`], the circuit breaker.

pub mod breaker;
pub mod outbox;
pub mod proxy;
pub mod round;
