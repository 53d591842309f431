//! The validated policy: what the operator configured, as values. Built by [`crate::config`].

use std::collections::BTreeMap;
use std::net::IpAddr;

use crate::limit::Limit;
use crate::protocol::KeyAction;
use crate::request::distinct;
pub use crate::request::matcher::Matcher;
use crate::request::net::Cidr;
pub use crate::request::MAX_VALUES;

/// The whole plugin configuration, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    /// The proxy the filter runs in.
    pub host: Host,
    pub headers: HeaderStyle,
    /// How `X-RateLimit-Reset` is written: seconds from now, or a Unix timestamp.
    pub reset: ResetFormat,
    pub bypass: Bypass,
    pub client_ip: ClientIp,
    pub rules: Vec<Rule>,
    /// Per rule, how many keys a proxy remembers before it forgets the least recently used.
    pub max_keys: u32,
    /// The counter service, when rules share limits across proxies.
    pub service: Option<Service>,
    /// Load shedding, when configured.
    pub shedding: Option<crate::shed::Shedding>,
    /// Keys an operator blocked or allowed through the counter service (live overrides):
    /// configured rule name, then the key's parts joined by `limiter::key::SEPARATOR`.
    pub key_overrides: BTreeMap<String, BTreeMap<String, KeyAction>>,
    /// When those of [`Policy::key_overrides`] set with a ttl expire (Unix milliseconds), as
    /// the service said: a blocked client is told the time left.
    pub key_expires: BTreeMap<String, BTreeMap<String, u64>>,
    /// The key overrides that name a first-present part by the value a client sent
    /// (`["127.0.0.1"]` for `header:x-user|client_ip`), built from [`Policy::key_overrides`] by
    /// [`crate::overrides::apply`]: they match that value from whichever alternative supplied it.
    pub bare_key_overrides: BareKeys,
    /// Limits an operator gave one key of a rule through the counter service (live overrides):
    /// configured rule name, then the key's parts as the filter writes them, joined by
    /// `limiter::key::SEPARATOR`. Each keeps its rule's table layout
    /// ([`crate::overrides::check_key_limits`]).
    pub key_limits: BTreeMap<String, BTreeMap<String, Vec<Limit>>>,
    /// Where Envoy's `jwt_authn` writes a verified token's payload (its `payload_in_metadata`),
    /// which `jwt:CLAIM` key parts read.
    pub jwt_payload_in_metadata: String,
    /// A page for clients about the limits: the 429 and 503 bodies name it.
    pub docs_url: Option<String>,
    /// Whether local replies tell the access log their facts ([`crate::reply::Facts`]).
    pub access_log: bool,
}

/// Per configured rule, its key overrides that give a first-present part the value a client sent
/// rather than `alternative=value` as the filter writes it (see [`Policy::bare_key_overrides`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BareKeys(BTreeMap<String, RuleBareKeys>);

/// One rule's [`BareKeys`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RuleBareKeys {
    /// Per part of the rule's key, the names of its alternatives (none for a part that is not
    /// first-present), as the filter writes them before `=`.
    names: Vec<Vec<String>>,
    /// By the key with every first-present part reduced to its value: per part, the
    /// alternative it must come from (`None`: any), and the action.
    keys: BTreeMap<String, Vec<BareKey>>,
}

/// One override in [`RuleBareKeys`]: per part, the alternative it names (`None`: any), what it
/// does, and when it expires (Unix milliseconds; 0: never).
type BareKey = (Vec<Option<usize>>, KeyAction, u64);

impl BareKeys {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn get(&self, rule: &str) -> Option<&RuleBareKeys> {
        self.0.get(rule)
    }

