//! Shared queues: named, process-wide, ready-notified on the VM that registered them.

use std::collections::{BTreeMap, HashMap, VecDeque};

/// A notification owed to a registering root context (`proxy_on_queue_ready`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct QueueReady {
    pub worker: usize,
    pub context_id: u32,
    pub token: u32,
}

#[derive(Debug)]
struct Queue {
    worker: usize,
    context_id: u32,
    items: VecDeque<Vec<u8>>,
}

/// proxy-wasm-cpp-host's `SharedQueue`: tokens from 1; registering a (vm_id, name) pair again
/// keeps the token and items but moves the ready notifications to the latest registrant.
#[derive(Debug, Default)]
pub(crate) struct SharedQueues {
    next_token: u32,
    tokens: HashMap<(String, String), u32>,
    queues: BTreeMap<u32, Queue>,
}

impl SharedQueues {
    pub(crate) fn register(
        &mut self,
        vm_id: &str,
        name: &str,
        worker: usize,
        context_id: u32,
    ) -> u32 {
        let slot = (vm_id.to_string(), name.to_string());
        let token = match self.tokens.get(&slot) {
            Some(token) => *token,
            None => {
                self.next_token += 1;
                self.tokens.insert(slot, self.next_token);
                self.next_token
            }
        };
        let queue = self.queues.entry(token).or_insert_with(|| Queue {
            worker,
            context_id,
            items: VecDeque::new(),
        });
        queue.worker = worker;
        queue.context_id = context_id;
        token
    }

    pub(crate) fn resolve(&self, vm_id: &str, name: &str) -> Option<u32> {
        self.tokens
            .get(&(vm_id.to_string(), name.to_string()))
            .copied()
    }

    /// Appends `item`; returns whom to notify, or `None` for an unknown token.
    pub(crate) fn enqueue(&mut self, token: u32, item: Vec<u8>) -> Option<QueueReady> {
        let queue = self.queues.get_mut(&token)?;
        queue.items.push_back(item);
        Some(QueueReady {
            worker: queue.worker,
            context_id: queue.context_id,
            token,
        })
    }

    /// `None` for an unknown token, `Some(None)` for an empty queue.
    pub(crate) fn dequeue(&mut self, token: u32) -> Option<Option<Vec<u8>>> {
        self.queues
            .get_mut(&token)
            .map(|queue| queue.items.pop_front())
    }

    /// Items waiting in the queue of `token`, and their bytes.
    pub(crate) fn size(&self, token: u32) -> Option<(usize, usize)> {
        self.queues
            .get(&token)
            .map(|queue| (queue.items.len(), queue.items.iter().map(Vec::len).sum()))
    }
}
