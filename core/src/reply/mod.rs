//! Every local reply the filter sends instead of forwarding a request, built here and nowhere
//! else: the 429 of a rate limit (or the status its rule sets), the 503 of load shedding (every
//! reason, the wait queue's too) and the 503 of a rule that fails closed without the counter
//! service.
//!
//! One contract for all of them (`docs/clients.md`; the bodies' JSON Schema is
//! `schema/reply.schema.json`, and `core/tests/reply.rs` checks every kind against it):
//!
//! ```text
//! {"error": CODE, "message": TEXT, "retryAfter": SECONDS, ...fields of the kind}
//! rate_limited          429   rule
//! overloaded            503   reason, bulkhead, class, level
//! limiter_unavailable   503   rule
//! ```
//!
//! with `Retry-After` (the same seconds as `retryAfter`) and `content-type: application/json`.
//! A gRPC request (`content-type: application/grpc` or `application/grpc+...`, as Envoy tells
//! one) gets a gRPC answer instead: Envoy turns a local reply to a gRPC request into a
//! trailers-only response (HTTP 200, every header in one frame), with the `grpc-status` the reply
//! names (8, RESOURCE_EXHAUSTED, for a rate limit; 14, UNAVAILABLE, otherwise), the message in
//! `grpc-message` (percent-encoded) and the wait in `grpc-retry-pushback-ms`, which gRPC's retry
//! policy reads.

pub mod headers;

use crate::limiter::decision::Quota;
use crate::limiter::key::KeyDigest;
use crate::policy::{HeaderStyle, Policy, Rule, RuleId};
use crate::reply::headers::{render_into, retry_after_seconds, ReplyHeaders, Reset};
use crate::request::RequestView;
use crate::shed::{Level, Seat, ShedReason, Shedding};

/// A local answer to send instead of forwarding the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    /// The HTTP status (for a gRPC request, Envoy answers 200 and carries `grpc_status`).
    pub status: u32,
    pub headers: ReplyHeaders,
    /// The JSON body; empty for a gRPC request (its message is in `grpc-message`).
    pub body: String,
    /// The gRPC status of a gRPC request's answer, handed to the host with the reply.
    pub grpc_status: Option<u32>,
    /// The response code details the host logs (Envoy's `%RESPONSE_CODE_DETAILS%`): which kind
    /// of reply, and for a shed one why: `sluice_rate_limited`, `sluice_limiter_unavailable`,
    /// `sluice_shed_<reason>` ([`ShedReason::name`]).
    pub details: &'static str,
    /// What the access log is told about the request ([`Facts`]).
    pub facts: Facts,
}

/// What the access log is told about a request sluice answered itself: the host sets each as a
/// property of the request ([`Facts::each`]), which Envoy keeps as filter state `wasm.<name>` and
/// its access log prints with `%FILTER_STATE(wasm.sluice.rule:PLAIN)%`. Nothing in them comes
/// from the client as it sent it: the names are the configuration's, the key only as its
/// [`KeyDigest`].
/// Kept small: a reply travels in every [`crate::Step`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Facts {
    pub outcome: Told,
    /// The rule that denied, or failed closed.
    pub rule: Option<RuleId>,
    /// The request's bulkhead and class, when shedding placed it (as [`Facts::placed`] stores them).
    seat: Option<(u32, u32)>,
    /// The digest of the key the rule denied.
    pub key: Option<KeyDigest>,
}

/// What sluice answered, as the access log names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Told {
    /// A rate limit.
    Denied,
    /// A rule that fails closed, without the counter service.
    Unavailable,
    Shed,
    /// A quota path's answer: the caller's own quota, nothing spent.
    Quota,
}

impl Told {
    pub fn name(self) -> &'static str {
        match self {
            Told::Denied => "denied",
            Told::Unavailable => "unavailable",
            Told::Shed => "shed",
            Told::Quota => "quota",
        }
    }
}

