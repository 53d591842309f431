//! Parsing and validating the JSON plugin configuration into a [`Policy`].
//!
//! Every error names the field it is about, as a path such as `rules[0].limits[1].per`.

mod shedding;

pub use shedding::{check_bulkhead_override, override_bulkhead};

use std::fmt;

use serde::Deserialize;

use crate::limit::{Algorithm, Limit, Period, MAX_TOKENS};
use crate::policy::{
    Answer, Bypass, ClientIp, Consistency, CountWhen, Fallback, FleetShare, HeaderStyle, Host,
    KeyPart, LimitsFrom, Matcher, Mode, Policy, ResetFormat, Rule, Service, TierOf, Upstream,
    WhenMissing, MAX_ASSUME_PROXIES,
};
use crate::request::matcher::{HeaderTest, Template};
use crate::request::net::Cidr;

/// Default per-rule key capacity of one proxy.
pub const DEFAULT_MAX_KEYS: u32 = 65_536;
/// Most memory one rule's sliding logs may take in a proxy (8 bytes per timestamp, `requests`
/// timestamps per key and limit, `max_keys` keys).
pub const MAX_LOG_BYTES: u64 = 64 << 20;
/// Default sync interval with the counter service.
pub const DEFAULT_SYNC_INTERVAL_MS: u64 = 100;

/// A configuration error: the field, and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub field: String,
    pub problem: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            write!(f, "{}", self.problem)
        } else {
            write!(f, "{}: {}", self.field, self.problem)
        }
    }
}

impl std::error::Error for ConfigError {}

pub(crate) fn err(field: impl Into<String>, problem: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.into(),
        problem: problem.into(),
    }
}

/// The filter's configuration (the JSON of its plugin `configuration`).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(title = "sluice filter configuration", rename = "Policy")
)]
struct RawPolicy {
    /// The proxy the filter runs in: envoy (the default) or nginx (Kong's ngx_wasm_module). nginx cannot resume a request the filter holds, so there a bulkhead has no queue and no rule a leaky_bucket, and the counter service is named by service.address.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("enum" = ["envoy", "nginx", null])))]
    host: Option<String>,
    /// Rate-limit headers on responses: none, legacy (X-RateLimit-*), draft (RateLimit-Policy and RateLimit; the default) or both.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("enum" = ["none", "legacy", "draft", "both", null])))]
    headers: Option<String>,
    /// How X-RateLimit-Reset is written: seconds (until the quota is whole again; the default) or unix (the Unix time, in seconds, at which it is).
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("enum" = ["seconds", "unix", null])))]
    x_ratelimit_reset: Option<String>,
    /// Requests that skip every rule: exact paths, client networks, or all of them.
    #[serde(default)]
    bypass: Option<RawBypass>,
    /// How the client address is found: the downstream peer, or an X-Forwarded-For entry.
    #[serde(default)]
    client_ip: Option<RawClientIp>,
    /// The rate-limit rules: every rule that applies to a request must admit it. At least one, or a shedding section.
    #[serde(default)]
    rules: Vec<RawRule>,
    /// Keys each rule remembers per proxy before forgetting the least recently used (8 to 1048576; default 65536).
    #[serde(default)]
    max_keys: Option<u32>,
    /// The counter service (an Envoy cluster) that cached and strict rules share their counts through.
    #[serde(default)]
    service: Option<RawService>,
    /// Load shedding: bulkheads that bound the requests in flight.
    #[serde(default)]
    shedding: Option<shedding::RawShedding>,
    /// The payload_in_metadata of Envoy's jwt_authn providers, where jwt:CLAIM key parts read verified claims (default jwt_payload).
    #[serde(default)]
    jwt_payload_in_metadata: Option<String>,
    /// A page for clients about your limits, such as https://api.example.com/docs/rate-limits: the 429 and 503 bodies name it (docs) and carry it in a Link header (rel="help"). http or https, printable ASCII without spaces, quotes or angle brackets, at most 512 bytes.
    #[serde(default)]
    docs_url: Option<String>,
    /// Tell the host's access log, for every reply sluice sends itself (a 429, a 503), its outcome, rule, bulkhead, class and the first 16 hex digits of the SHA-256 of the key (Envoy: filter state wasm.sluice.outcome, .rule, .bulkhead, .class, .key, printed with %FILTER_STATE(wasm.sluice.rule:PLAIN)%). Off by default: each such reply then costs the digest and up to 5 host calls more.
    #[serde(default)]
    access_log: bool,
}

/// Requests that skip every rule.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "Bypass")
)]
struct RawBypass {
    /// Exact paths (the query ignored) that skip every rule, such as /healthz.
    #[serde(default)]
    paths: Vec<String>,
    /// Client addresses or CIDR blocks never limited, such as 10.0.0.0/8.
    #[serde(default)]
    cidrs: Vec<String>,
    /// The emergency switch: when true, nothing is limited.
    #[serde(default)]
    all: bool,
}

/// How the client address is found.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "ClientIp")
)]
struct RawClientIp {
    /// 0: the downstream peer (Envoy's source.address); N: the N-th X-Forwarded-For entry from the right (at most 32).
    #[serde(default)]
    trusted_hops: u32,
}

/// One rate-limit rule: which requests, keyed how, limited how.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "Rule")
)]
struct RawRule {
    /// Unique; 1 to 64 of a-z A-Z 0-9 - _ . (a tier's rule is named rule/tier). Names metrics and headers.
    name: String,
    /// Which requests the rule applies to: every part set must match (none: every request).
    #[serde(default, rename = "match")]
    matcher: Option<RawMatch>,
    /// What is counted together: client_ip, client_ip/BITS, path, method, header:NAME, query:NAME, jwt:CLAIM, cookie:NAME, const:VALUE, or first-present alternatives such as jwt:sub|client_ip.
    key: Vec<String>,
    /// One to eight limits, all enforced, of one algorithm. A rule has limits or tiers.
    #[serde(default)]
    limits: Option<Vec<RawLimit>>,
    /// Limits per tier, the tier read from the request. A rule has limits or tiers.
    #[serde(default)]
    tiers: Option<RawTiers>,
    /// enforce (the default); monitor (or shadow): count what would be denied, admit it; warn: admit it and say so.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("enum" = ["enforce", "monitor", "shadow", "warn", null])))]
    mode: Option<String>,
    /// In enforce mode, the share of would-be denials actually denied, in percent (0 to 100; default 100).
    #[serde(default)]
    ramp_percent: Option<u8>,
    /// Where the count lives: local (this proxy), cached (shared through the counter service, decided from a lease) or strict (one service check per request). Default local, or cached with a service.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("enum" = ["local", "cached", "strict", null])))]
    consistency: Option<String>,
    /// What a cached or strict rule does without the counter service (default: fail_open with the rule's own limits).
    #[serde(default)]
    fallback: Option<RawFallback>,
    /// Tokens one request spends (default 1).
    #[serde(default)]
    cost: Option<u64>,
    /// A response header whose value (whole tokens) is charged after the response.
    #[serde(default)]
    cost_header: Option<String>,
    /// Counts only the requests whose response matches, such as {"statuses": [401, 403]} (failed logins): every request is checked up front (denied once the key is over) and spends its cost only when its response matches. Local and cached rules.
    #[serde(default)]
    count_when: Option<RawCountWhen>,
    /// How long a key stays denied once it went over: a duration ("10m": a whole number and one unit of s, m, h, d) or a number of seconds, from 1 second to 366 days. Retry-After and the rate-limit headers report its end.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(schema_with = "penalty_schema"))]
    penalty: Option<serde_json::Value>,
    /// A request without one of the key's parts (no such header, query parameter or verified claim, no readable client address): count (the default) counts it with all such requests of the rule, the part's value being the missing marker; skip does not count it.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("enum" = ["count", "skip", null])))]
    when_missing: Option<String>,
    /// How query:NAME parts match parameter names: any_case (the default; API_KEY for api_key) or exact.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("enum" = ["any_case", "exact", null])))]
    query_names: Option<String>,
    /// The HTTP status of a denial by this rule: 400 to 599 (default 429). A gRPC client gets RESOURCE_EXHAUSTED whatever it is.
    #[serde(default)]
    deny_status: Option<u64>,
    /// The message of a denial by this rule (the body's message, a gRPC client's grpc-message), instead of the limit's description: 1 to 1024 bytes, no control characters.
    #[serde(default)]
    deny_message: Option<String>,
    /// Whether an admitted response carries this rule's rate-limit headers when it is the most restrictive rule that counted the request (default true).
    #[serde(default)]
    headers_on_admitted: Option<bool>,
    /// Whether a denial by this rule carries its rate-limit headers (default true; Retry-After is always sent).
    #[serde(default)]
    headers_on_denied: Option<bool>,
    /// Scales the limits in force by the load level, such as {"high": 0.5, "critical": 0.25}: each factor 0 to 1 (exclusive of 0; default 1), the result rounded up to at least 1 request and the cost. Local rules of token_bucket, gcra, fixed_window or sliding_window limits.
    #[serde(default)]
    scale: Option<RawScale>,
    /// Other limits during windows of the UTC day, such as [{"utc": "22:00-06:00", "limits": [...]}]: the first window holding the request's time decides; the rule's own limits hold outside every window. Each window's limits keep the algorithm and per of the rule's limit in their place (only requests and burst change). Local rules, not with tiers.
    #[serde(default)]
    schedule: Option<Vec<RawWindow>>,
    /// A path, such as /rate_limit, answered 200 with the caller's own quota of this rule as JSON (its key computed as for a limited request), spending nothing of it and never forwarded; the request is first decided by the other rules that match it, as any request. The exact path, without a query. Local rules whose key the caller cannot choose (client_ip, jwt: claims, const:), unless quota_path_any_key.
    #[serde(default)]
    quota_path: Option<String>,
    /// true: the quota_path answers although the key has a part the caller sends (a header, cookie, query parameter, the path or the method), so that anyone reads any key's quota (its remaining requests, its penalty's end) by naming it. Limit the probes with a per-address rule that matches the path.
    #[serde(default)]
    quota_path_any_key: Option<bool>,
    /// Counts the keys this rule admits and denies most, in a space-saving sketch of this many counters per worker and kind (4 to 64; absent: not counted). Reported to the counter service (GET /admin/v1/top, sluice top) or, without one, logged every minute. Local and cached rules.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(range(min = 4, max = 64)))]
    top_keys: Option<u32>,
    /// The rule's limit read from each request, bounded: {"from": "jwt:rate_per_minute", "max": 5000} sets the requests of the rule's one limit to the claim's (or a trusted header's) whole number, at most max; a request without a usable value (absent, not a whole number, 0) gets the rule's own limit. Local rules of one token_bucket, gcra, fixed_window or sliding_window limit.
    #[serde(default)]
    limits_from: Option<RawLimitsFrom>,
}

