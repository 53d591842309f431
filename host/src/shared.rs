//! Shared data: one process-wide key/value store with compare-and-swap, as in Envoy.

use std::collections::HashMap;

/// Why a shared-data write was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CasMismatch;

/// proxy-wasm-cpp-host's `SharedData`: keyed by (vm_id, key); every successful write takes the
/// next value of one process-wide cas counter (starting at 1, never 0).
#[derive(Debug)]
pub(crate) struct SharedData {
    next_cas: u32,
    entries: HashMap<(String, String), (Vec<u8>, u32)>,
}

impl Default for SharedData {
    fn default() -> Self {
        SharedData {
            next_cas: 1,
            entries: HashMap::new(),
        }
    }
}

impl SharedData {
    /// The value and its cas, or `None` if the key was never set.
    pub(crate) fn get(&self, vm_id: &str, key: &str) -> Option<(Vec<u8>, u32)> {
        self.entries
            .get(&(vm_id.to_string(), key.to_string()))
            .cloned()
    }

    /// Every key of `vm_id` (in no order): proxy-wasm cannot delete one, so they only grow.
    pub(crate) fn keys(&self, vm_id: &str) -> Vec<String> {
        self.entries
            .keys()
            .filter(|(vm, _)| vm == vm_id)
            .map(|(_, key)| key.clone())
            .collect()
    }

    /// Writes `value`. `cas == 0` always succeeds; otherwise the key's current cas must equal
    /// `cas`. A key that does not exist yet is created whatever the cas.
    pub(crate) fn set(
        &mut self,
        vm_id: &str,
        key: &str,
        value: &[u8],
        cas: u32,
    ) -> Result<(), CasMismatch> {
        let slot = (vm_id.to_string(), key.to_string());
        if let Some((_, current)) = self.entries.get(&slot) {
            if cas != 0 && cas != *current {
                return Err(CasMismatch);
            }
        }
        let next = self.take_cas();
        self.entries.insert(slot, (value.to_vec(), next));
        Ok(())
    }

    fn take_cas(&mut self) -> u32 {
        let cas = self.next_cas;
        self.next_cas = self.next_cas.wrapping_add(1).max(1);
        cas
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cas_semantics_follow_proxy_wasm_cpp_host() {
        let mut data = SharedData::default();
        assert_eq!(data.get("", "k"), None);
        data.set("", "k", b"1", 0).unwrap();
        let (_, cas) = data.get("", "k").unwrap();
        assert_eq!(data.set("", "k", b"2", cas + 1), Err(CasMismatch));
        data.set("", "k", b"2", cas).unwrap();
        assert_eq!(
            data.set("", "k", b"3", cas),
            Err(CasMismatch),
            "cas moved on"
        );
        assert_eq!(data.get("", "k").unwrap().0, b"2");
        assert_eq!(data.get("other-vm", "k"), None, "vm ids do not share");
    }
}
