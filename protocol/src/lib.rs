//! The wire contract between the filter and the counter service (`/v1`): the types, the bounds
//! both sides hold to, and the hash that places a key.
//!
//! They are plain data: the filter builds them from its shared state, the service answers them
//! from Redis. Algorithms never see them; `sluice-core` converts at its edge.

/// Most limits one rule, and so one entry, may have.
pub const MAX_LIMITS: usize = 8;
/// Shortest penalty a rule may have (`SyncEntry::penalty_ms`, `CheckRequest::penalty_ms`), in
/// milliseconds: 1 second.
pub const MIN_PENALTY_MS: u64 = 1_000;
/// Longest penalty a rule may have, in milliseconds: 366 days, the longest period.
pub const MAX_PENALTY_MS: u64 = 366 * 86_400_000;
/// Largest `requests`, `burst` or cost: keeps every token count exact in an `f64` and a `u32`.
pub const MAX_TOKENS: u64 = 1 << 31;
/// Most `requests` of a `sliding_log` limit: it keeps one timestamp per request admitted in
/// its window, per key (8 bytes each in a proxy, one sorted-set member in Redis).
pub const MAX_LOG: u64 = 1_000;
/// Longest key the filter sends: a longer one is replaced by a digest.
pub const MAX_KEY_BYTES: usize = 256;
/// Most keys of one kind (admitted, denied) in one rule's [`TopReport`], and most counters a
/// rule's `top_keys` may ask for.
pub const MAX_TOP_KEYS: usize = 64;
/// Most rules a sync's [`SyncRequest::top`] reports.
pub const MAX_TOP_RULES: usize = 32;
/// Largest count (or total, or error) a [`TopReport`] may carry: a proxy reports at most one
/// sync interval's requests, and a service sums them without overflow.
pub const MAX_TOP_COUNT: u64 = 1 << 40;
/// Most bytes of live overrides ([`LiveOverrides`]) a service may keep: its
/// `--overrides-max-bytes` is at most this. A proxy refuses a set whose JSON is longer than this
/// plus [`OVERRIDES_FRAME_BYTES`] (it keeps its last set), and a sync answer longer than
/// [`MAX_SYNC_ANSWER_BYTES`] unread.
pub const MAX_OVERRIDES_BYTES: usize = 4 << 20;
/// What a set's JSON holds beyond its entries as the service counts them (its version, the
/// names of its maps, their braces).
pub const OVERRIDES_FRAME_BYTES: usize = 1 << 10;
/// Longest sync answer a proxy reads: the largest set and a delta, plus a grant of up to 1 KiB
/// for each of 4,096 entries (a proxy sends at most 2,000).
pub const MAX_SYNC_ANSWER_BYTES: usize =
    2 * (MAX_OVERRIDES_BYTES + OVERRIDES_FRAME_BYTES) + (4 << 20);

/// FNV-1a, 64 bits: a stable hash every proxy and the service compute alike (the service's
/// Redis Cluster hash tag; the filter's table prefixes and jitter).
pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        hash ^= b as u64;
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The limit parameters of one key, as the service needs them to keep the global count.
///
/// By default (`algorithm` absent) a token bucket that holds at most `burst` tokens and refills
/// `requests` tokens every `period_ms`. With `algorithm` a window (`fixed_window`,
/// `sliding_window`), `requests` per window of `period_ms`, aligned to the Unix epoch (so to the
/// UTC clock: a day starts at 00:00 UTC), and `burst` equal to `requests`. A calendar window
/// (`calendar`: `week` from Monday 00:00 UTC, `month` from the 1st 00:00 UTC; `fixed_window`
/// only) has no fixed length: `period_ms` then holds its nominal length (7 days, 30 days), which
/// bounds `requests` as any window's, and the service aligns the window to the calendar.
///
/// A limit configured with a duration (`"per": "15m"`, `"per": 900`) travels as `second` to `day`
/// do, as its length in `period_ms` and nothing else: every window of `period_ms` is aligned to
/// the epoch on both sides, so a service that counts windows counts a duration as the proxy does.
///
/// Both new fields are omitted at their defaults, so a token bucket travels as before. A service
/// older than these fields ignores them and counts a token bucket: upgrade the service before
/// the proxies send windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LimitSpec {
    pub requests: u64,
    pub period_ms: u64,
    pub burst: u64,
    #[serde(default, skip_serializing_if = "AlgorithmSpec::is_token_bucket")]
    pub algorithm: AlgorithmSpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calendar: Option<Calendar>,
}