    /// Adds rule `rule` (keyed by `key`)'s override: per part, the alternative it names (`None`:
    /// any, or a part that is not first-present) and its value.
    pub fn insert(
        &mut self,
        rule: &str,
        key: &[KeyPart],
        parts: &[(Option<usize>, String)],
        action: KeyAction,
        expires_ms: u64,
    ) {
        let entry = self
            .0
            .entry(rule.to_string())
            .or_insert_with(|| RuleBareKeys {
                names: key
                    .iter()
                    .map(|part| match part {
                        KeyPart::First(alternatives) => {
                            alternatives.iter().map(KeyPart::name).collect()
                        }
                        _ => Vec::new(),
                    })
                    .collect(),
                keys: BTreeMap::new(),
            });
        let values: Vec<&str> = parts.iter().map(|(_, value)| value.as_str()).collect();
        let from = parts.iter().map(|(alternative, _)| *alternative).collect();
        entry
            .keys
            .entry(values.join(&crate::protocol::KEY_PART_SEPARATOR.to_string()))
            .or_default()
            .push((from, action, expires_ms));
    }
}

impl RuleBareKeys {
    /// The override of a key's `parts` (as the filter joined them): the most specific of those
    /// whose values and named alternatives it has.
    fn find(&self, parts: &str) -> Option<(KeyAction, u64)> {
        let mut values = String::with_capacity(parts.len());
        let mut from = Vec::with_capacity(self.names.len());
        let mut pieces = parts.split(crate::protocol::KEY_PART_SEPARATOR);
        for (j, names) in self.names.iter().enumerate() {
            let piece = pieces.next()?;
            if j > 0 {
                values.push(crate::protocol::KEY_PART_SEPARATOR);
            }
            if names.is_empty() {
                values.push_str(piece);
                from.push(0);
                continue;
            }
            // `alternative=value`, as the key was built.
            let (alternative, value) = names.iter().enumerate().find_map(|(a, name)| {
                piece
                    .strip_prefix(name.as_str())?
                    .strip_prefix('=')
                    .map(|value| (a, value))
            })?;
            values.push_str(value);
            from.push(alternative);
        }
        if pieces.next().is_some() {
            return None;
        }
        self.keys
            .get(&values)?
            .iter()
            .filter(|(wanted, _, _)| {
                wanted
                    .iter()
                    .zip(&from)
                    .all(|(want, got)| want.is_none_or(|want| want == *got))
            })
            .min_by_key(|(wanted, _, _)| std::cmp::Reverse(wanted.iter().flatten().count()))
            .map(|(_, action, expires_ms)| (*action, *expires_ms))
    }
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

/// One rate-limit rule: which requests, keyed how, limited how. A rule with tiers is one
/// `Rule` per tier, named `rule/tier`, each matching the requests of its tier.
#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    pub name: String,
    pub matcher: std::sync::Arc<Matcher>,
    pub key: Vec<KeyPart>,
    pub limits: Vec<Limit>,
    pub mode: Mode,
    /// In `Enforce`: the share of would-be denials actually denied, in percent (100: all);
    /// the others are admitted as in `Shadow`.
    pub ramp_percent: u8,
    pub consistency: Consistency,
    pub fallback: Fallback,
    /// A fallback sized to the fleet (`"share": "fleet"`): [`Fallback::Open`] holds the rule's
    /// limits divided among [`FleetShare::proxies`] ([`Rule::size_to_fleet`]).
    pub share: Option<FleetShare>,
    /// Tokens one request spends.
    pub cost: u64,
    /// A response header whose value (whole tokens) is charged after the response.
    pub cost_header: Option<String>,
    /// Counts only the requests whose response matches: each request is checked up front
    /// (denied once the key is over) but spends nothing until its answer, which spends `cost`
    /// when it matches.
    pub count_when: Option<CountWhen>,
    /// How long a key stays denied once it went over, in microseconds (0: no penalty).
    pub penalty_us: u64,
    /// Counters of the sketches of its most admitted and denied keys, per worker and kind
    /// ([`crate::top`]; 0: its keys are not counted).
    pub top_keys: u32,
    /// The tier this rule counts, for a rule with tiers.
    pub tier: Option<TierOf>,
    /// What a request missing a key part gets.
    pub when_missing: WhenMissing,
    /// What a client the rule denies is answered, and where its rate-limit headers go.
    pub answer: Answer,
    /// Limits that follow load (`scale`) and time (`schedule`): `None` for a rule whose limits
    /// are always its own, which then pays one test for it ([`crate::limit::dynamic`]).
    pub dynamic: Option<Box<crate::limit::dynamic::Dynamic>>,
    /// A path (`/rate_limit`) answered with the caller's own quota of this rule, spending
    /// nothing of it, never forwarded: the request is decided by the other rules first, as any.
    pub quota_path: Option<String>,
    /// The rule's key has a part the caller sends, and its `quota_path` answers anyway
    /// (`quota_path_any_key`): whoever names a key reads its quota.
    pub quota_path_any_key: bool,
    /// The rule's limit read from each request (a verified claim, a header a trusted filter
    /// sets), bounded; `None` for the rule's own limits alone.
    pub limits_from: Option<LimitsFrom>,
    /// In a copy of the rule made for a request's `limits_from` value, the requests that value
    /// gave (a refund gives back under them); 0 in the rule as configured.
    pub given: u32,
}