/// The properties [`Facts::each`] sets, in its order.
pub const FACT_PROPERTIES: [&str; 5] = [
    "sluice.outcome",
    "sluice.rule",
    "sluice.bulkhead",
    "sluice.class",
    "sluice.key",
];

impl Facts {
    /// The request's seat, if shedding placed it.
    pub fn placed(&mut self, seat: Option<Seat>) {
        self.seat = seat.map(|s| (s.bulkhead as u32, s.class as u32));
    }

    fn of(outcome: Told) -> Facts {
        Facts {
            outcome,
            rule: None,
            seat: None,
            key: None,
        }
    }

    /// Each fact known, as a property name ([`FACT_PROPERTIES`]) and its value, names looked up
    /// in `policy`: one host call each, on a local reply only, and none unless the policy asks
    /// for them (`access_log`).
    pub fn each(&self, policy: &Policy, property: &mut dyn FnMut(&'static str, &[u8])) {
        if !policy.access_log {
            return;
        }
        let [outcome, rule, bulkhead, class, key] = FACT_PROPERTIES;
        property(outcome, self.outcome.name().as_bytes());
        if let Some(spec) = self.rule.and_then(|r| policy.rules.get(r.index())) {
            property(rule, spec.name.as_bytes());
        }
        if let (Some(seat), Some(shedding)) = (self.seat, policy.shedding.as_ref()) {
            if let Some(b) = shedding.bulkheads.get(seat.0 as usize) {
                property(bulkhead, b.name.as_bytes());
            }
            if let Some(c) = shedding.classes.get(seat.1 as usize) {
                property(class, c.name.as_bytes());
            }
        }
        if let Some(digest) = self.key {
            property(key, &digest.hex());
        }
    }
}

impl Reply {
    /// The reply linking to `docs` (the policy's `docs_url`), if any: a `"docs"` field at the end
    /// of an HTTP body and a `Link: <docs>; rel="help"` header (a gRPC answer has only the header).
    /// `docs` was checked by the configuration: nothing in it ends a JSON string or the header.
    #[inline]
    pub fn linking(self, docs: Option<&str>) -> Reply {
        match docs {
            None => self,
            Some(docs) => self.linked(docs),
        }
    }

    /// [`Reply::linking`]'s work, out of line.
    #[inline(never)]
    fn linked(mut self, docs: &str) -> Reply {
        link(&mut self.headers, &mut self.body, docs);
        self
    }
}

/// Links a reply's `headers` and `body` to `docs` ([`Reply::linking`]): out of line, so that a
/// configuration without a page pays an option's test.
#[inline(never)]
fn link(headers: &mut ReplyHeaders, body: &mut String, docs: &str) {
    if body.ends_with('}') {
        body.pop();
        body.push_str(",\"docs\":\"");
        push_escaped(body, docs);
        body.push_str("\"}");
    }
    let mut link = String::with_capacity(docs.len() + 14);
    link.push('<');
    link.push_str(docs);
    link.push_str(">; rel=\"help\"");
    headers.push("link", &link);
}

/// The answer of a rule's `quota_path`: 200, the caller's own quota of each rule that answers
/// the path, by rule name (`null` for a rule that does not count the caller: a key part it
/// skips is missing), read at `now_us`:
///
/// ```text
/// {"rules": {"api": {"limit": 100, "remaining": 42, "reset": 17, "resetAt": 1700000017, "window": 60}}}
/// ```
///
/// `limit` and `window` (seconds) are the limit in force, `remaining` what the key has left of it,
/// `reset` the seconds until it is whole again and `resetAt` that time as a Unix time. Rule
/// names are checked by the configuration (nothing in them ends a JSON string).
pub fn quota(rules: &[(&str, Option<Quota>)], now_us: u64) -> Reply {
    let mut body = String::with_capacity(48 + rules.len() * 96);
    body.push_str("{\"rules\":{");
    for (i, (name, quota)) in rules.iter().enumerate() {
        if i > 0 {
            body.push(',');
        }
        body.push('"');
        push_escaped(&mut body, name);
        body.push_str("\":");
        match quota {
            None => body.push_str("null"),
            Some(q) => {
                let reset = headers::ceil_seconds(q.reset_us);
                let at = headers::ceil_seconds(now_us.saturating_add(q.reset_us));
                body.push_str(&format!(
                    "{{\"limit\":{},\"remaining\":{},\"reset\":{reset},\"resetAt\":{at},\"window\":{}}}",
                    q.limit.requests(),
                    q.remaining.min(q.limit.burst()),
                    q.limit.period().seconds()
                ));
            }
        }
    }
    body.push_str("}}");
    let mut headers = ReplyHeaders::with_capacity(64);
    headers.push("content-type", "application/json");
    headers.push("cache-control", "no-store");
    Reply {
        status: 200,
        headers,
        body,
        grpc_status: None,
        details: "sluice_quota",
        facts: Facts::of(Told::Quota),
    }
}

/// The response code details of a request shed by `reason`.
pub fn shed_details(reason: ShedReason) -> &'static str {
    match reason {
        ShedReason::Concurrency => "sluice_shed_concurrency",
        ShedReason::Priority => "sluice_shed_priority",
        ShedReason::Deadline => "sluice_shed_deadline",
        ShedReason::Errors => "sluice_shed_errors",
        ShedReason::Degraded => "sluice_shed_degraded",
        ShedReason::Fleet => "sluice_shed_fleet",
        ShedReason::QueueFull => "sluice_shed_queue_full",
        ShedReason::QueueTimeout => "sluice_shed_queue_timeout",
        ShedReason::Curve => "sluice_shed_curve",
    }
}