/// A rule's factors per load level.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "Scale")
)]
struct RawScale {
    /// The factor at the elevated level, above 0 and at most 1 (default 1).
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("exclusiveMinimum" = 0, "maximum" = 1)))]
    elevated: Option<f64>,
    /// The factor at the high level, above 0 and at most 1 (default 1).
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("exclusiveMinimum" = 0, "maximum" = 1)))]
    high: Option<f64>,
    /// The factor at the critical level, above 0 and at most 1 (default 1).
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("exclusiveMinimum" = 0, "maximum" = 1)))]
    critical: Option<f64>,
    /// Whose level: proxy (shedding's level of the request's bulkhead; needs shedding; the default) or fleet (the counter service's fleet level from the last sync, believed only up to this proxy's own utilization of the request's bulkhead plus shedding.fleet_margin; needs a service and shedding).
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("enum" = ["proxy", "fleet", null])))]
    level: Option<String>,
}

/// A window of the UTC day with its limits.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "Window")
)]
struct RawWindow {
    /// "HH:MM-HH:MM" in UTC, start in, end out; an end before the start crosses midnight ("22:00-06:00"); 24:00 is midnight at the end.
    #[cfg_attr(feature = "schema", schemars(extend("pattern" = "^[0-9]{2}:[0-9]{2}-[0-9]{2}:[0-9]{2}$")))]
    utc: String,
    /// The limits in force during the window: as many as the rule's, each with the algorithm and per of the rule's limit in its place.
    limits: Vec<RawLimit>,
}

/// Where a rule's limit is read from each request, and its bound.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "LimitsFrom")
)]
struct RawLimitsFrom {
    /// jwt:CLAIM (a claim of the verified token) or header:NAME (a header a trusted filter sets): its whole number replaces the limit's requests.
    from: String,
    /// The most the value may give, 1 to 2147483648 and at least the rule's own requests: a larger value gives max.
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = 2147483648u64)))]
    max: u64,
}

/// Which responses a count_when rule counts.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "CountWhen")
)]
struct RawCountWhen {
    /// Response statuses counted, 100 to 599, such as [401, 403] (one to 32 of them).
    #[cfg_attr(feature = "schema", schemars(extend("items" = {"type": "integer", "minimum": 100, "maximum": 599}), extend("minItems" = 1), extend("maxItems" = 32)))]
    statuses: Vec<u64>,
}

/// A rule's limits per tier: each tier is a rule of its own, named rule/tier.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "Tiers")
)]
struct RawTiers {
    /// The key part a request's tier is read from, such as jwt:plan or header:x-plan.
    from: String,
    /// The tier of requests without a tier or with one not configured: a name in limits.
    default: String,
    /// Each tier's limits, by tier name.
    limits: std::collections::BTreeMap<String, Vec<RawLimit>>,
}

/// Which requests a rule or a bulkhead applies to: every part set must match.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "Match")
)]
pub(crate) struct RawMatch {
    /// Paths starting with this, such as /api/ (the path as sent or normalized).
    #[serde(default)]
    path_prefix: Option<String>,
    /// Exact paths, without a query.
    #[serde(default)]
    paths: Vec<String>,
    /// Path templates such as /users/{id}/export: a {name} placeholder stands for one segment.
    #[serde(default)]
    path_templates: Vec<String>,
    /// HTTP methods, such as GET.
    #[serde(default)]
    methods: Vec<String>,
    /// Host names (the :authority without its port); *.example.com matches any subdomain.
    #[serde(default)]
    hosts: Vec<String>,
    /// Request headers by name: true (present), false (absent), or a value one of them equals.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("additionalProperties" = {"type": ["boolean", "string"]})))]
    headers: std::collections::BTreeMap<String, serde_json::Value>,
    /// Client addresses or CIDR blocks.
    #[serde(default)]
    client_cidrs: Vec<String>,
}

/// A limit: how many requests per period, counted how.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "Limit"),
    schemars(extend("anyOf" = [{"required": ["requests", "per"]}, {"required": ["concurrent"]}]))
)]
struct RawLimit {
    /// How many requests per period (leaky_bucket: how many leave per period). Required, unless the limit is concurrent.
    #[serde(default)]
    requests: Option<u64>,
    /// The period: second, minute, hour, day (week and month with fixed_window only), a
    /// duration ("15m": a whole number and one unit of s, m, h, d) or a number of seconds (900),
    /// from 1 second to 366 days. A duration's windows are aligned to the Unix epoch. Required,
    /// unless the limit is concurrent.
    #[serde(default, deserialize_with = "present")]
    #[cfg_attr(feature = "schema", schemars(schema_with = "period_schema"))]
    per: Option<serde_json::Value>,
    /// Per-key concurrency instead of a rate: at most this many requests of a key in flight at once across the proxy's workers (1 to 1000), each holding its slot until its stream ends. Local consistency only; no requests, per or burst.
    #[serde(default)]
    concurrent: Option<u64>,
    /// Concurrent limits: the longest a slot is held when its release is lost (a worker crashed): a duration ("10m") or a number of seconds, 1 s to 1 day (default 10 minutes). Set it above the longest request.
    #[serde(default, deserialize_with = "present")]
    #[cfg_attr(feature = "schema", schemars(schema_with = "max_hold_schema"))]
    max_hold: Option<serde_json::Value>,
    /// Token bucket and GCRA: how many may come at once (default requests).
    #[serde(default)]
    burst: Option<u64>,
    /// How the limit counts (default token_bucket).
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("enum" = ["token_bucket", "gcra", "fixed_window", "sliding_window", "sliding_log", "leaky_bucket", "concurrency", null])))]
    algorithm: Option<String>,
    /// Leaky bucket: requests of a burst that pass at once.
    #[serde(default)]
    delay: Option<u32>,
    /// Leaky bucket: requests of a burst that wait for their slot.
    #[serde(default)]
    queue: Option<u32>,
    /// Leaky bucket: the longest a request waits.
    #[serde(default)]
    max_delay_ms: Option<u32>,
}

/// What a cached or strict rule does without the counter service.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "Fallback")
)]
struct RawFallback {
    /// fail_open: decide locally; fail_closed: deny (503).
    #[cfg_attr(feature = "schema", schemars(extend("enum" = ["fail_open", "fail_closed"])))]
    policy: String,
    /// fail_open: the local limits (default: the rule's own).
    #[serde(default)]
    limits: Option<Vec<RawLimit>>,
    /// fail_open: "fleet" divides the rule's own limits among the proxies the counter service last counted (each limit rounded up, at least one request), as Envoy's local_cluster_rate_limit does; instead of limits.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("enum" = ["fleet", null])))]
    share: Option<String>,
    /// With share: the proxies to divide by until the counter service answered a count (1 to 100000; default 1: the whole limit, as a lone proxy).
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("minimum" = 1, "maximum" = MAX_ASSUME_PROXIES)))]
    assume_proxies: Option<u64>,
    /// With share, required: the most proxies a count is believed up to (assume_proxies to 100000): the fleet's largest size. A larger count (one proxy credential can report made-up proxies) divides by this.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("minimum" = 1, "maximum" = MAX_ASSUME_PROXIES)))]
    max_proxies: Option<u64>,
}

/// The counter service: an Envoy cluster, or an address for nginx (ngx_wasm_module).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "Service")
)]
struct RawService {
    /// The Envoy cluster of the counter service (Envoy). Exactly one of cluster and address.
    #[serde(default)]
    cluster: Option<String>,
    /// host:port of the counter service (nginx with ngx_wasm_module, which dispatches to an address, not a cluster), e.g. 127.0.0.1:8081. Exactly one of cluster and address.
    #[serde(default)]
    address: Option<String>,
    /// The :authority of the callouts (default: the cluster name, or the address).
    #[serde(default)]
    authority: Option<String>,
    /// The bearer token the service expects.
    #[serde(default)]
    token: Option<String>,
    /// nginx: dispatch to the service over TLS (ngx_wasm_module's :scheme https), the certificate checked as its wasm{} block says (tls_trusted_certificate, tls_verify_cert on, tls_verify_host on) against the authority, also sent as SNI. Envoy speaks TLS through the cluster's transport_socket: refused there. Default false.
    #[serde(default)]
    tls: Option<bool>,
    /// Timeout of every callout, sync and strict check (1 to 60000; default 200).
    #[serde(default)]
    timeout_ms: Option<u64>,
    /// How often each proxy syncs (10 to 60000; default 100).
    #[serde(default)]
    sync_interval_ms: Option<u64>,
    /// Consecutive failed callouts that open the circuit breaker (default 3).
    #[serde(default)]
    breaker_failures: Option<u32>,
    /// How long the breaker stays open before one probe (10 to 3600000; default 2000).
    #[serde(default)]
    breaker_cooldown_ms: Option<u64>,
}

/// The JSON Schema (draft-07) of the configuration, generated from the types it is read into.
#[cfg(feature = "schema")]
pub fn schema() -> schemars::Schema {
    schemars::generate::SchemaSettings::draft07()
        .into_generator()
        .into_root_schema_for::<RawPolicy>()
}