/// A rule's `limits_from`: its one limit's `requests` read from the request, at most `max`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitsFrom {
    /// Where the value is read: `jwt:CLAIM` or `header:NAME`.
    pub from: KeyPart,
    /// The most the value may give (values above it give `max`).
    pub max: u64,
}

/// Longest value `limits_from` reads as a number: 19 digits fit a `u64`.
pub const MAX_LIMIT_DIGITS: usize = 19;

impl LimitsFrom {
    /// The limit a request carrying `value` gets in place of `own` (the rule's one limit):
    /// `requests` the value, at most [`LimitsFrom::max`], its burst in the proportion of the
    /// rule's (a window's is its requests); the period and algorithm the rule's. `None` (the rule's
    /// own limit) for a value that is not a whole number of 1 to 19 digits, is 0, or admits less
    /// than `cost` at once: what the filter cannot read never exempts a request, and nothing read
    /// raises a key above `max`.
    pub fn limit(&self, own: &Limit, value: Option<&str>, cost: u64) -> Option<Limit> {
        let value = value?;
        if value.is_empty()
            || value.len() > MAX_LIMIT_DIGITS
            || !value.bytes().all(|b| b.is_ascii_digit())
        {
            return None;
        }
        let requests = value.parse::<u64>().ok()?.min(self.max);
        if requests == 0 {
            return None;
        }
        let limit = own.with_requests(requests)?;
        (limit.burst() >= cost).then_some(limit)
    }
}

/// Which responses a `count_when` rule counts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CountWhen {
    /// Response statuses (100 to 599), sorted, without duplicates.
    pub statuses: Vec<u32>,
}

impl CountWhen {
    /// Whether a response of `status` is counted.
    pub fn counts(&self, status: u32) -> bool {
        self.statuses.binary_search(&status).is_ok()
    }
}

/// A rule's own answer (its `deny_status`, `deny_message`, `headers_on_admitted`,
/// `headers_on_denied`), checked by [`crate::config::check_rule`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// The status of a denial: 429, or 400 to 599.
    pub status: u32,
    /// The `message` of a denial's body (and gRPC answer), instead of the limit's description.
    pub message: Option<String>,
    /// Whether an admitted response carries this rule's rate-limit headers (when it is the
    /// most restrictive rule that counted the request).
    pub headers_admitted: bool,
    /// Whether a denial by this rule carries its rate-limit headers (`Retry-After` always).
    pub headers_denied: bool,
}

impl Default for Answer {
    fn default() -> Answer {
        Answer {
            status: 429,
            message: None,
            headers_admitted: true,
            headers_denied: true,
        }
    }
}