/// The stable codes of `error`, one per kind of reply.
pub const RATE_LIMITED: &str = "rate_limited";
pub const OVERLOADED: &str = "overloaded";
pub const LIMITER_UNAVAILABLE: &str = "limiter_unavailable";

/// gRPC's RESOURCE_EXHAUSTED: a rate limit.
pub const GRPC_RESOURCE_EXHAUSTED: u32 = 8;
/// gRPC's UNAVAILABLE: shed, or a rule that fails closed.
pub const GRPC_UNAVAILABLE: u32 = 14;
/// The header (trailer, in a trailers-only answer) gRPC's retry policy reads the wait from, in
/// milliseconds.
pub const PUSHBACK_HEADER: &str = "grpc-retry-pushback-ms";
/// The response header on a shed 503 that names why the request was shed.
pub const SHED_HEADER: &str = "x-sluice-shed";

/// Longest a rule's own `deny_message` may be, in bytes.
pub const MAX_MESSAGE_BYTES: usize = 1024;

/// What kind of client asked: the answer is shaped for it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Protocol {
    #[default]
    Http,
    /// `content-type: application/grpc` or `application/grpc+...` (as Envoy decides that a
    /// request is gRPC: `application/grpc-web` is not).
    Grpc,
}

impl Protocol {
    /// The protocol a request's `content-type` says.
    pub fn of(content_type: Option<&str>) -> Protocol {
        let grpc = content_type
            .and_then(|c| c.strip_prefix("application/grpc"))
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('+'));
        match grpc {
            true => Protocol::Grpc,
            false => Protocol::Http,
        }
    }

    /// The protocol of `request` (it reads the request's `content-type`).
    pub fn of_request(request: &mut dyn RequestView) -> Protocol {
        Protocol::of(request.first_header("content-type").as_deref())
    }
}