/// Parses and validates a plugin configuration.
/// Validates a list of limits in the configuration's format (a live override's), as a rule's
/// `limits` are: the error names the field under `at` (`limits[0].per`).
pub fn parse_limits(at: &str, json: &[serde_json::Value]) -> Result<Vec<Limit>, ConfigError> {
    let raw = json
        .iter()
        .enumerate()
        .map(|(k, value)| {
            serde_path_to_error::deserialize::<_, RawLimit>(value).map_err(|e| {
                let path = e.path().to_string();
                let field = if path == "." {
                    format!("{at}[{k}]")
                } else {
                    format!("{at}[{k}].{path}")
                };
                err(field, e.into_inner().to_string())
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    limits(at, &raw)
}

pub fn parse(json: &[u8]) -> Result<Policy, ConfigError> {
    if json.iter().all(u8::is_ascii_whitespace) {
        return Err(err(
            "",
            "the configuration is empty; expected a JSON object with \"rules\"",
        ));
    }
    let mut de = serde_json::Deserializer::from_slice(json);
    let raw: RawPolicy = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        // "." is the document itself, "?" a place a syntax error left unknown: no field to name.
        let field = if path == "." || path == "?" {
            String::new()
        } else {
            path
        };
        // A field name may hold any character: the message stays one log line.
        err(one_line(field), one_line(e.into_inner().to_string()))
    })?;
    validate(raw)
}

/// `text` with control characters escaped (`\n`), as `{:?}` writes them.
fn one_line(text: String) -> String {
    if !text.chars().any(char::is_control) {
        return text;
    }
    text.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

fn validate(raw: RawPolicy) -> Result<Policy, ConfigError> {
    let host = match raw.host.as_deref().unwrap_or("envoy") {
        "envoy" => Host::Envoy,
        "nginx" => Host::Nginx,
        other => {
            return Err(err(
                "host",
                format!(
                    "expected envoy (the default) or nginx, got {:?}",
                    one_line(other.to_string())
                ),
            ))
        }
    };
    let headers = match raw.headers.as_deref().unwrap_or("draft") {
        "none" => HeaderStyle::None,
        "legacy" => HeaderStyle::Legacy,
        "draft" => HeaderStyle::Draft,
        "both" => HeaderStyle::Both,
        other => {
            return Err(err(
                "headers",
                format!("expected one of none, legacy, draft, both, got {other:?}"),
            ))
        }
    };

    let reset = match raw.x_ratelimit_reset.as_deref().unwrap_or("seconds") {
        "seconds" => ResetFormat::Seconds,
        "unix" => ResetFormat::Unix,
        other => {
            return Err(err(
                "x_ratelimit_reset",
                format!(
                    "expected seconds (the default) or unix, got {:?}",
                    one_line(other.to_string())
                ),
            ))
        }
    };

    let bypass = match raw.bypass {
        None => Bypass::default(),
        Some(b) => {
            for (i, path) in b.paths.iter().enumerate() {
                if !path.starts_with('/') {
                    return Err(err(
                        format!("bypass.paths[{i}]"),
                        format!("must start with '/', got {path:?}"),
                    ));
                }
            }
            let cidrs = b
                .cidrs
                .iter()
                .enumerate()
                .map(|(i, c)| Cidr::parse(c).map_err(|p| err(format!("bypass.cidrs[{i}]"), p)))
                .collect::<Result<_, _>>()?;
            Bypass {
                paths: b.paths,
                cidrs,
                all: b.all,
            }
        }
    };

    let client_ip = ClientIp {
        trusted_hops: raw.client_ip.map_or(0, |c| c.trusted_hops),
    };
    if client_ip.trusted_hops > 32 {
        return Err(err("client_ip.trusted_hops", "must be at most 32"));
    }

    let max_keys = raw.max_keys.unwrap_or(DEFAULT_MAX_KEYS);
    if !(crate::limit::table::WAYS as u32..=1_048_576).contains(&max_keys) {
        return Err(err(
            "max_keys",
            format!("must be between {} and 1048576", crate::limit::table::WAYS),
        ));
    }

    let service = raw.service.map(service).transpose()?;
    if let Some(service) = &service {
        check_upstream(host, &service.upstream)?;
        check_tls(host, service)?;
    }
    let jwt_payload_in_metadata = raw
        .jwt_payload_in_metadata
        .unwrap_or_else(|| "jwt_payload".to_string());
    if jwt_payload_in_metadata.is_empty() {
        return Err(err(
            "jwt_payload_in_metadata",
            "must name the payload_in_metadata of Envoy's jwt_authn providers",
        ));
    }

    let docs_url = raw.docs_url.map(docs_url).transpose()?;
    let mut shedding = raw.shedding.map(shedding::shedding).transpose()?;
    if let Some(shedding) = &mut shedding {
        shedding.docs_url = docs_url.clone();
    }
    if let (Host::Nginx, Some(shedding)) = (host, &shedding) {
        if let Some(i) = shedding.bulkheads.iter().position(|b| b.queue.is_some()) {
            return Err(err(
                format!("shedding.bulkheads[{i}].queue"),
                "nginx cannot resume a request that waits (ngx_wasm_module does not switch to another request's context): leave the queue out, and a request with no slot is shed at once",
            ));
        }
    }
    if raw.rules.is_empty() && shedding.is_none() {
        return Err(err(
            "rules",
            "must hold at least one rule (or configure \"shedding\")",
        ));
    }
    let mut rules = Vec::with_capacity(raw.rules.len());
    for (i, r) in raw.rules.into_iter().enumerate() {
        let name = r.name.clone();
        let configured = |other: &Rule| {
            other
                .tier
                .as_ref()
                .map_or(other.name.as_str(), |t| t.rule.as_str())
                == name
        };
        if rules.iter().any(configured) {
            return Err(err(
                format!("rules[{i}].name"),
                format!("{name:?} is used by an earlier rule; names must be unique"),
            ));
        }
        rules.extend(rule(
            &format!("rules[{i}]"),
            r,
            Around {
                service: service.is_some(),
                shedding: shedding.is_some(),
            },
            max_keys,
            host,
        )?);
    }

    Ok(Policy {
        host,
        headers,
        reset,
        bypass,
        client_ip,
        rules,
        max_keys,
        service,
        shedding,
        key_overrides: Default::default(),
        key_expires: Default::default(),
        bare_key_overrides: Default::default(),
        key_limits: Default::default(),
        jwt_payload_in_metadata,
        docs_url,
        access_log: raw.access_log,
    })
}

/// Longest `docs_url`.
pub const MAX_DOCS_URL_BYTES: usize = 512;

/// `docs_url`: an absolute http(s) URL that goes verbatim into a header and a JSON string, so
/// nothing in it can end either (no control character, space, quote, backslash or angle bracket).
fn docs_url(url: String) -> Result<String, ConfigError> {
    let problem = if url.len() > MAX_DOCS_URL_BYTES {
        Some(format!("longer than {MAX_DOCS_URL_BYTES} bytes"))
    } else if !(url.starts_with("https://") || url.starts_with("http://")) {
        Some(format!(
            "must start with https:// or http://, got {:?}",
            one_line(url.clone())
        ))
    } else if url
        .split_once("://")
        .is_some_and(|(_, rest)| rest.is_empty())
    {
        Some("has no host".to_owned())
    } else {
        url.chars()
            .find(|c| !c.is_ascii_graphic() || matches!(c, '"' | '\\' | '<' | '>'))
            .map(|c| {
                format!(
                    "may hold only printable ASCII without spaces, quotes, backslashes or angle \
                     brackets, got {c:?}"
                )
            })
    };
    match problem {
        Some(problem) => Err(err("docs_url", problem)),
        None => Ok(url),
    }
}

/// A request matcher; `at` is its field, e.g. `rules[0].match`.
pub(crate) fn matcher(at: &str, raw: Option<RawMatch>) -> Result<Matcher, ConfigError> {
    let Some(m) = raw else {
        return Ok(Matcher::default());
    };
    if let Some(prefix) = &m.path_prefix {
        if !prefix.starts_with('/') {
            return Err(err(
                format!("{at}.path_prefix"),
                format!("must start with '/', got {prefix:?}"),
            ));
        }
    }
    let mut methods = Vec::with_capacity(m.methods.len());
    for (j, method) in m.methods.iter().enumerate() {
        if method.is_empty() || !method.bytes().all(|b| b.is_ascii_alphabetic()) {
            return Err(err(
                format!("{at}.methods[{j}]"),
                format!("must be an HTTP method such as GET, got {method:?}"),
            ));
        }
        methods.push(method.to_ascii_uppercase());
    }
    for (j, path) in m.paths.iter().enumerate() {
        if !path.starts_with('/') || path.contains('?') {
            return Err(err(
                format!("{at}.paths[{j}]"),
                format!("must be a path starting with '/', without a query, got {path:?}"),
            ));
        }
    }
    let templates = m
        .path_templates
        .iter()
        .enumerate()
        .map(|(j, t)| Template::parse(t).map_err(|p| err(format!("{at}.path_templates[{j}]"), p)))
        .collect::<Result<Vec<_>, _>>()?;
    let mut hosts = Vec::with_capacity(m.hosts.len());
    for (j, host) in m.hosts.iter().enumerate() {
        // `api.example.com.` is `api.example.com`, as a request's host is (see `matcher::host_name`).
        let trimmed = host.trim_end_matches('.');
        let name = trimmed.strip_prefix("*.").unwrap_or(trimmed);
        let ok = !name.is_empty()
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-.[]:".contains(&b));
        if !ok {
            return Err(err(
                format!("{at}.hosts[{j}]"),
                format!(
                    "must be a host name such as api.example.com or *.example.com, got {host:?}"
                ),
            ));
        }
        hosts.push(trimmed.to_ascii_lowercase());
    }
    let mut headers = Vec::with_capacity(m.headers.len());
    for (name, test) in m.headers {
        let field = format!("{at}.headers.{name}");
        if !valid_header_name(&name) {
            return Err(err(field, "is not a header name"));
        }
        let test = match test {
            serde_json::Value::Bool(true) => HeaderTest::Present,
            serde_json::Value::Bool(false) => HeaderTest::Absent,
            serde_json::Value::String(value) => HeaderTest::Equals(value),
            other => {
                return Err(err(
                    field,
                    format!("expected true (present), false (absent) or a value, got {other}"),
                ))
            }
        };
        headers.push((name.to_ascii_lowercase(), test));
    }
    let client_cidrs = m
        .client_cidrs
        .iter()
        .enumerate()
        .map(|(j, c)| Cidr::parse(c).map_err(|p| err(format!("{at}.client_cidrs[{j}]"), p)))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Matcher {
        path_prefix: m.path_prefix,
        paths: m.paths,
        templates,
        methods,
        hosts,
        headers,
        client_cidrs,
    })
}

/// One configured rule: one [`Rule`], or one per tier (`name/tier`).
/// What a rule's configuration may lean on besides itself.
#[derive(Clone, Copy)]
struct Around {
    service: bool,
    shedding: bool,
}

fn rule(
    at: &str,
    raw: RawRule,
    around: Around,
    max_keys: u32,
    host: Host,
) -> Result<Vec<Rule>, ConfigError> {
    let have_service = around.service;
    let name_ok = !raw.name.is_empty()
        && raw.name.len() <= 64
        && raw
            .name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
    if !name_ok {
        return Err(err(
            format!("{at}.name"),
            format!(
                "must be 1 to 64 characters of a-z, A-Z, 0-9, '-', '_', '.', got {:?}",
                raw.name
            ),
        ));
    }

    // One matcher for every tier of the rule, and every copy of it (a key's own limits, a
    // limits_from value): shared, never copied, however many paths it lists.
    let matcher = std::sync::Arc::new(matcher(&format!("{at}.match"), raw.matcher)?);

    if raw.key.is_empty() {
        return Err(err(
            format!("{at}.key"),
            "must hold at least one part (use [\"const:all\"] for one shared bucket)",
        ));
    }
    let when_missing = match raw.when_missing.as_deref().unwrap_or("count") {
        "count" => WhenMissing::Count,
        "skip" => WhenMissing::Skip,
        other => {
            return Err(err(
                format!("{at}.when_missing"),
                format!("expected count (the default) or skip, got {other:?}"),
            ))
        }
    };
    let exact = match raw.query_names.as_deref().unwrap_or("any_case") {
        "any_case" => false,
        "exact" => true,
        other => {
            return Err(err(
                format!("{at}.query_names"),
                format!("expected any_case (the default) or exact, got {other:?}"),
            ))
        }
    };
    let key = raw
        .key
        .iter()
        .enumerate()
        .map(|(j, part)| key_part(part, exact).map_err(|p| err(format!("{at}.key[{j}]"), p)))
        .collect::<Result<Vec<_>, _>>()?;

    let mode = match raw.mode.as_deref().unwrap_or("enforce") {
        "enforce" => Mode::Enforce,
        "monitor" | "shadow" => Mode::Shadow,
        "warn" => Mode::Warn,
        other => {
            return Err(err(
                format!("{at}.mode"),
                format!("expected one of monitor, warn, enforce (shadow: monitor), got {other:?}"),
            ))
        }
    };
    let ramp_percent = match raw.ramp_percent {
        None => 100,
        Some(p) if p > 100 => {
            return Err(err(
                format!("{at}.ramp_percent"),
                format!("must be between 0 and 100, got {p}"),
            ))
        }
        Some(_) if mode != Mode::Enforce => {
            return Err(err(
                format!("{at}.ramp_percent"),
                "ramps an enforce rule (the share of would-be denials it denies); this rule does not enforce",
            ))
        }
        Some(p) => p,
    };

    let default_consistency = if have_service { "cached" } else { "local" };
    let consistency = match raw.consistency.as_deref().unwrap_or(default_consistency) {
        "local" => Consistency::Local,
        "cached" => Consistency::Cached,
        "strict" => Consistency::Strict,
        other => {
            return Err(err(
                format!("{at}.consistency"),
                format!("expected one of local, cached, strict, got {other:?}"),
            ))
        }
    };
    if consistency != Consistency::Local && !have_service {
        return Err(err(
            format!("{at}.consistency"),
            "cached and strict need a top-level \"service\" section",
        ));
    }

    let cost = raw.cost.unwrap_or(1);
    if cost == 0 || cost > crate::limit::MAX_TOKENS {
        return Err(err(
            format!("{at}.cost"),
            format!("must be between 1 and {}", crate::limit::MAX_TOKENS),
        ));
    }
    let cost_header = match raw.cost_header {
        None => None,
        Some(name) if !valid_header_name(&name) => {
            return Err(err(
                format!("{at}.cost_header"),
                format!("must be a header name, got {name:?}"),
            ))
        }
        Some(_) if consistency == Consistency::Strict => {
            return Err(err(
                format!("{at}.cost_header"),
                "a strict rule is decided by the service before the response: charge after the fact in a local or cached rule",
            ))
        }
        Some(name) => Some(name.to_ascii_lowercase()),
    };

    let count_when = match raw.count_when {
        None => None,
        Some(c) => Some(count_when(&format!("{at}.count_when"), c, consistency)?),
    };
    if count_when.is_some() && cost_header.is_some() {
        return Err(err(
            format!("{at}.count_when"),
            "a rule counts by its answer's status (count_when) or charges the cost its answer reports (cost_header), not both: write two rules with the same key",
        ));
    }
    let penalty_us = match &raw.penalty {
        None => 0,
        Some(value) => period(value)
            .and_then(|p| match p.calendar() {
                true => Err(format!(
                    "is a length of time: a duration (\"10m\", \"1h\") or seconds, not a calendar {}",
                    p.name()
                )),
                false => Ok(p.micros()),
            })
            .map_err(|problem| err(format!("{at}.penalty"), problem))?,
    };

    let top_keys = match raw.top_keys {
        None => 0,
        Some(_) if consistency == Consistency::Strict => {
            return Err(err(
                format!("{at}.top_keys"),
                "a strict rule is decided by the counter service, one check per request: count its keys in a local or cached rule",
            ))
        }
        Some(n) if (crate::top::MIN_COUNTERS..=crate::top::MAX_COUNTERS).contains(&n) => n,
        Some(n) => {
            return Err(err(
                format!("{at}.top_keys"),
                format!(
                    "{n} counters: from {} to {} (each worker keeps this many keys of each kind)",
                    crate::top::MIN_COUNTERS,
                    crate::top::MAX_COUNTERS
                ),
            ))
        }
    };

    if raw.limits_from.is_some() && raw.schedule.is_some() {
        return Err(err(
            format!("{at}.limits_from"),
            "a limit read from the request is the key's own, day and night: not with a schedule (its windows would replace it); write two rules",
        ));
    }
    let limits_from = match &raw.limits_from {
        None => None,
        Some(l) => Some(limits_from(
            at,
            l,
            exact,
            consistency,
            cost_header.is_some(),
            count_when.is_some(),
        )?),
    };
    let answer = Answer {
        // Checked with the rest of the rule (`check_rule`).
        status: raw
            .deny_status
            .map_or(429, |s| s.min(u32::MAX as u64) as u32),
        message: raw.deny_message.clone(),
        headers_admitted: raw.headers_on_admitted.unwrap_or(true),
        headers_denied: raw.headers_on_denied.unwrap_or(true),
    };
    // Each tier is a rule of its own, named `rule/tier`, counting the requests of its tier.
    let tiers: Vec<(Option<TierOf>, String, String, &Vec<RawLimit>)> =
        match (&raw.limits, &raw.tiers) {
            (Some(limits), None) => vec![(None, raw.name.clone(), format!("{at}.limits"), limits)],
            (None, Some(t)) => {
                let from =
                    key_part(&t.from, exact).map_err(|p| err(format!("{at}.tiers.from"), p))?;
                if t.limits.is_empty() {
                    return Err(err(
                        format!("{at}.tiers.limits"),
                        "must name at least one tier",
                    ));
                }
                if !t.limits.contains_key(&t.default) {
                    return Err(err(
                        format!("{at}.tiers.default"),
                        format!(
                            "{:?} is not one of the tiers ({})",
                            t.default,
                            t.limits.keys().cloned().collect::<Vec<_>>().join(", ")
                        ),
                    ));
                }
                let mut out = Vec::with_capacity(t.limits.len());
                for (tier, limits) in &t.limits {
                    let tier_ok = !tier.is_empty()
                        && tier.len() <= 64
                        && tier
                            .bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
                    if !tier_ok {
                        return Err(err(
                            format!("{at}.tiers.limits.{tier}"),
                            "a tier's name is 1 to 64 characters of a-z, A-Z, 0-9, '-', '_', '.'",
                        ));
                    }
                    let others = (tier == &t.default).then(|| {
                        t.limits
                            .keys()
                            .filter(|k| *k != tier)
                            .cloned()
                            .collect::<Vec<_>>()
                    });
                    out.push((
                        Some(TierOf {
                            rule: raw.name.clone(),
                            name: tier.clone(),
                            from: from.clone(),
                            default_for: others,
                        }),
                        format!("{}/{tier}", raw.name),
                        format!("{at}.tiers.limits.{tier}"),
                        limits,
                    ));
                }
                out
            }
            (Some(_), Some(_)) => {
                return Err(err(
                    format!("{at}.tiers"),
                    "a rule takes its limits from \"limits\" or from \"tiers\", not both",
                ))
            }
            (None, None) => {
                return Err(err(
                    format!("{at}.limits"),
                    "missing field `limits` (or `tiers`)",
                ))
            }
        };

    let quota_path_any_key = raw.quota_path_any_key.unwrap_or(false);
    let quota_path = match raw.quota_path {
        None if raw.quota_path_any_key.is_some() => return Err(err(
            format!("{at}.quota_path_any_key"),
            "without a quota_path it accepts nothing: remove it, or add the quota_path it is for",
        )),
        None => None,
        Some(path) => {
            let at = format!("{at}.quota_path");
            let chosen = key.iter().find_map(KeyPart::sent_by_caller);
            if let (Some(part), false) = (chosen, quota_path_any_key) {
                return Err(err(
                    at,
                    format!(
                        "the key part {} is sent by the caller, who could read any key's quota (another account's remaining requests, its penalty's end) by naming it: key the rule by client_ip or jwt: claims, or accept that with \"quota_path_any_key\": true",
                        part.name()
                    ),
                ));
            }
            Some(quota_path(&at, path, consistency)?)
        }
    };
    if raw.schedule.is_some() && raw.tiers.is_some() {
        return Err(err(
            format!("{at}.schedule"),
            "a rule with tiers has limits per tier: schedule a rule of its own per tier (match it on the tier's header or claim)",
        ));
    }
    let mut rules = Vec::with_capacity(tiers.len());
    for (tier, name, limits_at, raw_limits) in tiers {
        let limits = limits(&limits_at, raw_limits)?;
        let dynamic = dynamic(
            at,
            raw.scale.as_ref(),
            raw.schedule.as_deref(),
            &limits,
            (consistency, cost, around),
        )?;
        let (fallback, share) = fallback(at, raw.fallback.as_ref(), &limits, cost)?;
        let rule = Rule {
            name,
            matcher: matcher.clone(),
            key: key.clone(),
            limits,
            mode,
            ramp_percent,
            consistency,
            fallback,
            share,
            cost,
            cost_header: cost_header.clone(),
            count_when: count_when.clone(),
            penalty_us,
            top_keys,
            tier,
            when_missing,
            answer: answer.clone(),
            dynamic,
            quota_path: quota_path.clone(),
            quota_path_any_key,
            limits_from: limits_from.clone(),
            given: 0,
        };
        let fields = RuleAt::Config {
            rule: at,
            limits: &limits_at,
        };
        check_rule(&rule, max_keys, host, &fields)?;
        rules.push(rule);
    }
    Ok(rules)
}

/// A rule's `quota_path`: an absolute path of 1 to 256 printable bytes, without a query or a
/// fragment; a local rule (a cached or strict key's count lives in the counter service).
fn quota_path(at: &str, path: String, consistency: Consistency) -> Result<String, ConfigError> {
    if consistency != Consistency::Local {
        return Err(err(
            at,
            "answers from this proxy's own counts: a local rule only (a cached or strict key's count lives in the counter service)",
        ));
    }
    let printable = path.bytes().all(|b| b.is_ascii_graphic());
    if !path.starts_with('/') || path.len() > 256 || !printable || path.contains(['?', '#']) {
        let shown: String = path.chars().take(40).collect();
        return Err(err(
            at,
            format!("must be an absolute path such as /rate_limit (1 to 256 printable bytes, no query), got {shown:?}"),
        ));
    }
    Ok(path)
}

/// A rule's `scale` and `schedule`, checked against its `limits`, consistency and cost:
/// `None` when it has neither.
fn dynamic(
    at: &str,
    scale: Option<&RawScale>,
    schedule: Option<&[RawWindow]>,
    limits: &[Limit],
    (consistency, cost, around): (Consistency, u64, Around),
) -> Result<Option<Box<crate::limit::dynamic::Dynamic>>, ConfigError> {
    use crate::limit::dynamic::{self, Dynamic, LevelSource, Scale, Window};
    if scale.is_none() && schedule.is_none() {
        return Ok(None);
    }
    let field = if scale.is_some() { "scale" } else { "schedule" };
    if consistency != Consistency::Local {
        return Err(err(
            format!("{at}.{field}"),
            "the counter service counts a cached or strict rule against its configured limits: a limit that follows load or time is a local rule's (\"consistency\": \"local\")",
        ));
    }
    if let Some(k) = limits.iter().position(|l| !dynamic::follows(l.algorithm())) {
        return Err(err(
            format!("{at}.{field}"),
            format!(
                "limits[{k}] is a {}: only token_bucket, gcra, fixed_window and sliding_window limits follow load or time (a log's or a slot's memory is sized by its limit)",
                limits.get(k).map_or("", |l| l.algorithm().name())
            ),
        ));
    }
    let scale = match scale {
        None => None,
        Some(s) => {
            let factor = |name: &str, f: Option<f64>| match f {
                None => Ok(1.0),
                Some(f) if f > 0.0 && f <= 1.0 => Ok(f),
                Some(f) => Err(err(
                    format!("{at}.scale.{name}"),
                    format!(
                        "a factor is above 0 and at most 1 (a level only lowers limits), got {f}"
                    ),
                )),
            };
            let (elevated, high, critical) = (
                factor("elevated", s.elevated)?,
                factor("high", s.high)?,
                factor("critical", s.critical)?,
            );
            let level = match s.level.as_deref().unwrap_or("proxy") {
                "proxy" if !around.shedding => {
                    return Err(err(
                        format!("{at}.scale.level"),
                        "the proxy's level is shedding's: configure \"shedding\", or scale by the \"fleet\" level",
                    ))
                }
                "proxy" => LevelSource::Proxy,
                "fleet" if !around.service => {
                    return Err(err(
                        format!("{at}.scale.level"),
                        "the fleet level comes from the counter service: configure \"service\"",
                    ))
                }
                "fleet" if !around.shedding => {
                    return Err(err(
                        format!("{at}.scale.level"),
                        "the fleet level is believed only up to this proxy's own load plus shedding.fleet_margin (one proxy credential must not move the fleet): configure \"shedding\"",
                    ))
                }
                "fleet" => LevelSource::Fleet,
                other => {
                    return Err(err(
                        format!("{at}.scale.level"),
                        format!("expected proxy (the default) or fleet, got {other:?}"),
                    ))
                }
            };
            Some(Scale {
                elevated,
                high,
                critical,
                level,
            })
        }
    };
    let mut windows: Vec<Window> = Vec::new();
    let raw_windows = schedule.unwrap_or(&[]);
    if schedule.is_some() && (raw_windows.is_empty() || raw_windows.len() > dynamic::MAX_WINDOWS) {
        return Err(err(
            format!("{at}.schedule"),
            format!(
                "must hold 1 to {} windows, got {}",
                dynamic::MAX_WINDOWS,
                raw_windows.len()
            ),
        ));
    }
    for (j, w) in raw_windows.iter().enumerate() {
        let here = format!("{at}.schedule[{j}]");
        let (start_min, end_min) =
            dynamic::parse_utc(&w.utc).map_err(|p| err(format!("{here}.utc"), p))?;
        let own = self::limits(&format!("{here}.limits"), &w.limits)?;
        if own.len() != limits.len() {
            return Err(err(
                format!("{here}.limits"),
                format!(
                    "holds {} limits and the rule {}: a window changes the requests and burst of each of the rule's limits, in order",
                    own.len(),
                    limits.len()
                ),
            ));
        }
        for (k, (mine, theirs)) in own.iter().zip(limits).enumerate() {
            if mine.algorithm() != theirs.algorithm() || mine.period() != theirs.period() {
                return Err(err(
                    format!("{here}.limits[{k}]"),
                    format!(
                        "must keep the rule's {} per {} (only requests and burst change, so a key's counts carry over)",
                        theirs.algorithm().name(),
                        theirs.period()
                    ),
                ));
            }
            if cost > mine.burst() {
                return Err(err(
                    format!("{here}.limits[{k}]"),
                    format!(
                        "admits at most {} at once, less than the rule's cost {cost}: no request could pass",
                        mine.burst()
                    ),
                ));
            }
        }
        let window = Window {
            start_min,
            end_min,
            limits: own,
        };
        if let Some(i) = windows.iter().position(|o| dynamic::overlap(o, &window)) {
            return Err(err(
                format!("{here}.utc"),
                format!(
                    "{} overlaps schedule[{i}] ({}): at most one window holds any minute",
                    window.utc(),
                    windows.get(i).map(Window::utc).unwrap_or_default()
                ),
            ));
        }
        windows.push(window);
    }
    Ok(Some(Box::new(Dynamic {
        scale,
        schedule: windows,
    })))
}

/// A rule's `limits_from`: read from a verified claim or a header, bounded by `max` (1 to
/// [`MAX_TOKENS`]), on a local rule that charges its cost up front. Its limits are checked per
/// tier by [`check_limits_from`].
fn limits_from(
    at: &str,
    raw: &RawLimitsFrom,
    exact: bool,
    consistency: Consistency,
    cost_header: bool,
    count_when: bool,
) -> Result<LimitsFrom, ConfigError> {
    let field = |name: &str| format!("{at}.limits_from.{name}");
    let from = key_part(&raw.from, exact).map_err(|p| err(field("from"), p))?;
    if !matches!(from, KeyPart::Claim(_) | KeyPart::Header(_)) {
        return Err(err(
            field("from"),
            format!(
                "a limit is read from jwt:CLAIM (a claim of the verified token) or header:NAME (a header a trusted filter sets), got {:?}",
                raw.from
            ),
        ));
    }
    if !(1..=MAX_TOKENS).contains(&raw.max) {
        return Err(err(
            field("max"),
            format!("must be between 1 and {MAX_TOKENS}, got {}", raw.max),
        ));
    }
    if consistency != Consistency::Local {
        return Err(err(
            format!("{at}.limits_from"),
            "a cached or strict rule counts a key with one limit on every proxy, and a value read from each request may differ between them: use a local rule, or give a key its own limits through the counter service (PUT /admin/v1/overrides/keys/RULE with \"limits\")",
        ));
    }
    if cost_header || count_when {
        return Err(err(
            format!("{at}.limits_from"),
            "a limit read from the request counts the request up front; cost_header and count_when charge after the answer, without it: write two rules with the same key",
        ));
    }
    Ok(LimitsFrom { from, max: raw.max })
}

/// A rule (one tier) with `limits_from`: one limit, of an algorithm whose record does not depend
/// on its requests, and whose `max` it can take, at least the rule's own requests. A live
/// override of the rule's limits, or a key's own limits, must hold to it too.
fn check_limits_from(at: &RuleAt<'_>, from: &LimitsFrom, rule: &Rule) -> Result<(), ConfigError> {
    let [own] = rule.limits.as_slice() else {
        return Err(err(
            limit_field(at.limits(), 1, ""),
            "limits_from replaces the requests of one limit: a rule with limits_from has one; count the others in another rule with the same key",
        ));
    };
    if own.with_requests(own.requests()).is_none() {
        return Err(err(
            limit_field(at.limits(), 0, "algorithm"),
            format!(
                "limits_from takes a token_bucket, gcra, fixed_window or sliding_window limit, whose record does not depend on its requests, got {}",
                own.algorithm().name()
            ),
        ));
    }
    if from.max < own.requests() {
        return Err(err(
            at.rule_field("limits_from.max", 0, "requests"),
            format!(
                "limits_from.max ({}) is less than {}[0].requests ({}), the limit of requests without a value: raise max, or lower the requests",
                from.max,
                at.limits(),
                own.requests()
            ),
        ));
    }
    if own.with_requests(from.max).is_none() {
        return Err(err(
            at.rule_field("limits_from.max", 0, "period"),
            format!(
                "limits_from.max ({}) is more than a {} limit per {} can hold (at most one request per two microseconds of its window)",
                from.max,
                own.algorithm().name(),
                own.period()
            ),
        ));
    }
    Ok(())
}

/// A rule's `count_when`: one to 32 statuses of 100 to 599; a rule that can count after the
/// answer (not strict: its service check counts before it).
fn count_when(
    at: &str,
    raw: RawCountWhen,
    consistency: Consistency,
) -> Result<CountWhen, ConfigError> {
    if consistency == Consistency::Strict {
        return Err(err(
            at,
            "a strict rule's check counts the request before its answer: count by the answer in a local or cached rule",
        ));
    }
    if raw.statuses.is_empty() || raw.statuses.len() > 32 {
        return Err(err(
            format!("{at}.statuses"),
            format!("must hold 1 to 32 statuses, got {}", raw.statuses.len()),
        ));
    }
    let mut statuses = Vec::with_capacity(raw.statuses.len());
    for (j, &status) in raw.statuses.iter().enumerate() {
        if !(100..=599).contains(&status) {
            return Err(err(
                format!("{at}.statuses[{j}]"),
                format!("must be an HTTP status, 100 to 599, got {status}"),
            ));
        }
        statuses.push(status as u32);
    }
    statuses.sort_unstable();
    statuses.dedup();
    Ok(CountWhen { statuses })
}

fn fallback(
    at: &str,
    raw: Option<&RawFallback>,
    limits: &[Limit],
    cost: u64,
) -> Result<(Fallback, Option<FleetShare>), ConfigError> {
    let Some(f) = raw else {
        return Ok((Fallback::Open(limits.to_vec()), None));
    };
    let share = match f.share.as_deref() {
        None => None,
        Some("fleet") => {
            if f.limits.is_some() {
                return Err(err(
                    format!("{at}.fallback.limits"),
                    "a fleet share divides the rule's own limits: remove \"limits\", or \"share\" to fall back to these",
                ));
            }
            let assume = f.assume_proxies.unwrap_or(1);
            if assume == 0 || assume > MAX_ASSUME_PROXIES as u64 {
                return Err(err(
                    format!("{at}.fallback.assume_proxies"),
                    format!("must be 1 to {MAX_ASSUME_PROXIES}, got {assume}"),
                ));
            }
            let Some(max) = f.max_proxies else {
                return Err(err(
                    format!("{at}.fallback.max_proxies"),
                    format!("a fleet share needs the most proxies it believes the counter service counts ({assume} to {MAX_ASSUME_PROXIES}: the fleet's largest size); without it, one proxy credential could report made-up proxies and shrink every proxy's fallback"),
                ));
            };
            if max < assume || max > MAX_ASSUME_PROXIES as u64 {
                return Err(err(
                    format!("{at}.fallback.max_proxies"),
                    format!("must be assume_proxies ({assume}) to {MAX_ASSUME_PROXIES}, got {max}"),
                ));
            }
            let assume = assume as u32;
            Some(FleetShare {
                assume_proxies: assume,
                max_proxies: max as u32,
                proxies: assume,
            })
        }
        Some(other) => {
            return Err(err(
                format!("{at}.fallback.share"),
                format!("expected \"fleet\", got {other:?}"),
            ))
        }
    };
    if share.is_none() && f.assume_proxies.is_some() {
        return Err(err(
            format!("{at}.fallback.assume_proxies"),
            "only a fleet share (\"share\": \"fleet\") assumes a number of proxies",
        ));
    }
    if share.is_none() && f.max_proxies.is_some() {
        return Err(err(
            format!("{at}.fallback.max_proxies"),
            "only a fleet share (\"share\": \"fleet\") believes a count of proxies",
        ));
    }
    Ok(match f.policy.as_str() {
        "fail_open" => match (&f.limits, share) {
            (Some(l), _) => (
                Fallback::Open(self::limits(&format!("{at}.fallback.limits"), l)?),
                None,
            ),
            (None, Some(share)) => (
                Fallback::Open(crate::policy::shared_limits(limits, share.proxies, cost)),
                Some(share),
            ),
            (None, None) => (Fallback::Open(limits.to_vec()), None),
        },
        "fail_closed" => {
            if f.limits.is_some() {
                return Err(err(
                    format!("{at}.fallback.limits"),
                    "fail_closed denies without limits; remove \"limits\" or use fail_open",
                ));
            }
            if share.is_some() {
                return Err(err(
                    format!("{at}.fallback.share"),
                    "fail_closed denies without limits: a share needs fail_open",
                ));
            }
            (Fallback::Closed, None)
        }
        other => {
            return Err(err(
                format!("{at}.fallback.policy"),
                format!("expected one of fail_open, fail_closed, got {other:?}"),
            ))
        }
    })
}

/// Where the fields a [`check_rule`] error names are.
#[derive(Debug, Clone, Copy)]
pub enum RuleAt<'a> {
    /// A configured rule: its own fields under `rule` (`rules[0]` → `rules[0].consistency`),
    /// its limits at `limits` (`rules[0].limits`, `rules[0].tiers.limits.pro`).
    Config { rule: &'a str, limits: &'a str },
    /// A live override's limits at `limits` (`limits` in the admin API, `limits.api` in the
    /// proxy): what the rule refuses of them is named on the limit at fault.
    Override { limits: &'a str },
}

impl RuleAt<'_> {
    /// A field of the rule (`consistency`), or for an override, `field` of its limit `k`.
    fn rule_field(&self, name: &str, k: usize, field: &str) -> String {
        match self {
            RuleAt::Config { rule, .. } => format!("{rule}.{name}"),
            RuleAt::Override { limits } => limit_field(limits, k, field),
        }
    }

    /// A field of the rule itself (`deny_status`): for an override, which does not change it,
    /// the field under the override's limits' parent.
    fn own_field(&self, name: &str) -> String {
        match self {
            RuleAt::Config { rule, .. } => format!("{rule}.{name}"),
            RuleAt::Override { .. } => name.to_string(),
        }
    }

    fn limits(&self) -> &str {
        match self {
            RuleAt::Config { limits, .. } | RuleAt::Override { limits } => limits,
        }
    }

    /// The field of the limits a rule's local buckets follow: its own, or its fallback's.
    fn bucket_limits(&self, own: bool) -> String {
        match self {
            RuleAt::Config { rule, .. } if !own => format!("{rule}.fallback.limits"),
            _ => self.limits().to_string(),
        }
    }
}

fn limit_field(limits: &str, k: usize, field: &str) -> String {
    if field.is_empty() {
        format!("{limits}[{k}]")
    } else {
        format!("{limits}[{k}].{field}")
    }
}

/// What a rule may be, beyond each of its parts' own form: its algorithms against its
/// consistency and fallback, its cost against its limits, the memory its sliding logs take
/// with `max_keys` keys. The configuration checks every rule (every tier) with it, and a live
/// override every rule it changes, in the proxy and, given the proxies' configuration, in the
/// counter service: one code path, one message.
pub fn check_rule(
    rule: &Rule,
    max_keys: u32,
    host: Host,
    at: &RuleAt<'_>,
) -> Result<(), ConfigError> {
    check_answer(&rule.answer, at)?;
    let limits = &rule.limits;
    let consistency = rule.consistency;
    let position =
        |l: &[Limit], algorithm: Algorithm| l.iter().position(|l| l.algorithm() == algorithm);
    // A shaper holds a request until its slot, and only the tick can let it go: nginx cannot.
    if host == Host::Nginx {
        if let Some(k) = position(limits, Algorithm::LeakyBucket) {
            return Err(err(
                limit_field(at.limits(), k, "algorithm"),
                "leaky_bucket holds a request until its slot, and nginx cannot resume a held request: use gcra (the same rate, denying instead of delaying)",
            ));
        }
    }
    // A shaper holds requests in one proxy: it has no meaning across proxies.
    if consistency != Consistency::Local {
        if let Some(k) = position(limits, Algorithm::LeakyBucket) {
            return Err(err(
                at.rule_field("consistency", k, "algorithm"),
                "leaky_bucket shapes the traffic of one proxy: local consistency only",
            ));
        }
    }
    if rule.share.is_some() {
        if consistency == Consistency::Local {
            return Err(err(
                at.own_field("fallback.share"),
                "a local rule counts in this proxy alone and has no fallback: share a cached or strict rule",
            ));
        }
        if let Some(k) = position(limits, Algorithm::SlidingLog) {
            return Err(err(
                at.rule_field("fallback.share", k, "algorithm"),
                "a sliding_log keeps one timestamp per request of its limit: its fallback cannot be resized to the fleet; use sliding_window, or fallback limits",
            ));
        }
    }
    // A log is one timestamp per request: it is decided request by request, never leased.
    if consistency == Consistency::Cached {
        if let Some(k) = position(limits, Algorithm::SlidingLog) {
            return Err(err(
                at.rule_field("consistency", k, "algorithm"),
                "sliding_log is exact, so it is decided per request: set consistency to strict (across proxies) or local; for a cached limit use sliding_window",
            ));
        }
    }
    // Slots are counted in one proxy's shared memory and given back at the stream's end.
    if let Some(k) = position(limits, Algorithm::Concurrency) {
        if consistency != Consistency::Local {
            return Err(err(
                at.rule_field("consistency", k, "concurrent"),
                "a concurrent limit counts the requests in flight in one proxy (across its workers): local consistency only",
            ));
        }
        if limits.len() > 1 {
            return Err(err(
                limit_field(at.limits(), 1, ""),
                "a concurrent limit is its rule's only limit; limit the rate in another rule with the same key",
            ));
        }
        if rule.cost != 1 {
            return Err(err(
                at.rule_field("cost", k, "concurrent"),
                "a request in flight holds one slot: a concurrent rule's cost is 1",
            ));
        }
        if rule.cost_header.is_some() {
            return Err(err(
                at.rule_field("cost_header", k, "concurrent"),
                "a concurrent limit counts requests in flight: it has no cost to charge after the fact",
            ));
        }
        if rule.count_when.is_some() {
            return Err(err(
                at.rule_field("count_when", k, "concurrent"),
                "a concurrent limit counts every request while it is in flight: it cannot wait for the answer to count it",
            ));
        }
        if rule.penalty_us > 0 {
            return Err(err(
                at.rule_field("penalty", k, "concurrent"),
                "a concurrent limit frees a slot when a request ends: a penalty would outlast it; limit the key's rate with a penalty in another rule",
            ));
        }
    }
    if let Fallback::Open(fallback) = &rule.fallback {
        if consistency != Consistency::Local && position(fallback, Algorithm::Concurrency).is_some()
        {
            return Err(err(
                at.bucket_limits(false),
                "a concurrent limit cannot stand in for a shared rate: use a rate limit",
            ));
        }
        if consistency != Consistency::Local && position(fallback, Algorithm::LeakyBucket).is_some()
        {
            return Err(err(
                at.bucket_limits(false),
                "leaky_bucket shapes the traffic of one proxy: it cannot stand in for a shared limit",
            ));
        }
    }
    let least = limits.iter().enumerate().min_by_key(|(_, l)| l.burst());
    if let Some((k, least)) = least {
        let cost = rule.cost;
        if cost > least.burst() {
            return Err(err(
                at.rule_field("cost", k, ""),
                format!(
                    "{cost} is more than {} ever admits at once ({}): no request could pass",
                    at.limits(),
                    least.burst()
                ),
            ));
        }
    }
    if rule.cost_header.is_some() {
        if let Some(k) = position(limits, Algorithm::LeakyBucket) {
            return Err(err(
                at.rule_field("cost_header", k, "algorithm"),
                "a leaky_bucket sends a request on its schedule before the response: it cannot charge after the fact",
            ));
        }
    }
    if rule.count_when.is_some() {
        if let Some(k) = position(limits, Algorithm::LeakyBucket) {
            return Err(err(
                at.rule_field("count_when", k, "algorithm"),
                "a leaky_bucket sends a request on its schedule before the response: it cannot count by the answer",
            ));
        }
        if consistency == Consistency::Cached && rule.fallback == Fallback::Closed {
            return Err(err(
                at.rule_field("count_when", 0, "consistency"),
                "a fail_closed cached rule asks the service to count a key it holds no lease for, before the answer: use fail_open with count_when",
            ));
        }
    }
    if let Some(from) = &rule.limits_from {
        check_limits_from(at, from, rule)?;
    }
    // Only a limit whose record does not depend on its size follows load or time.
    if let Some(dynamic) = &rule.dynamic {
        if let Some(k) = position_of(limits, |a| !crate::limit::dynamic::follows(a)) {
            let field = if dynamic.scale.is_some() {
                "scale"
            } else {
                "schedule"
            };
            return Err(err(
                at.rule_field(field, k, "algorithm"),
                format!(
                    "limits[{k}] is a {}: only token_bucket, gcra, fixed_window and sliding_window limits follow load or time (a log's or a slot's memory is sized by its limit)",
                    limits.get(k).map_or("", |l| l.algorithm().name())
                ),
            ));
        }
    }
    // The local buckets keep a sliding log's timestamps for every key a proxy remembers.
    let buckets = crate::limiter::bucket_limits(rule);
    let log: usize = buckets.iter().map(Limit::log_len).sum();
    let bytes = max_keys as u64 * 8 * log as u64;
    if bytes > MAX_LOG_BYTES {
        let own = buckets == limits.as_slice();
        let k = buckets
            .iter()
            .enumerate()
            .max_by_key(|(k, l)| (l.log_len(), std::cmp::Reverse(*k)))
            .map_or(0, |(k, _)| k);
        let slots = buckets
            .get(k)
            .is_some_and(|l| l.algorithm() == Algorithm::Concurrency);
        let (field, what) = match slots {
            true => ("concurrent", "its slots keep"),
            false => ("requests", "its sliding logs keep"),
        };
        return Err(err(
            limit_field(&at.bucket_limits(own), k, field),
            format!(
                "{what} {log} timestamps per key: {} MiB for max_keys {max_keys}, more than the {} MiB a rule may take; lower {field} or max_keys",
                bytes >> 20,
                MAX_LOG_BYTES >> 20
            ),
        ));
    }
    Ok(())
}

/// The first of `limits` whose algorithm `test` holds for.
fn position_of(limits: &[Limit], test: impl Fn(Algorithm) -> bool) -> Option<usize> {
    limits.iter().position(|l| test(l.algorithm()))
}

/// A rule's own answer: an error status, and a message a JSON body and a gRPC answer carry
/// as they are (one line of text, bounded).
fn check_answer(answer: &Answer, at: &RuleAt<'_>) -> Result<(), ConfigError> {
    if !(400..=599).contains(&answer.status) {
        return Err(err(
            at.own_field("deny_status"),
            format!(
                "must be an error status, 400 to 599 (default 429), got {}",
                answer.status
            ),
        ));
    }
    if let Some(message) = &answer.message {
        let field = at.own_field("deny_message");
        let max = crate::reply::MAX_MESSAGE_BYTES;
        if message.trim().is_empty() {
            return Err(err(
                field,
                "must say something (or leave it out for the default)",
            ));
        }
        if message.len() > max {
            return Err(err(
                field,
                format!("is {} bytes; at most {max}", message.len()),
            ));
        }
        if let Some(c) = message.chars().find(|c| c.is_control()) {
            return Err(err(
                field,
                format!("must be one line of text, without control characters; found {c:?}"),
            ));
        }
    }
    Ok(())
}

fn limits(at: &str, raw: &[RawLimit]) -> Result<Vec<Limit>, ConfigError> {
    if raw.is_empty() {
        return Err(err(at, "must hold at least one limit"));
    }
    if raw.len() > 8 {
        return Err(err(at, "must hold at most 8 limits"));
    }
    let parsed = raw
        .iter()
        .enumerate()
        .map(|(k, l)| limit(&format!("{at}[{k}]"), l))
        .collect::<Result<Vec<Limit>, _>>()?;
    // One algorithm per list: a record's ghost speaks for all of its limits in one way.
    if let Some(first) = parsed.first() {
        if let Some(k) = parsed
            .iter()
            .position(|l| l.algorithm() != first.algorithm())
        {
            return Err(err(
                format!("{at}[{k}].algorithm"),
                format!(
                    "the limits of a rule share one algorithm ({} here); count another algorithm in another rule with the same key",
                    first.algorithm().name()
                ),
            ));
        }
    }
    Ok(parsed)
}

fn limit(at: &str, l: &RawLimit) -> Result<Limit, ConfigError> {
    if l.concurrent.is_some() || l.algorithm.as_deref() == Some("concurrency") {
        return concurrent(at, l);
    }
    if l.max_hold.is_some() {
        return Err(err(
            format!("{at}.max_hold"),
            "max_hold bounds a concurrent limit's slots; this limit is a rate (add \"concurrent\" or remove max_hold)",
        ));
    }
    let Some(requests) = l.requests else {
        return Err(err(
            format!("{at}.requests"),
            "missing field `requests` (or `concurrent`, for a limit of requests in flight)",
        ));
    };
    let Some(per) = &l.per else {
        return Err(err(format!("{at}.per"), "missing field `per`"));
    };
    let algorithm = match l.algorithm.as_deref() {
        None => Algorithm::TokenBucket,
        Some(name) => Algorithm::parse(name).ok_or_else(|| {
            err(
                format!("{at}.algorithm"),
                format!("expected one of {}, got {name:?}", Algorithm::NAMES),
            )
        })?,
    };
    let period = period(per).map_err(|problem| err(format!("{at}.per"), problem))?;
    let shaping_fields = [
        ("delay", l.delay.is_some()),
        ("queue", l.queue.is_some()),
        ("max_delay_ms", l.max_delay_ms.is_some()),
    ];
    if algorithm != Algorithm::LeakyBucket {
        if let Some((field, _)) = shaping_fields.iter().find(|(_, set)| *set) {
            return Err(err(
                format!("{at}.{field}"),
                format!(
                    "{field} shapes a leaky_bucket; this limit is a {}",
                    algorithm.name()
                ),
            ));
        }
    } else {
        if l.burst.is_some() {
            return Err(err(
                format!("{at}.burst"),
                "a leaky_bucket has no burst: `delay` requests of a burst pass at once, `queue` more wait",
            ));
        }
        let queue = l.queue.unwrap_or(0);
        let delay = l.delay.unwrap_or(0);
        if queue > 100_000 {
            return Err(err(format!("{at}.queue"), "must be at most 100000"));
        }
        let max_delay_ms = l.max_delay_ms.unwrap_or(10_000);
        if !(1..=60_000).contains(&max_delay_ms) {
            return Err(err(
                format!("{at}.max_delay_ms"),
                format!("must be between 1 and 60000, got {max_delay_ms}"),
            ));
        }
        let shaping = crate::limit::Shaping {
            delay,
            queue,
            max_delay_ms,
        };
        return Limit::leaky(requests, period, shaping).map_err(|problem| {
            let field = if problem.starts_with("week") {
                "per"
            } else {
                "requests"
            };
            err(format!("{at}.{field}"), problem)
        });
    }
    if algorithm == Algorithm::SlidingLog {
        if l.burst.is_some() {
            return Err(err(
                format!("{at}.burst"),
                "sliding_log admits `requests` in any span of `per` and has no burst; burst is for token_bucket and gcra",
            ));
        }
        return Limit::logged(requests, period).map_err(|problem| {
            let field = if problem.starts_with("week") {
                "per"
            } else {
                "requests"
            };
            err(format!("{at}.{field}"), problem)
        });
    }
    if algorithm.windowed() {
        if l.burst.is_some() {
            return Err(err(
                format!("{at}.burst"),
                format!(
                    "{} counts `requests` per window and has no burst; burst is for token_bucket and gcra",
                    algorithm.name()
                ),
            ));
        }
        return Limit::windowed(requests, period, algorithm).map_err(|problem| {
            let field = if problem.starts_with("week") {
                "per"
            } else {
                "requests"
            };
            err(format!("{at}.{field}"), problem)
        });
    }
    let limit = Limit::new(requests, period, l.burst).map_err(|problem| {
        let field = if problem.starts_with("burst") {
            "burst"
        } else if problem.starts_with("week") {
            "per"
        } else {
            "requests"
        };
        err(format!("{at}.{field}"), problem)
    })?;
    Ok(match algorithm {
        Algorithm::Gcra => limit.gcra(),
        _ => limit,
    })
}

/// A field that is there, whatever its value (`null` too: refused by its own check, not taken
/// for a field left out).
fn present<'de, D>(deserializer: D) -> Result<Option<serde_json::Value>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    <serde_json::Value as Deserialize>::deserialize(deserializer).map(Some)
}

