//! What one replica of the service remembers of the live overrides between syncs
//! ([`crate::overrides`] reads and writes them in Redis).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use sluice_protocol::LiveOverrides;

/// What one replica remembers of the set: the last set it read (by version), and the last
/// bypass (answered while Redis fails).
#[derive(Debug, Default)]
pub struct Cache {
    set: Mutex<Option<Arc<LiveOverrides>>>,
    bypass: AtomicBool,
}

impl Cache {
    pub(crate) fn current(&self) -> Option<Arc<LiveOverrides>> {
        self.set.lock().map(|set| set.clone()).unwrap_or_default()
    }

    pub(crate) fn store(&self, set: Arc<LiveOverrides>) {
        if let Ok(mut current) = self.set.lock() {
            *current = Some(set);
        }
    }

    pub(crate) fn set_bypass(&self, bypass: bool) {
        self.bypass.store(bypass, Ordering::Relaxed);
    }

    /// The bypass the last successful read answered (false before any).
    pub fn last_bypass(&self) -> bool {
        self.bypass.load(Ordering::Relaxed)
    }
}
