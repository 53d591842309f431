//! What the reloads of files wait for: SIGHUP, or a while (then they compare modification times).

use std::time::Duration;

/// A SIGHUP listener (none where signals are not available).
pub struct Hangup {
    #[cfg(unix)]
    signal: Option<tokio::signal::unix::Signal>,
}

impl Hangup {
    pub fn new() -> Hangup {
        Hangup {
            #[cfg(unix)]
            signal: tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok(),
        }
    }

    /// Waits for SIGHUP or `interval`, whichever comes first: whether it was SIGHUP.
    pub async fn or_sleep(&mut self, interval: Duration) -> bool {
        #[cfg(unix)]
        if let Some(signal) = self.signal.as_mut() {
            return tokio::select! {
                _ = signal.recv() => true,
                () = tokio::time::sleep(interval) => false,
            };
        }
        tokio::time::sleep(interval).await;
        false
    }
}

impl Default for Hangup {
    fn default() -> Hangup {
        Hangup::new()
    }
}
