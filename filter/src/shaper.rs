//! Requests a leaky bucket holds until their slot: paused on arrival, resumed by the root's
//! tick when their time comes. A request whose stream ends first leaves the list, and its
//! exchange gives its slot back.

use std::cell::RefCell;

use proxy_wasm::hostcalls;

/// The held requests of one worker: (context id, when it leaves).
#[derive(Debug, Default)]
pub struct Shaper {
    held: RefCell<Vec<(u32, u64)>>,
}

impl Shaper {
    pub fn hold(&self, id: u32, until_us: u64) {
        self.held.borrow_mut().push((id, until_us));
    }

    /// Takes `id` out if it is still held (its stream ended before it left).
    pub fn cancel(&self, id: u32) -> bool {
        let mut held = self.held.borrow_mut();
        let before = held.len();
        held.retain(|&(h, _)| h != id);
        held.len() != before
    }

    /// The root's tick: lets go every request whose time has come.
    pub fn tick(&self, now_us: u64) {
        let due: Vec<u32> = {
            let mut held = self.held.borrow_mut();
            let due = held
                .iter()
                .filter(|&&(_, until)| until <= now_us)
                .map(|&(id, _)| id)
                .collect();
            held.retain(|&(_, until)| until > now_us);
            due
        };
        // Resuming a stream can call back into this VM: no borrow is held here.
        for id in due {
            if hostcalls::set_effective_context(id).is_ok() {
                let _ = hostcalls::resume_http_request();
            }
        }
    }
}