/// How `X-RateLimit-Reset` is written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ResetFormat {
    /// Seconds until the quota is whole again (the default).
    #[default]
    Seconds,
    /// The Unix time (seconds) at which it is.
    Unix,
}

/// What a rule does with a request that does not have one of its key parts (no such header,
/// query parameter or verified claim, no readable client address).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum WhenMissing {
    /// Counts it with every such request of the rule, the part's value being
    /// [`crate::request::MISSING`]: a part nobody can read never exempts anyone.
    #[default]
    Count,
    /// Does not count it (the rule is meant only for requests that have the part).
    Skip,
}

/// Which tier's requests a rule (one tier of a configured rule) counts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TierOf {
    /// The configured rule's name (the tier's rule is `rule/tier`).
    pub rule: String,
    /// The tier's name.
    pub name: String,
    /// Where a request's tier comes from.
    pub from: KeyPart,
    /// The default tier also counts requests without a tier or of a tier not configured:
    /// those are the others.
    pub default_for: Option<Vec<String>>,
}

impl TierOf {
    /// Whether `request` is of this tier.
    pub fn holds(&self, request: &mut dyn crate::request::RequestView) -> bool {
        let values = self.from.values(request);
        let tier = values.first().map(String::as_str);
        match (&self.default_for, tier) {
            (_, Some(t)) if t == self.name => true,
            (Some(others), Some(t)) => !others.iter().any(|o| o == t),
            (Some(_), None) => true,
            (None, _) => false,
        }
    }
}

impl Rule {
    /// This rule counting with `limits` in place of its own (a live override of the rule): a
    /// fallback that was its own limits becomes them, a fleet share divides them among as many
    /// proxies as it did the old, and its scale and schedule stay, each window's limit at most
    /// the override's (an override that lowers a limit holds through every window; one that
    /// raises it leaves a lower window in force). A window whose layout no longer matches the
    /// limits is skipped ([`crate::limit::dynamic::Dynamic::in_force`]).
    pub fn with_limits(&self, limits: &[Limit]) -> Rule {
        let mut rule = self.clone();
        if rule.fallback == Fallback::Open(rule.limits.clone()) {
            rule.fallback = Fallback::Open(limits.to_vec());
        }
        rule.limits = limits.to_vec();
        if let Some(dynamic) = rule.dynamic.as_mut() {
            for window in &mut dynamic.schedule {
                if crate::limit::dynamic::same_layout(&window.limits, limits) {
                    for (own, ceiling) in window.limits.iter_mut().zip(limits) {
                        if ceiling.requests() < own.requests() {
                            *own = *ceiling;
                        }
                    }
                }
            }
        }
        if let Some(share) = rule.share {
            rule.size_to_fleet(share.proxies);
        }
        rule
    }

    /// This rule without its `penalty`: as it counts its missing bucket
    /// ([`crate::limiter::key::in_missing_bucket`]).
    pub fn without_penalty(&self) -> Rule {
        Rule {
            penalty_us: 0,
            ..self.clone()
        }
    }

    /// This rule as it counts one key with limits of its own: [`with_limits`](Self::with_limits),
    /// without the schedule and without `limits_from`. A key's contract holds day and night (the
    /// rule's windows would put the rule's limits back in place of the key's; a scale still
    /// lowers them), and it is the key's limit whatever value its requests carry.
    pub fn with_key_limits(&self, limits: &[Limit]) -> Rule {
        let mut rule = self.with_limits(limits);
        if let Some(dynamic) = rule.dynamic.as_mut() {
            dynamic.schedule.clear();
        }
        rule.limits_from = None;
        rule
    }

    /// With a fleet share, divides the rule's limits among `proxies` (at least 1) into its
    /// fallback; otherwise nothing.
    pub fn size_to_fleet(&mut self, proxies: u32) {
        if let Some(share) = &mut self.share {
            share.proxies = proxies.max(1);
            self.fallback = Fallback::Open(shared_limits(&self.limits, share.proxies, self.cost));
        }
    }