impl LimitSpec {
    /// A token bucket: `burst` at most, `requests` more every `period_ms`.
    pub const fn token_bucket(requests: u64, period_ms: u64, burst: u64) -> LimitSpec {
        LimitSpec {
            requests,
            period_ms,
            burst,
            algorithm: AlgorithmSpec::TokenBucket,
            calendar: None,
        }
    }

    /// A window of `period_ms` aligned to the epoch: `requests` per window.
    pub const fn window(algorithm: AlgorithmSpec, requests: u64, period_ms: u64) -> LimitSpec {
        LimitSpec {
            requests,
            period_ms,
            burst: requests,
            algorithm,
            calendar: None,
        }
    }

    /// A fixed window of the calendar: `requests` per week or month.
    pub const fn calendar(requests: u64, calendar: Calendar) -> LimitSpec {
        LimitSpec {
            requests,
            period_ms: calendar.period_ms(),
            burst: requests,
            algorithm: AlgorithmSpec::FixedWindow,
            calendar: Some(calendar),
        }
    }
}

/// How the service counts a limit (`LimitSpec::algorithm`), named in snake case on the wire.
/// An algorithm the service does not know refuses the request (400, naming the field).
///
/// `gcra` travels as `token_bucket`: the token bucket admits exactly the requests GCRA admits
/// (GCRA is the same bucket kept as one timestamp), so the service keeps one kind of state for
/// both. Keep it that way: a GCRA that admitted differently would need its own spec here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AlgorithmSpec {
    #[default]
    TokenBucket,
    FixedWindow,
    SlidingWindow,
    /// Exact: one timestamp per admitted request; decided per request (`/v1/check`), never
    /// leased.
    SlidingLog,
}

impl AlgorithmSpec {
    pub fn is_token_bucket(&self) -> bool {
        *self == AlgorithmSpec::TokenBucket
    }

    /// Whether it counts `requests` per window (no burst of its own).
    pub fn windowed(self) -> bool {
        !self.is_token_bucket()
    }

    pub fn name(self) -> &'static str {
        match self {
            AlgorithmSpec::TokenBucket => "token_bucket",
            AlgorithmSpec::FixedWindow => "fixed_window",
            AlgorithmSpec::SlidingWindow => "sliding_window",
            AlgorithmSpec::SlidingLog => "sliding_log",
        }
    }
}

/// A window that follows the UTC calendar (`LimitSpec::calendar`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Calendar {
    /// Monday 00:00 UTC to the next Monday 00:00 UTC.
    Week,
    /// The 1st 00:00 UTC to the next month's 1st 00:00 UTC.
    Month,
}

impl Calendar {
    /// The nominal length that travels in `period_ms`: 7 days, or 30 days for a month.
    pub const fn period_ms(self) -> u64 {
        match self {
            Calendar::Week => 7 * 86_400_000,
            Calendar::Month => 30 * 86_400_000,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Calendar::Week => "week",
            Calendar::Month => "month",
        }
    }
}

/// `POST /v1/sync`: one batch from one proxy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SyncRequest {
    /// Identifies the proxy process (stable for its lifetime, unique in the fleet).
    pub proxy: String,
    /// The sync interval the proxy is using, in milliseconds (sizes the grants).
    pub interval_ms: u64,
    pub entries: Vec<SyncEntry>,
    /// The proxy's load, when it sheds load: the service answers the fleet's level in
    /// [`Overrides::load_level`]. Absent from older proxies, and ignored by older services.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load: Option<LoadReport>,
    /// The version of the live overrides the proxy applies (0: none yet). The service answers
    /// [`Overrides::live`] (or [`Overrides::delta`]) when its own version differs.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub overrides_version: u64,
    /// The proxy applies deltas ([`Overrides::delta`]): a service may answer the changes since
    /// `overrides_version` instead of the whole set. Absent (false) from older proxies, which get
    /// the whole set; ignored by older services, which always answer it.
    #[serde(default, skip_serializing_if = "is_false")]
    pub overrides_delta: bool,
    /// The proxy divides a rule's fallback among the fleet (`"share": "fleet"`): the service
    /// counts it among the proxies recently seen with this flag and answers their number in
    /// [`Overrides::fleet_proxies`]. Absent (false) from older proxies and from proxies without
    /// such a rule, which are not counted; ignored by older services.
    #[serde(default, skip_serializing_if = "is_false")]
    pub fleet_share: bool,
    /// The keys each rule with `top_keys` admitted and denied most since the proxy's last
    /// report, as mergeable summaries ([`TopReport`]): at most [`MAX_TOP_RULES`] rules. Absent
    /// from older proxies and from proxies without such a rule; ignored by older services.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub top: Vec<TopReport>,
}