/// A concurrent limit (`{"concurrent": 10, "max_hold": "10m"}`): no rate's fields.
fn concurrent(at: &str, l: &RawLimit) -> Result<Limit, ConfigError> {
    let rate_fields = [
        ("requests", l.requests.is_some()),
        ("per", l.per.is_some()),
        ("burst", l.burst.is_some()),
        ("delay", l.delay.is_some()),
        ("queue", l.queue.is_some()),
        ("max_delay_ms", l.max_delay_ms.is_some()),
    ];
    if let Some((field, _)) = rate_fields.iter().find(|(_, set)| *set) {
        return Err(err(
            format!("{at}.{field}"),
            format!("a concurrent limit counts requests in flight, not a rate: no {field} (write {{\"concurrent\": N}})"),
        ));
    }
    if let Some(other) = l.algorithm.as_deref().filter(|a| *a != "concurrency") {
        return Err(err(
            format!("{at}.algorithm"),
            format!("a concurrent limit's algorithm is concurrency (or left out), got {other:?}"),
        ));
    }
    let Some(concurrent) = l.concurrent else {
        return Err(err(
            format!("{at}.concurrent"),
            "the concurrency algorithm takes its limit from `concurrent` (requests in flight at once), not requests and per",
        ));
    };
    let max_hold = match &l.max_hold {
        None => Period::Every(crate::limit::concurrency::DEFAULT_MAX_HOLD_S as u32),
        Some(value) => period(value).map_err(|problem| err(format!("{at}.max_hold"), problem))?,
    };
    Limit::concurrent(concurrent, max_hold).map_err(|problem| {
        let field = if problem.starts_with("max_hold") {
            "max_hold"
        } else {
            "concurrent"
        };
        err(format!("{at}.{field}"), problem)
    })
}