/// A denial by `rule`: its status (429 unless the rule sets one), its message, and its
/// rate-limit headers in `style` unless the rule hides them on denials (`X-RateLimit-Reset` as
/// `reset` writes it), linked to `docs` (the policy's `docs_url`) as [`Reply::linking`] links.
pub fn rate_limited(
    rule: &Rule,
    quota: &Quota,
    retry_after_us: u64,
    style: HeaderStyle,
    reset: Reset,
    protocol: Protocol,
    docs: Option<&str>,
) -> Reply {
    let name = rule.name.as_str();
    let retry_after = retry_after_seconds(retry_after_us);
    let custom = rule.answer.message.as_deref();
    let style = match rule.answer.headers_denied {
        true => style,
        false => HeaderStyle::None,
    };
    // Room for the longest: both header styles, which name the rule twice.
    let mut headers = ReplyHeaders::with_capacity(256 + 2 * name.len());
    push_retry(&mut headers, retry_after, protocol);
    let mut body = body_or_message(
        &mut headers,
        protocol,
        retry_after,
        || rate_limited_body(name, custom, quota, retry_after),
        || rate_limited_message(name, custom, quota),
    );
    render_into(&mut headers, style, name, quota, reset);
    // Linked here rather than by [`Reply::linking`]: the reply is not copied once more.
    if let Some(docs) = docs {
        link(&mut headers, &mut body, docs);
    }
    Reply {
        status: rule.answer.status,
        headers,
        body,
        grpc_status: grpc(protocol, GRPC_RESOURCE_EXHAUSTED),
        details: "sluice_rate_limited",
        facts: Facts::of(Told::Denied),
    }
}

/// The 503 of a rule that fails closed while the counter service is out of reach: not a rate
/// limit, and said so.
pub fn limiter_unavailable(rule: &str, retry_after_us: u64, protocol: Protocol) -> Reply {
    let retry_after = retry_after_seconds(retry_after_us);
    let mut headers = ReplyHeaders::with_capacity(64);
    push_retry(&mut headers, retry_after, protocol);
    let body = body_or_message(
        &mut headers,
        protocol,
        retry_after,
        || limiter_unavailable_body(rule, retry_after),
        || unavailable_message(rule),
    );
    unavailable(
        headers,
        body,
        protocol,
        "sluice_limiter_unavailable",
        Told::Unavailable,
    )
}

/// The 503 for a request shed by `reason`. `Retry-After` is spread over [s, 2s) by `draw`, so
/// shed clients do not all come back at once.
pub fn overloaded(
    shedding: &Shedding,
    seat: Seat,
    level: Level,
    reason: ShedReason,
    draw: f64,
    protocol: Protocol,
) -> Reply {
    let base = shedding.retry_after_s;
    let retry_after = base + (draw.clamp(0.0, 0.999) * base as f64) as u64;
    let bulkhead = shedding
        .bulkheads
        .get(seat.bulkhead)
        .map_or("", |b| b.name.as_str());
    let class = shedding
        .classes
        .get(seat.class)
        .map_or("", |c| c.name.as_str());
    let mut headers = ReplyHeaders::with_capacity(96);
    push_retry(&mut headers, retry_after, protocol);
    headers.push(SHED_HEADER, reason.name());
    let body = body_or_message(
        &mut headers,
        protocol,
        retry_after,
        || overloaded_body(reason, bulkhead, class, level, retry_after),
        || overloaded_message(reason),
    );
    let mut reply = unavailable(headers, body, protocol, shed_details(reason), Told::Shed);
    reply.facts.placed(Some(seat));
    reply
}

/// A 503 (gRPC UNAVAILABLE).
fn unavailable(
    headers: ReplyHeaders,
    body: String,
    protocol: Protocol,
    details: &'static str,
    outcome: Told,
) -> Reply {
    Reply {
        status: 503,
        headers,
        body,
        grpc_status: grpc(protocol, GRPC_UNAVAILABLE),
        details,
        facts: Facts::of(outcome),
    }
}

/// An HTTP answer's JSON body; a gRPC answer has none, its message goes in `grpc-message`.
fn body_or_message(
    headers: &mut ReplyHeaders,
    protocol: Protocol,
    retry_after: u64,
    body: impl FnOnce() -> String,
    message: impl FnOnce() -> String,
) -> String {
    match protocol {
        Protocol::Http => body(),
        Protocol::Grpc => {
            push_grpc_message(headers, &message(), retry_after);
            String::new()
        }
    }
}

fn grpc(protocol: Protocol, status: u32) -> Option<u32> {
    (protocol == Protocol::Grpc).then_some(status)
}

