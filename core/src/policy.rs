//! The validated policy: what the operator configured, as values. Built by [`crate::config`].

use crate::limit::Limit;
pub use crate::matcher::Matcher;
use crate::net::Cidr;

/// The whole plugin configuration, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    pub headers: HeaderStyle,
    pub bypass: Bypass,
    pub client_ip: ClientIp,
    pub rules: Vec<Rule>,
    /// Per rule, how many keys a proxy remembers before it forgets the least recently used.
    pub max_keys: u32,
    /// The counter service, when rules share limits across proxies.
    pub service: Option<Service>,
    /// Load shedding, when configured.
    pub shedding: Option<crate::shed::Shedding>,
}

/// Which rate-limit headers go on responses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderStyle {
    None,
    /// `X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset`.
    Legacy,
    /// IETF draft-11 `RateLimit-Policy` and `RateLimit`.
    Draft,
    Both,
}

impl HeaderStyle {
    pub fn legacy(self) -> bool {
        matches!(self, HeaderStyle::Legacy | HeaderStyle::Both)
    }

    pub fn draft(self) -> bool {
        matches!(self, HeaderStyle::Draft | HeaderStyle::Both)
    }
}

/// Requests that skip every rule.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Bypass {
    /// Exact paths (query string ignored), e.g. health checks.
    pub paths: Vec<String>,
    /// Client addresses that are never limited.
    pub cidrs: Vec<Cidr>,
    /// The emergency switch: when set, nothing is limited.
    pub all: bool,
}

/// How the client address is found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClientIp {
    /// 0: the downstream peer. N > 0: the N-th `X-Forwarded-For` entry from the right.
    pub trusted_hops: u32,
}

/// A rule's identity within its policy: its place in `rules`. Metrics, keys waiting for a
/// sync and strict checks name rules by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RuleId(u32);

impl RuleId {
    pub fn new(index: usize) -> RuleId {
        RuleId(index as u32)
    }

    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// One rate-limit rule: which requests, keyed how, limited how.
#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    pub name: String,
    pub matcher: Matcher,
    pub key: Vec<KeyPart>,
    pub limits: Vec<Limit>,
    pub mode: Mode,
    pub consistency: Consistency,
    pub fallback: Fallback,
}

/// One part of a rule's key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyPart {
    ClientIp,
    /// A request header, by lower-case name. A request without it is not counted by the rule.
    Header(String),
    Path,
    Method,
    Const(String),
}

/// Whether a rule denies, or only counts what it would deny.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Enforce,
    Shadow,
}

/// Where a rule's count lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Consistency {
    /// This proxy only.
    Local,
    /// Local decisions from a quota lease that the sync refreshes.
    Cached,
    /// One counter-service check per request.
    Strict,
}

/// What a rule does when the counter service cannot be used (breaker open, lease expired).
#[derive(Debug, Clone, PartialEq)]
pub enum Fallback {
    /// Decide locally with these limits.
    Open(Vec<Limit>),
    /// Deny.
    Closed,
}

/// The counter service, as an Envoy cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Service {
    pub cluster: String,
    pub authority: String,
    pub token: String,
    pub timeout_ms: u64,
    pub sync_interval_ms: u64,
    /// Consecutive failures that open the circuit breaker.
    pub breaker_failures: u32,
    /// How long the breaker stays open before one probe.
    pub breaker_cooldown_ms: u64,
}

impl Policy {
    /// The rule `id` names.
    pub fn rule(&self, id: RuleId) -> Option<&Rule> {
        self.rules.get(id.index())
    }

    /// Every rule with its identity.
    pub fn rules(&self) -> impl Iterator<Item = (RuleId, &Rule)> {
        self.rules
            .iter()
            .enumerate()
            .map(|(index, rule)| (RuleId::new(index), rule))
    }

    /// Whether any rule keys on the client address (so the filter must read it).
    pub fn needs_client_ip(&self) -> bool {
        !self.bypass.cidrs.is_empty()
            || self
                .rules
                .iter()
                .any(|rule| rule.key.contains(&KeyPart::ClientIp))
    }

    /// Whether any rule talks to the counter service, or shedding reports to it.
    pub fn needs_service(&self) -> bool {
        self.shedding.as_ref().is_some_and(|s| s.fleet) && self.service.is_some()
            || self
                .rules
                .iter()
                .any(|rule| rule.consistency != Consistency::Local)
    }
}