/// The JSON Schema of `max_hold`: a duration or a number of seconds.
#[cfg(feature = "schema")]
fn max_hold_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "oneOf": [
            {"type": "string", "enum": ["second", "minute", "hour", "day"]},
            {"type": "string", "pattern": "^[0-9]+[smhd]$"},
            {"type": "integer", "minimum": 1, "maximum": crate::limit::concurrency::MAX_MAX_HOLD_S}
        ]
    })
}

/// `per` as configured: a name or a duration (a string), or a number of seconds.
fn period(per: &serde_json::Value) -> Result<Period, String> {
    match per {
        serde_json::Value::String(text) => Period::parse(text),
        serde_json::Value::Number(n) => match (n.as_u64(), n.as_i64(), n.as_f64()) {
            (Some(seconds), _, _) => {
                Period::from_seconds(seconds).map_err(|why| format!("{why}, got {n}"))
            }
            (None, Some(_), _) => Err(format!("must be at least 1 second, got {n}")),
            (None, None, Some(f)) if f < 1.0 => Err(format!("must be at least 1 second, got {n}")),
            (None, None, Some(f)) if f > Period::MAX_SECONDS as f64 => Err(format!(
                "must be at most 366 days ({} seconds), got {n}",
                Period::MAX_SECONDS
            )),
            _ => Err(format!(
                "a number of seconds is an integer (write 1.5 minutes as 90 or \"90s\"), got {n}"
            )),
        },
        other => {
            let kind = match other {
                serde_json::Value::Null => "null",
                serde_json::Value::Bool(_) => "a boolean",
                serde_json::Value::Array(_) => "an array",
                _ => "an object",
            };
            Err(format!("expected {}, got {kind}", Period::EXPECTED))
        }
    }
}