/// One rule's most admitted and most denied keys on one proxy since its last report.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopReport {
    /// The rule's name.
    pub rule: String,
    pub admitted: TopSummary,
    pub denied: TopSummary,
}

/// A mergeable summary of the keys of a stream of requests (Misra-Gries form): for every key,
/// `true - error <= count <= true` (a key not listed counts 0), and `error` is at most `total`
/// over the number of counters that counted them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopSummary {
    /// Requests summarized (at most [`MAX_TOP_COUNT`]).
    pub total: u64,
    /// How far below its true count any count may be (at most `total`).
    pub error: u64,
    /// At most [`MAX_TOP_KEYS`] keys, each at most [`MAX_KEY_BYTES`] bytes (a longer key travels
    /// as the filter's digest of it), with counts of 1 to `total`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub keys: Vec<TopKey>,
}

/// One key of a [`TopSummary`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopKey {
    pub key: String,
    pub count: u64,
}

fn is_zero(value: &u64) -> bool {
    *value == 0
}

fn is_false(value: &bool) -> bool {
    !*value
}

/// A proxy's load at the time of its sync, reported when it sheds load.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LoadReport {
    /// In-flight requests over the in-flight limit, summed over the proxy's bulkheads, in
    /// [0, 1] normally (may exceed 1 briefly).
    pub utilization: f64,
    /// Fraction of the requests it shed since its last report, in [0, 1].
    pub shed_rate: f64,
    /// Its upstreams' recent latency, in milliseconds (a smoothed average).
    pub latency_ms: f64,
}

/// What one proxy did with one key since its previous sync.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SyncEntry {
    /// The global key: the rule name and the key value, as built by the filter.
    pub key: String,
    /// Every limit of the rule; the grant covers all of them.
    pub limits: Vec<LimitSpec>,
    /// Tokens spent (requests admitted) since the previous sync, from a grant or a fallback.
    pub spent: u64,
    /// Requests denied since the previous sync (unmet demand: sizes the next grant). A fail-closed
    /// cached rule's requests the service decided with a check for want of a lease count here
    /// too: the check counted them, and the grant must cover such demand.
    pub denied: u64,
    /// The proxy's round when these counts were first sent: its epoch in the high 32 bits (drawn
    /// again whenever the proxy's sync state starts over), a counter increasing every round in
    /// the low 32. The service applies an entry only if its round is newer than the last one it
    /// applied for this proxy and key (same epoch, higher counter; or another epoch), and answers
    /// the grant either way: a batch resent after its answer was lost is not counted twice.
    /// 0 (older proxies): applied every time. Ignored by older services.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub round: u64,
    /// The rule's `penalty`, in milliseconds ([`MIN_PENALTY_MS`] to [`MAX_PENALTY_MS`]; 0 or
    /// absent: none): once the service sees the key over its limit (this report's denials with
    /// nothing left to grant, or its spend putting the key in debt), the key is denied
    /// fleet-wide for that long ([`Lease::penalty_ms`]). A service keeps one penalty per key
    /// and limits and each proxy honours it for its own rule's length at most, so a proxy
    /// cannot lengthen another's. Ignored by older services.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub penalty_ms: u64,
}

impl SyncEntry {
    /// The epoch of [`SyncEntry::round`] (its high 32 bits).
    pub fn epoch(&self) -> u32 {
        (self.round >> 32) as u32
    }

    /// The counter of [`SyncEntry::round`] (its low 32 bits).
    pub fn counter(&self) -> u32 {
        self.round as u32
    }
}

/// The answer to a [`SyncRequest`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SyncResponse {
    /// One grant per entry, in the order of the request.
    pub grants: Vec<Lease>,
    pub hints: Hints,
}