    /// Whether the rule applies to `request`: its matcher and, with tiers, its tier.
    pub fn applies(&self, request: &mut dyn crate::request::RequestView) -> bool {
        self.matcher.matches(request) && self.tier.as_ref().is_none_or(|t| t.holds(request))
    }

    /// The rule's `penalty` as the wire carries it, in whole milliseconds (0: none): the
    /// configuration takes whole seconds, so nothing is lost.
    pub fn penalty_ms(&self) -> u64 {
        self.penalty_us / 1_000
    }
}

/// One part of a rule's key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyPart {
    ClientIp,
    /// The client's network: its address masked to `v4` bits (IPv4) or `v6` bits (IPv6).
    ClientIpPrefix {
        v4: u8,
        v6: u8,
    },
    /// A request header, by lower-case name.
    Header(String),
    /// A query parameter, by name: any case of it (`API_KEY` for `api_key`), or with `exact`, the
    /// name exactly as configured (the rule's `query_names`).
    Query {
        name: String,
        exact: bool,
    },
    /// A claim of the JWT `jwt_authn` verified (never of an unverified token).
    Claim(String),
    /// A cookie of the request's `Cookie` headers, by name (case-sensitive, as cookie names are):
    /// [`crate::request::cookie_values`].
    Cookie(String),
    Path,
    Method,
    Const(String),
    /// The first of these the request has ("the user, else the client address").
    First(Vec<KeyPart>),
}

impl KeyPart {
    /// As the configuration writes it.
    pub fn name(&self) -> String {
        match self {
            KeyPart::ClientIp => "client_ip".into(),
            KeyPart::ClientIpPrefix { v4, v6 } => format!("client_ip/{v4}/{v6}"),
            KeyPart::Header(n) => format!("header:{n}"),
            KeyPart::Query { name, .. } => format!("query:{name}"),
            KeyPart::Claim(n) => format!("jwt:{n}"),
            KeyPart::Cookie(n) => format!("cookie:{n}"),
            KeyPart::Path => "path".into(),
            KeyPart::Method => "method".into(),
            KeyPart::Const(v) => format!("const:{v}"),
            KeyPart::First(alts) => alts.iter().map(KeyPart::name).collect::<Vec<_>>().join("|"),
        }
    }

    /// Whether it reads the client address.
    pub fn needs_client_ip(&self) -> bool {
        match self {
            KeyPart::ClientIp | KeyPart::ClientIpPrefix { .. } => true,
            KeyPart::First(alts) => alts.iter().any(KeyPart::needs_client_ip),
            _ => false,
        }
    }

    /// The part of it whose value the caller chooses, if any: a header, cookie or query
    /// parameter it sends, the path or the method (of alternatives, the first such). The client
    /// address (as `client_ip.trusted_hops` reads it), a claim of a token `jwt_authn` verified
    /// and a constant are not the caller's to choose.
    pub fn sent_by_caller(&self) -> Option<&KeyPart> {
        match self {
            KeyPart::Header(_)
            | KeyPart::Cookie(_)
            | KeyPart::Query { .. }
            | KeyPart::Path
            | KeyPart::Method => Some(self),
            KeyPart::First(alts) => alts.iter().find_map(KeyPart::sent_by_caller),
            KeyPart::ClientIp
            | KeyPart::ClientIpPrefix { .. }
            | KeyPart::Claim(_)
            | KeyPart::Const(_) => None,
        }
    }
}

/// Whether a rule denies, or only counts what it would deny.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Enforce,
    /// `monitor` (or `shadow`): counts and reports what it would deny, admits it.
    Shadow,
    /// Admits what it would deny, and says so: a header to the client, a log line.
    Warn,
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
    /// Deny (503: the limiter cannot decide). A cached rule's key without a lease while the
    /// service is up is decided by the service instead, one check per request until the next
    /// sync brings it a lease.
    Closed,
}