/// The JSON Schema of `penalty`: a duration, or a number of seconds.
#[cfg(feature = "schema")]
fn penalty_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "oneOf": [
            {"type": "string", "enum": ["second", "minute", "hour", "day"]},
            {"type": "string", "pattern": "^[0-9]+[smhd]$"},
            {"type": "integer", "minimum": Period::MIN_SECONDS, "maximum": Period::MAX_SECONDS},
            {"type": "null"}
        ]
    })
}

/// The JSON Schema of `per`: a name, a duration, or a number of seconds.
#[cfg(feature = "schema")]
fn period_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "oneOf": [
            {"type": "string", "enum": ["second", "minute", "hour", "day", "week", "month"]},
            {"type": "string", "pattern": "^[0-9]+[smhd]$"},
            {"type": "integer", "minimum": Period::MIN_SECONDS, "maximum": Period::MAX_SECONDS}
        ]
    })
}

fn valid_header_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_".contains(&b))
}

/// A key part as configured; `exact`: the rule's `query_names` is `exact`.
fn key_part(part: &str, exact: bool) -> Result<KeyPart, String> {
    if part.contains('|') {
        let alternatives = part
            .split('|')
            .map(|alt| match key_part(alt.trim(), exact)? {
                KeyPart::First(_) => Err(format!("{part:?}: alternatives do not nest")),
                one => Ok(one),
            })
            .collect::<Result<Vec<_>, _>>()?;
        if alternatives.len() < 2 {
            return Err(format!(
                "{part:?}: name two or more parts, such as jwt:sub|client_ip"
            ));
        }
        return Ok(KeyPart::First(alternatives));
    }
    if let Some(lengths) = part.strip_prefix("client_ip/") {
        let numbers: Vec<Option<u8>> = lengths.split('/').map(|n| n.parse().ok()).collect();
        let bad = || {
            format!(
                "{part:?}: expected client_ip/<IPv4 bits> (IPv6 at /64), client_ip/<IPv6 bits> (over 32) or client_ip/<IPv4 bits>/<IPv6 bits>"
            )
        };
        let (v4, v6) = match numbers[..] {
            [Some(n)] if (1..=32).contains(&n) => (n, 64),
            [Some(n)] if (33..=128).contains(&n) => (32, n),
            [Some(a), Some(b)] if (1..=32).contains(&a) && (1..=128).contains(&b) => (a, b),
            _ => return Err(bad()),
        };
        return Ok(KeyPart::ClientIpPrefix { v4, v6 });
    }
    if let Some(name) = part.strip_prefix("query:") {
        if name.is_empty() {
            return Err(format!("{part:?} does not name a query parameter"));
        }
        return Ok(KeyPart::Query {
            name: name.to_string(),
            exact,
        });
    }
    if let Some(name) = part.strip_prefix("jwt:") {
        let ok = !name.is_empty()
            && name.split('.').all(|s| !s.is_empty())
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.:/".contains(&b));
        if !ok {
            return Err(format!(
                "{part:?} does not name a claim (jwt:sub, jwt:org, jwt:plan.tier)"
            ));
        }
        return Ok(KeyPart::Claim(name.to_string()));
    }
    match part {
        "client_ip" => Ok(KeyPart::ClientIp),
        "path" => Ok(KeyPart::Path),
        "method" => Ok(KeyPart::Method),
        _ => {
            if let Some(name) = part.strip_prefix("header:") {
                let valid = !name.is_empty()
                    && name
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"-_".contains(&b));
                if !valid {
                    return Err(format!("{part:?} does not name a header"));
                }
                Ok(KeyPart::Header(name.to_ascii_lowercase()))
            } else if let Some(name) = part.strip_prefix("cookie:") {
                // RFC 6265's cookie-name (an RFC 7230 token), less `|`, which separates
                // alternatives.
                let valid = !name.is_empty()
                    && name.len() <= 256
                    && name
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`~".contains(&b));
                if !valid {
                    return Err(format!(
                        "{part:?} does not name a cookie (cookie:session_id: letters, digits and !#$%&'*+-.^_`~)"
                    ));
                }
                Ok(KeyPart::Cookie(name.to_string()))
            } else if let Some(value) = part.strip_prefix("const:") {
                Ok(KeyPart::Const(value.to_string()))
            } else {
                Err(format!(
                    "expected client_ip, client_ip/BITS, path, method, header:NAME, query:NAME, jwt:CLAIM, cookie:NAME, const:VALUE or alternatives a|b, got {part:?}"
                ))
            }
        }
    }
}