/// `Retry-After`, and the content type of an HTTP body (a gRPC answer's is Envoy's).
fn push_retry(headers: &mut ReplyHeaders, retry_after: u64, protocol: Protocol) {
    headers.push("retry-after", itoa::Buffer::new().format(retry_after));
    if protocol == Protocol::Http {
        headers.push("content-type", "application/json");
    }
}

/// A gRPC answer's message and the wait, in milliseconds, for gRPC's retry policy.
fn push_grpc_message(headers: &mut ReplyHeaders, message: &str, retry_after: u64) {
    headers.push("grpc-message", &percent_encode(message));
    headers.push(
        PUSHBACK_HEADER,
        itoa::Buffer::new().format(retry_after.saturating_mul(1_000)),
    );
}

/// `text` as gRPC's `grpc-message` carries it: every byte outside printable ASCII (0x20 to
/// 0x7E), and `%` itself, as `%XX`.
pub fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for &b in text.as_bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(b as char);
        } else {
            const HEX: &[u8; 16] = b"0123456789ABCDEF";
            out.push('%');
            out.push(HEX[(b >> 4) as usize] as char);
            out.push(HEX[(b & 0xf) as usize] as char);
        }
    }
    out
}

/// Appends `text` to JSON being written, escaped as a JSON string's content.
fn push_escaped(out: &mut String, text: &str) {
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 || c == '\u{7f}' => {
                out.push_str("\\u00");
                const HEX: &[u8; 16] = b"0123456789abcdef";
                out.push(HEX[(c as u32 >> 4) as usize] as char);
                out.push(HEX[(c as u32 & 0xf) as usize] as char);
            }
            c => out.push(c),
        }
    }
}

/// The limit's period as a message names it: a named period borrowed (`minute`), a duration
/// written out (`15m`).
fn period_name(quota: &Quota) -> std::borrow::Cow<'static, str> {
    let period = quota.limit.period();
    match period.static_name() {
        Some(name) => std::borrow::Cow::Borrowed(name),
        None => std::borrow::Cow::Owned(period.to_string()),
    }
}

/// The message of a denial: the rule's own, or what the limit is.
fn rate_limited_message(rule: &str, custom: Option<&str>, quota: &Quota) -> String {
    if let Some(custom) = custom {
        return custom.to_string();
    }
    let mut requests = itoa::Buffer::new();
    let requests = requests.format(quota.limit.requests());
    if quota.limit.algorithm() == crate::limit::Algorithm::Concurrency {
        return [IN_FLIGHT, requests, " at once for rule ", rule].concat();
    }
    let period = period_name(quota);
    [
        "rate limit exceeded: ",
        requests,
        " requests per ",
        &period,
        " for rule ",
        rule,
    ]
    .concat()
}

/// How a concurrent limit's denial begins.
const IN_FLIGHT: &str = "too many requests in flight: at most ";

/// The JSON body of a denial. Rule names are validated to `[A-Za-z0-9._-]`, so they need no
/// escaping; a rule's own message is escaped.
pub fn rate_limited_body(
    rule: &str,
    custom: Option<&str>,
    quota: &Quota,
    retry_after: u64,
) -> String {
    // Written piece by piece: it is sent on every denial, and the formatting machinery costs
    // more than the rest of the decision.
    let mut retry = itoa::Buffer::new();
    let retry = retry.format(retry_after);
    let mut body = String::with_capacity(160 + 2 * rule.len() + custom.map_or(0, str::len));
    body.push_str("{\"error\":\"rate_limited\",\"message\":\"");
    match custom {
        Some(custom) => push_escaped(&mut body, custom),
        None => {
            let mut requests = itoa::Buffer::new();
            let requests = requests.format(quota.limit.requests());
            if quota.limit.algorithm() == crate::limit::Algorithm::Concurrency {
                for piece in [
                    IN_FLIGHT,
                    requests,
                    " at once for rule ",
                    rule,
                    "; retry in ",
                    retry,
                    " s",
                ] {
                    body.push_str(piece);
                }
            } else {
                let period = period_name(quota);
                for piece in [
                    "rate limit exceeded: ",
                    requests,
                    " requests per ",
                    &period,
                    " for rule ",
                    rule,
                    "; retry in ",
                    retry,
                    " s",
                ] {
                    body.push_str(piece);
                }
            }
        }
    }
    for piece in ["\",\"retryAfter\":", retry, ",\"rule\":\"", rule, "\"}"] {
        body.push_str(piece);
    }
    body
}