/// A fail-open fallback sized to the fleet, as Envoy's `local_cluster_rate_limit` sizes a
/// limit: each proxy falls back to the rule's limits divided by the proxies the counter service
/// last counted ([`crate::protocol::Overrides::fleet_proxies`]), or by `assume_proxies` before
/// it counted any.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FleetShare {
    /// What the fallback is divided by until the service answered a count (1 unless configured:
    /// the whole limit, as a lone proxy).
    pub assume_proxies: u32,
    /// The most a count is believed: the fleet's largest size, as configured. The service
    /// counts up to `--fleet-max-proxies-per-credential` ids of each credential, so one
    /// credential's made-up proxies could otherwise shrink every proxy's fallback.
    pub max_proxies: u32,
    /// What the fallback is divided by now: `assume_proxies`, or the count last heard, at most
    /// `max_proxies`.
    pub proxies: u32,
}

/// Most `assume_proxies`.
pub const MAX_ASSUME_PROXIES: u32 = 100_000;

/// `limits` divided among `proxies` (at least 1), each at least one request of `cost`
/// ([`Limit::share`]).
pub fn shared_limits(limits: &[Limit], proxies: u32, cost: u64) -> Vec<Limit> {
    limits
        .iter()
        .map(|limit| limit.share(proxies as u64, cost))
        .collect()
}

/// The proxy the filter runs in: what it can do decides what a configuration may ask.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Host {
    #[default]
    Envoy,
    /// nginx with Kong's `ngx_wasm_module`: it cannot resume a request the filter holds (no
    /// wait queue, no leaky bucket), and dispatches to an address.
    Nginx,
}

/// Where the host sends the callouts to the counter service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Upstream {
    /// An Envoy cluster's name.
    Cluster(String),
    /// `host:port`, as nginx's `ngx_wasm_module` dispatches.
    Address(String),
}

impl Upstream {
    /// What the callout names (`proxy_http_call`'s upstream).
    pub fn target(&self) -> &str {
        match self {
            Upstream::Cluster(name) | Upstream::Address(name) => name,
        }
    }

    /// For messages: `cluster "name"` or `address host:port`.
    pub fn describe(&self) -> String {
        match self {
            Upstream::Cluster(name) => format!("cluster {name:?}"),
            Upstream::Address(address) => format!("address {address}"),
        }
    }
}

/// The counter service: an Envoy cluster, or an address (nginx).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Service {
    pub upstream: Upstream,
    pub authority: String,
    pub token: String,
    /// Dispatch over TLS (nginx: the `:scheme https` of ngx_wasm_module's dispatches).
    pub tls: bool,
    pub timeout_ms: u64,
    pub sync_interval_ms: u64,
    /// Consecutive failures that open the circuit breaker.
    pub breaker_failures: u32,
    /// How long the breaker stays open before one probe.
    pub breaker_cooldown_ms: u64,
}

impl Policy {
    /// What a live override says of `key` (as `limiter::key::build` made it) in `rule`.
    pub fn key_override(&self, rule: &Rule, key: &str) -> Option<KeyAction> {
        self.key_override_until(rule, key).map(|(action, _)| action)
    }