/// The counter service named the way `host` dispatches: a cluster in Envoy, an address in nginx.
fn check_upstream(host: Host, upstream: &Upstream) -> Result<(), ConfigError> {
    match (host, upstream) {
        (Host::Envoy, Upstream::Address(_)) => Err(err(
            "service.address",
            "Envoy reaches the counter service through a cluster: set service.cluster (an address is for host: nginx)",
        )),
        (Host::Nginx, Upstream::Cluster(_)) => Err(err(
            "service.cluster",
            "nginx reaches the counter service by address: set service.address (host:port) instead",
        )),
        _ => Ok(()),
    }
}

/// TLS named the way `host` does it: `service.tls` in nginx; in Envoy, the cluster's `transport_socket` (a
/// `service.tls` there would be ignored by Envoy, and a reader would believe the hop encrypted).
fn check_tls(host: Host, service: &Service) -> Result<(), ConfigError> {
    match host {
        Host::Envoy if service.tls => Err(err(
            "service.tls",
            "Envoy speaks TLS to the counter service through the cluster's transport_socket (an UpstreamTlsContext, docs/deploy.md), not service.tls, which is for host: nginx",
        )),
        _ => Ok(()),
    }
}

/// Checks a counter service address as nginx's dispatch takes it: `host:port`, the host an IP
/// address (`[v6]` bracketed) or a DNS name, the port 1 to 65535; no scheme, path, user or
/// spaces. Returns it as given.
pub fn service_address(address: &str) -> Result<String, String> {
    const SHAPE: &str = "expected host:port, such as 127.0.0.1:8081 or counter.internal:8081";
    if address.is_empty() || address.len() > 253 + 6 {
        return Err(format!("{SHAPE}, got {} bytes", address.len()));
    }
    if address.contains("://") {
        return Err(format!("{address:?} has a scheme: {SHAPE}"));
    }
    // A path, a user, spaces or line breaks: none belongs in a dispatch's host.
    if let Some(bad) = address
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || ".-:[]".contains(*c)))
    {
        return Err(format!(
            "{address:?} has {bad:?}, which no address has: {SHAPE}"
        ));
    }
    let (host, port) = match address.strip_prefix('[') {
        Some(rest) => match rest.split_once("]:") {
            Some((v6, port)) if v6.parse::<std::net::Ipv6Addr>().is_ok() => (v6, port),
            _ => return Err(format!("{address:?} is not [IPv6]:port: {SHAPE}")),
        },
        None => match address.rsplit_once(':') {
            Some((host, _)) if host.contains(':') => {
                return Err(format!(
                    "{address:?}: an IPv6 address goes in brackets, [::1]:8081"
                ))
            }
            Some((host, port)) => (host, port),
            None => return Err(format!("{address:?} has no port: {SHAPE}")),
        },
    };
    let port_ok = !port.is_empty()
        && port.len() <= 5
        && port.bytes().all(|b| b.is_ascii_digit())
        && matches!(port.parse::<u32>(), Ok(1..=65_535));
    if !port_ok {
        return Err(format!(
            "{address:?}: the port must be a number from 1 to 65535"
        ));
    }
    let is_ip = host.parse::<std::net::IpAddr>().is_ok();
    let is_name = !host.is_empty()
        && host.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        });
    if !(is_ip || is_name) {
        return Err(format!(
            "{address:?}: the host must be an IP address or a DNS name (letters, digits, - and .): {SHAPE}"
        ));
    }
    Ok(address.to_string())
}