fn unavailable_message(rule: &str) -> String {
    format!("the rate limit service cannot be reached and rule {rule} fails closed")
}

/// The JSON body of a rule that fails closed without the counter service.
pub fn limiter_unavailable_body(rule: &str, retry_after: u64) -> String {
    let mut body = String::with_capacity(192 + 2 * rule.len());
    body.push_str("{\"error\":\"limiter_unavailable\",\"message\":\"");
    push_escaped(&mut body, &unavailable_message(rule));
    let mut retry = itoa::Buffer::new();
    let retry = retry.format(retry_after);
    for piece in ["; retry in ", retry, " s\",\"retryAfter\":", retry] {
        body.push_str(piece);
    }
    body.push_str(",\"rule\":\"");
    push_escaped(&mut body, rule);
    body.push_str("\"}");
    body
}

fn overloaded_message(reason: ShedReason) -> String {
    format!("the upstream is overloaded ({})", reason.name())
}

/// The JSON body of a shed request.
pub fn overloaded_body(
    reason: ShedReason,
    bulkhead: &str,
    class: &str,
    level: Level,
    retry_after: u64,
) -> String {
    let mut retry = itoa::Buffer::new();
    let retry = retry.format(retry_after);
    let mut body = String::with_capacity(224 + bulkhead.len() + class.len());
    body.push_str("{\"error\":\"overloaded\",\"message\":\"");
    push_escaped(&mut body, &overloaded_message(reason));
    for piece in ["; retry in ", retry, " s\",\"retryAfter\":", retry] {
        body.push_str(piece);
    }
    for (name, value) in [
        ("reason", reason.name()),
        ("bulkhead", bulkhead),
        ("class", class),
        ("level", level.name()),
    ] {
        body.push_str(",\"");
        body.push_str(name);
        body.push_str("\":\"");
        push_escaped(&mut body, value);
        body.push('"');
    }
    body.push('}');
    body
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::{Limit, Period};

    fn quota() -> Quota {
        Quota {
            limit: Limit::new(100, Period::Minute, Some(20)).unwrap(),
            remaining: 0,
            reset_us: 3_000_001,
        }
    }

    #[test]
    fn grpc_is_told_as_envoy_tells_it() {
        assert_eq!(Protocol::of(Some("application/grpc")), Protocol::Grpc);
        assert_eq!(Protocol::of(Some("application/grpc+proto")), Protocol::Grpc);
        assert_eq!(Protocol::of(Some("application/grpc-web")), Protocol::Http);
        assert_eq!(Protocol::of(Some("application/json")), Protocol::Http);
        assert_eq!(Protocol::of(None), Protocol::Http);
    }

    #[test]
    fn grpc_message_is_percent_encoded() {
        assert_eq!(percent_encode("a b~"), "a b~");
        assert_eq!(percent_encode("100%"), "100%25");
        assert_eq!(percent_encode("é\n\"x\""), "%C3%A9%0A\"x\"");
    }

    #[test]
    fn the_429_body_is_the_contract() {
        assert_eq!(
            rate_limited_body("per-ip", None, &quota(), 4),
            r#"{"error":"rate_limited","message":"rate limit exceeded: 100 requests per minute for rule per-ip; retry in 4 s","retryAfter":4,"rule":"per-ip"}"#
        );
        let custom = rate_limited_body("per-ip", Some("slow \"down\"\\\n"), &quota(), 4);
        let body: serde_json::Value = serde_json::from_str(&custom).unwrap();
        assert_eq!(body["message"], "slow \"down\"\\\n");
    }
}