    /// [`Policy::key_override`], with when the override expires (Unix milliseconds, as the
    /// service said; 0: never, or not said).
    pub fn key_override_until(&self, rule: &Rule, key: &str) -> Option<(KeyAction, u64)> {
        if self.key_overrides.is_empty() {
            return None;
        }
        let configured = rule
            .tier
            .as_ref()
            .map_or(rule.name.as_str(), |t| t.rule.as_str());
        let parts = key
            .strip_prefix(rule.name.as_str())?
            .strip_prefix(crate::protocol::KEY_PART_SEPARATOR)?;
        let exact = self
            .key_overrides
            .get(configured)
            .and_then(|keys| keys.get(parts));
        if let Some(action) = exact {
            let expires_ms = self
                .key_expires
                .get(configured)
                .and_then(|keys| keys.get(parts))
                .copied()
                .unwrap_or(0);
            return Some((*action, expires_ms));
        }
        self.bare_key_overrides.get(configured)?.find(parts)
    }

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
            || self.rules.iter().any(|rule| {
                rule.key.iter().any(KeyPart::needs_client_ip)
                    || rule.matcher.needs_client_ip()
                    || rule.tier.as_ref().is_some_and(|t| t.from.needs_client_ip())
            })
    }

    /// Whether the proxy syncs with the counter service: whenever one is configured, for its
    /// shared counts, its fleet level, its emergency bypass and live overrides (which apply to
    /// local rules too).
    pub fn needs_service(&self) -> bool {
        self.service.is_some()
    }

    /// Whether a rule's fallback is sized to the fleet: the proxy asks the service for the count.
    pub fn fleet_share(&self) -> bool {
        self.rules.iter().any(|rule| rule.share.is_some())
    }

    /// Sizes every fleet-share fallback to `heard` proxies, the count the service last answered,
    /// at most each rule's `max_proxies` (0: none yet, each rule's `assume_proxies`).
    pub fn size_to_fleet(&mut self, heard: u32) {
        for rule in &mut self.rules {
            let proxies = match rule.share {
                Some(share) if heard > 0 => heard.min(share.max_proxies),
                Some(share) => share.assume_proxies,
                None => continue,
            };
            rule.size_to_fleet(proxies);
        }
    }
}

use crate::request::RequestView;

/// The values of one (not `First`) part: distinct, empty when the request does not have it.
impl KeyPart {
    pub fn values(&self, request: &mut dyn RequestView) -> Vec<String> {
        match self {
            KeyPart::ClientIp => request
                .client_ip()
                .map(str::to_string)
                .into_iter()
                .collect(),
            KeyPart::ClientIpPrefix { v4, v6 } => request
                .client_ip()
                .and_then(|ip| ip.parse::<IpAddr>().ok())
                .map(|ip| prefix_of(ip, *v4, *v6))
                .into_iter()
                .collect(),
            KeyPart::Path => vec![request.normal_path().to_string()],
            KeyPart::Method => vec![request.method().to_string()],
            KeyPart::Const(value) => vec![value.clone()],
            KeyPart::Header(name) => distinct(request.header(name)),
            KeyPart::Query { name, exact } => match request.query_string() {
                Some(query) => crate::request::query_values(query, name, *exact),
                None => Vec::new(),
            },
            KeyPart::Claim(name) => request.claim(name).into_iter().collect(),
            KeyPart::Cookie(name) => crate::request::cookie_values(&request.header("cookie"), name),
            KeyPart::First(alternatives) => alternatives
                .iter()
                .map(|alt| alt.values(request))
                .find(|values| !values.is_empty())
                .unwrap_or_default(),
        }
    }
}

/// The network of `ip` at the part's prefix length, as `network/length`.
pub(crate) fn prefix_of(ip: IpAddr, v4: u8, v6: u8) -> String {
    let ip = match ip {
        IpAddr::V6(v6addr) => v6addr
            .to_ipv4_mapped()
            .map_or(IpAddr::V6(v6addr), IpAddr::V4),
        v4addr => v4addr,
    };
    match ip {
        IpAddr::V4(a) => {
            let bits = u32::from(a);
            let masked = if v4 == 0 {
                0
            } else {
                bits & (u32::MAX << (32 - v4 as u32))
            };
            format!("{}/{v4}", std::net::Ipv4Addr::from(masked))
        }
        IpAddr::V6(a) => {
            let bits = u128::from(a);
            let masked = if v6 == 0 {
                0
            } else {
                bits & (u128::MAX << (128 - v6 as u32))
            };
            format!("{}/{v6}", std::net::Ipv6Addr::from(masked))
        }
    }
}