fn service(raw: RawService) -> Result<Service, ConfigError> {
    let upstream = match (raw.cluster, raw.address) {
        (Some(_), Some(_)) => {
            return Err(err(
                "service",
                "set either cluster (Envoy) or address (nginx), not both",
            ))
        }
        (None, None) => {
            return Err(err(
                "service",
                "needs cluster (an Envoy cluster) or address (host:port, for nginx)",
            ))
        }
        (Some(cluster), None) if cluster.is_empty() => {
            return Err(err("service.cluster", "must name an Envoy cluster"));
        }
        (Some(cluster), None) => Upstream::Cluster(cluster),
        (None, Some(address)) => Upstream::Address(
            service_address(&address).map_err(|problem| err("service.address", problem))?,
        ),
    };
    let timeout_ms = raw.timeout_ms.unwrap_or(200);
    if !(1..=60_000).contains(&timeout_ms) {
        return Err(err("service.timeout_ms", "must be between 1 and 60000"));
    }
    let sync_interval_ms = raw.sync_interval_ms.unwrap_or(DEFAULT_SYNC_INTERVAL_MS);
    if !(10..=60_000).contains(&sync_interval_ms) {
        return Err(err(
            "service.sync_interval_ms",
            "must be between 10 and 60000",
        ));
    }
    let breaker_failures = raw.breaker_failures.unwrap_or(3);
    if breaker_failures == 0 {
        return Err(err("service.breaker_failures", "must be at least 1"));
    }
    let breaker_cooldown_ms = raw.breaker_cooldown_ms.unwrap_or(2_000);
    if !(10..=3_600_000).contains(&breaker_cooldown_ms) {
        return Err(err(
            "service.breaker_cooldown_ms",
            "must be between 10 and 3600000",
        ));
    }
    Ok(Service {
        authority: raw
            .authority
            .unwrap_or_else(|| upstream.target().to_string()),
        upstream,
        token: raw.token.unwrap_or_default(),
        tls: raw.tls.unwrap_or(false),
        timeout_ms,
        sync_interval_ms,
        breaker_failures,
        breaker_cooldown_ms,
    })
}
