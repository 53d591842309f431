//! Which requests a rule or a bulkhead applies to.

use crate::request::RequestView;

/// Which requests a rule applies to. Empty parts match everything.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Matcher {
    pub path_prefix: Option<String>,
    /// Upper-case method names.
    pub methods: Vec<String>,
}

impl Matcher {
    /// Whether a request is the rule's. A path prefix matches the normalized path (what the
    /// upstream serves) or the path as sent: a trick that changes one cannot escape the rule.
    pub fn matches(&self, request: &dyn RequestView) -> bool {
        if let Some(prefix) = &self.path_prefix {
            // The path as sent first: when it matches, nothing needs normalizing.
            if !request.path().starts_with(prefix.as_str())
                && !request.normal_path().starts_with(prefix.as_str())
            {
                return false;
            }
        }
        self.methods.is_empty() || self.methods.iter().any(|m| m == request.method())
    }
}