/// A lease (on the wire, a grant): the proxy may spend `tokens` more on this key until `ttl_ms`
/// from the answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    pub tokens: u64,
    pub ttl_ms: u64,
    /// Tokens left in the global bucket (the most restrictive limit), for rate-limit headers.
    pub remaining: u64,
    /// Milliseconds until the global bucket is full again (the most restrictive limit).
    pub reset_ms: u64,
    /// Milliseconds until every limit of the global state holds `remaining + 1` tokens (0: every
    /// one does now), as this answer counts: once the `remaining` tokens are spent (none when it
    /// is 0), the wait for the next one, whichever limit is short. For windows, until every
    /// window admits one request more than `remaining`: a fixed window's end, or when enough of a
    /// sliding window's previous window has slid out. Absent from older services (the proxy
    /// then works the wait out from `remaining` and `reset_ms`, exact for one bucket), ignored
    /// by older proxies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_ms: Option<u64>,
    /// Set when the service refused this entry alone (a key too long, a limit out of bounds):
    /// the reason, naming the field. Its counts were not applied and must not be sent again;
    /// the rest of the batch was applied as usual. The grant is then empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused: Option<String>,
    /// Milliseconds left of the key's penalty ([`SyncEntry::penalty_ms`]; 0 or absent: none):
    /// the grant is then empty, and the proxy denies the key until it ends. Absent from older
    /// services, ignored by older proxies.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub penalty_ms: u64,
}

/// Batch-wide advice from the service.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Hints {
    /// When to sync next, in milliseconds. Raised when the service or Redis is strained.
    pub next_sync_ms: u64,
    #[serde(default)]
    pub overrides: Overrides,
}

/// Fleet-wide switches that later features fill in. Unknown fields are ignored.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Overrides {
    /// Emergency bypass: admit everything while set.
    #[serde(default)]
    pub bypass: bool,
    /// Fleet load level in [0, 1], for load shedding: the mean utilization of the proxies
    /// whose [`LoadReport`] is fresh. Answered to a sync that carries a report.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_level: Option<f64>,
    /// How many proxies sent [`SyncRequest::fleet_share`] recently (this one included), each
    /// credential counting at most the service's `--fleet-max-proxies-per-credential`: what a
    /// fleet-share fallback divides its limits by. Answered to a sync that set the flag; absent
    /// when the service could not count (the proxy keeps the last count it heard).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fleet_proxies: Option<u64>,
    /// The live overrides operators set through the service's admin API, when the proxy's
    /// [`SyncRequest::overrides_version`] is not the service's: the whole set, replacing the
    /// proxy's. Absent when the proxy is up to date, or answered a delta.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub live: Option<LiveOverrides>,
    /// The changes of the live overrides since the proxy's version, to a proxy that announced
    /// [`SyncRequest::overrides_delta`] and whose version the service's change log still covers.
    /// At most one of `live` and `delta` is answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delta: Option<OverridesDelta>,
}

/// The changes of the live overrides from version `from` to version `version`: every entry
/// changed in between, as it is at `version` (set or replaced: its value; removed: its name).
/// Applied to the set at `from`, it gives the set at `version`; a proxy whose set is not at
/// `from` must not apply it (it asks for the whole set instead).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct OverridesDelta {
    /// The version the delta applies to (the proxy's).
    pub from: u64,
    /// The version it gives.
    pub version: u64,
    /// Limits set or replaced, by target, as in [`LiveOverrides::limits`].
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub limits: BTreeMap<String, Vec<serde_json::Value>>,
    /// Keys set or changed, per rule, as in [`LiveOverrides::keys`].
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub keys: BTreeMap<String, BTreeMap<String, KeyAction>>,
    /// When the keys it sets expire, as in [`LiveOverrides::expires`]: a key it sets that is
    /// not here has no expiry.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub expires: BTreeMap<String, BTreeMap<String, u64>>,
    /// Limit overrides removed, by target.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub removed_limits: Vec<String>,
    /// Key overrides removed, per rule (the key's parts joined by [`KEY_PART_SEPARATOR`]).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub removed_keys: BTreeMap<String, Vec<String>>,
}

/// The whole set of live overrides at one version. A proxy keeps the last set it had while it
/// cannot reach the service.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LiveOverrides {
    /// Changes with every change of the set (an empty set has a version too: it clears).
    pub version: u64,
    /// Limits replacing a rule's (`"rule"`) or one of its tiers' (`"rule/tier"`), in the filter
    /// configuration's own format (`{"requests": 100, "per": "minute"}`), validated by the
    /// service as the filter validates its configuration.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub limits: BTreeMap<String, Vec<serde_json::Value>>,
    /// Keys blocked or allowed, per rule: rule name, then the key's parts joined by
    /// [`KEY_PART_SEPARATOR`] (one part: the value itself, e.g. `"203.0.113.7"`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub keys: BTreeMap<String, BTreeMap<String, KeyAction>>,
    /// When a key override set with a ttl expires, in milliseconds since the Unix epoch (the
    /// service's clock), per rule and key as in [`LiveOverrides::keys`]; a key not here has no
    /// expiry. A proxy tells a blocked client the time left (its `Retry-After`). Absent from
    /// older services (every block then answers the default wait), ignored by older proxies.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub expires: BTreeMap<String, BTreeMap<String, u64>>,
}

/// Joins the parts of a key in [`LiveOverrides::keys`] (the filter's own separator).
pub const KEY_PART_SEPARATOR: char = '\u{1f}';

/// What an override does to one key of one rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeyAction {
    /// Every request of the key is denied by the rule (429, reason `blocked`).
    Block,
    /// The rule never counts nor denies the key.
    Allow,
}

/// `POST /v1/check`: one strict decision for one key.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckRequest {
    pub key: String,
    pub limits: Vec<LimitSpec>,
    #[serde(default = "one")]
    pub cost: u64,
    /// The rule's `penalty`, in milliseconds, as [`SyncEntry::penalty_ms`]: a key in its
    /// penalty is denied (its `retry_after_ms` the time left), and a denial starts one. Ignored
    /// by older services.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub penalty_ms: u64,
    /// The id of the proxy asking, as its syncs name it ([`SyncRequest::proxy`]): a denied
    /// answer then says the lease the service holds for that proxy on the key
    /// ([`CheckResponse::lease`]). Absent: the answer says none. Ignored by older services.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy: Option<String>,
}

fn one() -> u64 {
    1
}

/// The answer to a [`CheckRequest`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckResponse {
    pub allowed: bool,
    /// Tokens left after this decision (the most restrictive limit).
    pub remaining: u64,
    /// When denied: milliseconds until the request could be admitted.
    pub retry_after_ms: u64,
    /// Milliseconds until the bucket is full again.
    pub reset_ms: u64,
    /// When denied, and the request named its [`CheckRequest::proxy`]: the unexpired lease the
    /// service granted that proxy on the key (token buckets), which the check set aside as any
    /// proxy's. A sync's answer may still be on its way with it: the proxy may spend it as it
    /// would the sync's grant (the same grant, so applying both spends it once). Absent: none,
    /// or an older service.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<CheckLease>,
}

/// The lease a [`CheckResponse`] says its proxy holds: `tokens` more until `ttl_ms` from the
/// answer, as a [`Lease`] grants them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckLease {
    pub tokens: u64,
    pub ttl_ms: u64,
}

/// The JSON body of every error the service answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: String,
    pub message: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_bucket_travels_as_before_and_old_limits_read_as_token_buckets() {
        let bucket = LimitSpec::token_bucket(10, 1_000, 20);
        assert_eq!(
            serde_json::to_string(&bucket).unwrap(),
            r#"{"requests":10,"period_ms":1000,"burst":20}"#
        );
        let old: LimitSpec =
            serde_json::from_str(r#"{"requests":10,"period_ms":1000,"burst":20}"#).unwrap();
        assert_eq!(old, bucket);
    }

    #[test]
    fn windows_name_their_algorithm_and_calendar() {
        let daily = LimitSpec::window(AlgorithmSpec::FixedWindow, 3, 86_400_000);
        assert_eq!(
            serde_json::to_string(&daily).unwrap(),
            r#"{"requests":3,"period_ms":86400000,"burst":3,"algorithm":"fixed_window"}"#
        );
        let monthly = LimitSpec::calendar(1_000, Calendar::Month);
        let json = serde_json::to_string(&monthly).unwrap();
        assert_eq!(
            json,
            r#"{"requests":1000,"period_ms":2592000000,"burst":1000,"algorithm":"fixed_window","calendar":"month"}"#
        );
        assert_eq!(serde_json::from_str::<LimitSpec>(&json).unwrap(), monthly);
        let sliding = LimitSpec::window(AlgorithmSpec::SlidingWindow, 5, 60_000);
        let json = serde_json::to_string(&sliding).unwrap();
        assert!(json.contains(r#""algorithm":"sliding_window""#), "{json}");
        assert_eq!(serde_json::from_str::<LimitSpec>(&json).unwrap(), sliding);
    }

    #[test]
    fn an_unknown_algorithm_does_not_parse() {
        let error = serde_json::from_str::<LimitSpec>(
            r#"{"requests":1,"period_ms":1000,"burst":1,"algorithm":"fifo"}"#,
        )
        .unwrap_err();
        assert!(error.to_string().contains("fifo"), "{error}");
    }
}
