//! Who is being limited, fleet-wide: the proxies' top-key summaries ([`SyncRequest::top`]),
//! merged per minute, and `GET /admin/v1/top?rule=…&window=…` that answers them.
//!
//! Each sync's [`TopReport`]s are kept in this replica's memory, per credential, rule and minute
//! of the service's clock, each kind (admitted, denied) a mergeable summary of at most
//! [`KEYS_PER_KIND`] keys ([`sluice_core::top::Summary`]): for every key, the count answered is
//! at most its true count and at most `error` below it, and `error` is at most the total over the
//! smallest sketch that counted it (a proxy's `top_keys`). A query merges the minutes of its
//! window per credential, then adds the credentials up without cutting any, so that no
//! credential lowers another's counts. Which keys it lists ([`picked`]): of the C credentials that
//! reported keys of the kind, each one's own top `limit / C` (by its own counts), then the rest
//! largest count first. So what one credential reports never pushes another's top keys out of the
//! answer while `limit` is at least C; below that, the slots go to the largest counts.
//!
//! What one caller can do is bounded here. A credential keeps at most [`SERIES_PER_CREDENTIAL`]
//! rules and the replica at most [`MAX_SERIES`] (credential, rule) pairs: a report past either
//! bound is not kept (counted `full`), and a pair unheard for the longest window is dropped
//! first. A report out of bounds (more than [`MAX_TOP_KEYS`] keys of a kind, a total over
//! [`MAX_TOP_COUNT`], an error over its total, a rule name the configuration could not have) is
//! refused alone; a key longer than [`MAX_KEY_BYTES`], of another rule, or counted 0 or more
//! than its summary's total is dropped alone (its count moves into the error, which stays
//! true). The answer names keys as the proxies built them: a key longer than the key cap is the
//! filter's digest of it (`rule␟#sha256:…`).
//!
//! Memory: at most `MAX_SERIES × (WINDOW_MAX_MINUTES + 1) × 2 × KEYS_PER_KIND` keys of at most
//! [`MAX_KEY_BYTES`] bytes (about 80 MiB in the worst case, a few hundred KiB for a handful of
//! rules of short keys). Each replica answers what it was sent: behind a load balancer, query
//! each replica (or run one for the fleet's view); a restart forgets it.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use axum::http::Uri;
use percent_encoding::percent_decode_str;
use serde_json::{json, Value};
use sluice_core::top::Summary;
use sluice_protocol::{
    TopReport, TopSummary, KEY_PART_SEPARATOR, MAX_KEY_BYTES, MAX_TOP_COUNT, MAX_TOP_KEYS,
    MAX_TOP_RULES,
};

use crate::error::AppError;

/// Keys of each kind kept per credential, rule and minute (and most a query answers).
pub const KEYS_PER_KIND: usize = MAX_TOP_KEYS;
/// The longest window a query may ask for, in minutes.
pub const WINDOW_MAX_MINUTES: u64 = 15;
/// Most (credential, rule) pairs a replica keeps.
pub const MAX_SERIES: usize = 256;
/// Most rules one credential keeps.
pub const SERIES_PER_CREDENTIAL: usize = MAX_TOP_RULES;
/// Keys a query answers unless it asks (`limit`).
pub const DEFAULT_LIMIT: usize = 20;

const MINUTE_MS: u64 = 60_000;

/// One minute of one kind pair.
#[derive(Debug, Default, Clone)]
struct Minute {
    at: u64,
    admitted: Summary,
    denied: Summary,
}

/// What this replica keeps: the minutes of each (credential, rule).
#[derive(Debug, Default)]
pub struct Board {
    series: Mutex<HashMap<(String, String), VecDeque<Minute>>>,
}

/// What became of one report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recorded {
    /// Kept; `dropped` keys were out of bounds and left out.
    Kept { dropped: usize },
    /// Not kept: the credential or the replica keeps as many rules as it may.
    Full,
    /// Refused: the reason, naming the field.
    Refused(String),
}

impl Board {
    /// Records `report` (the `index`-th of its sync) of `credential` at `now_ms`.
    pub fn record(
        &self,
        credential: &str,
        index: usize,
        report: &TopReport,
        now_ms: u64,
    ) -> Recorded {
        let at = format!("top[{index}]");
        if let Err(AppError::Invalid { field, reason }) =
            crate::validate::target_name(&format!("{at}.rule"), &report.rule)
        {
            return Recorded::Refused(format!("{field}: {reason}"));
        }
        let mut dropped = 0;
        let mut kinds = [Summary::default(), Summary::default()];
        for ((name, summary), kept) in [("admitted", &report.admitted), ("denied", &report.denied)]
            .into_iter()
            .zip(kinds.iter_mut())
        {
            match checked(&report.rule, summary) {
                Ok((summary, lost)) => {
                    *kept = summary;
                    dropped += lost;
                }
                Err(reason) => return Recorded::Refused(format!("{at}.{name}.{reason}")),
            }
        }
        let [admitted, denied] = kinds;
        let minute = now_ms / MINUTE_MS;
        let Ok(mut series) = self.series.lock() else {
            return Recorded::Full;
        };
        forget_stale(&mut series, minute);
        let name = (credential.to_string(), report.rule.clone());
        if !series.contains_key(&name) {
            let of_credential = series.keys().filter(|(c, _)| c == credential).count();
            if of_credential >= SERIES_PER_CREDENTIAL || series.len() >= MAX_SERIES {
                return Recorded::Full;
            }
        }
        let minutes = series.entry(name).or_default();
        if minutes.back().is_none_or(|m| m.at != minute) {
            minutes.push_back(Minute {
                at: minute,
                ..Minute::default()
            });
        }
        while minutes.len() as u64 > WINDOW_MAX_MINUTES {
            minutes.pop_front();
        }
        if let Some(last) = minutes.back_mut() {
            last.admitted.merge(&admitted, KEYS_PER_KIND);
            last.denied.merge(&denied, KEYS_PER_KIND);
        }
        Recorded::Kept { dropped }
    }

    /// The keys of `rule` over the current minute and the `minutes - 1` before it, at `now_ms`:
    /// each kind merged per credential over the window, then summed over the credentials, its
    /// `limit` largest counts.
    pub fn query(&self, rule: &str, minutes: u64, limit: usize, now_ms: u64) -> Value {
        let own = self.own(rule, minutes, now_ms);
        let (admitted, denied) = summed(&own);
        let admitted_own: Vec<&Summary> = own.iter().map(|(a, _)| a).collect();
        let denied_own: Vec<&Summary> = own.iter().map(|(_, d)| d).collect();
        json!({
            "rule": rule,
            "window_minutes": minutes,
            "credentials": own.len(),
            "admitted": shown(&admitted, &admitted_own, limit),
            "denied": shown(&denied, &denied_own, limit),
        })
    }

    /// What [`Board::query`] answers, whole: the admitted and denied summaries, and how many
    /// credentials reported the rule in the window.
    pub fn merged(&self, rule: &str, minutes: u64, now_ms: u64) -> (Summary, Summary, usize) {
        let own = self.own(rule, minutes, now_ms);
        let (admitted, denied) = summed(&own);
        (admitted, denied, own.len())
    }

    /// The (admitted, denied) summaries of `rule` over the window, each credential's that
    /// reported it merged over its minutes.
    fn own(&self, rule: &str, minutes: u64, now_ms: u64) -> Vec<(Summary, Summary)> {
        let now = now_ms / MINUTE_MS;
        let from = now.saturating_sub(minutes.saturating_sub(1));
        let mut credentials = Vec::new();
        if let Ok(series) = self.series.lock() {
            for ((_, r), kept) in series.iter() {
                if r != rule {
                    continue;
                }
                let mut own = (Summary::default(), Summary::default());
                for m in kept.iter().filter(|m| (from..=now).contains(&m.at)) {
                    own.0.merge(&m.admitted, KEYS_PER_KIND);
                    own.1.merge(&m.denied, KEYS_PER_KIND);
                }
                if !(own.0.is_empty() && own.1.is_empty()) {
                    credentials.push(own);
                }
            }
        }
        credentials
    }
}

/// The credentials' summaries added up, never cut: one credential's keys take no room of
/// another's.
fn summed(own: &[(Summary, Summary)]) -> (Summary, Summary) {
    let mut admitted = Summary::default();
    let mut denied = Summary::default();
    for (a, d) in own {
        admitted.merge(a, usize::MAX);
        denied.merge(d, usize::MAX);
    }
    (admitted, denied)
}

/// The `limit` keys of a kind the answer lists, with their summed counts, largest first: of the C
/// credentials whose `own` summary lists keys, each one's top `limit / C` keys by its own counts
/// (at most `limit` in all), then the rest of `summed` largest first. So a credential's report
/// cannot push another's top `limit / C` out, however large its counts; with `limit` below C,
/// every key is taken by its summed count.
fn picked<'a>(summed: &'a Summary, own: &[&'a Summary], limit: usize) -> Vec<(&'a str, u64)> {
    let counts: HashMap<&str, u64> = summed.keys.iter().map(|(k, c)| (k.as_str(), *c)).collect();
    let reporting: Vec<&Summary> = own.iter().copied().filter(|s| !s.keys.is_empty()).collect();
    let share = limit / reporting.len().max(1);
    let mut listed: Vec<(&str, u64)> = Vec::with_capacity(limit);
    let take = |listed: &mut Vec<(&'a str, u64)>, key: &'a str| {
        if listed.len() < limit && !listed.iter().any(|(k, _)| *k == key) {
            listed.push((key, counts.get(key).copied().unwrap_or(0)));
        }
    };
    for rank in 0..share.min(KEYS_PER_KIND) {
        for summary in &reporting {
            if let Some((key, _)) = summary.keys.get(rank) {
                take(&mut listed, key);
            }
        }
    }
    for (key, _) in &summed.keys {
        if listed.len() >= limit {
            break;
        }
        take(&mut listed, key);
    }
    listed.sort_unstable_by(|(ka, ca), (kb, cb)| cb.cmp(ca).then_with(|| ka.cmp(kb)));
    listed
}

/// A kind as the answer shows it: `summed`'s totals and the keys [`picked`] from it.
fn shown(summed: &Summary, own: &[&Summary], limit: usize) -> Value {
    let keys: Vec<Value> = picked(summed, own, limit)
        .into_iter()
        .map(|(key, count)| json!({"key": key, "count": count, "at_most": count.saturating_add(summed.error)}))
        .collect();
    json!({
        "total": summed.total,
        "error_bound": summed.error,
        "keys": keys,
    })
}

/// Drops the pairs unheard for the longest window.
fn forget_stale(series: &mut HashMap<(String, String), VecDeque<Minute>>, minute: u64) {
    series.retain(|_, minutes| {
        minutes
            .back()
            .is_some_and(|m| m.at + WINDOW_MAX_MINUTES > minute)
    });
}

/// A summary within bounds, as a core summary, and how many keys it dropped; else the reason,
/// naming the field.
fn checked(rule: &str, summary: &TopSummary) -> Result<(Summary, usize), String> {
    if summary.total > MAX_TOP_COUNT {
        return Err(format!("total: more than {MAX_TOP_COUNT}"));
    }
    if summary.error > summary.total {
        return Err("error: more than its total".into());
    }
    if summary.keys.len() > MAX_TOP_KEYS {
        return Err(format!("keys: more than {MAX_TOP_KEYS}"));
    }
    let mut prefix = String::with_capacity(rule.len() + 1);
    prefix.push_str(rule);
    prefix.push(KEY_PART_SEPARATOR);
    let mut out = Summary {
        total: summary.total,
        error: summary.error,
        keys: Vec::with_capacity(summary.keys.len()),
    };
    let mut dropped = 0;
    for key in &summary.keys {
        let within = key.key.len() <= MAX_KEY_BYTES
            && key.key.starts_with(&prefix)
            && (1..=summary.total).contains(&key.count)
            && !out.keys.iter().any(|(k, _)| *k == key.key);
        if within {
            out.keys.push((key.key.clone(), key.count));
        } else {
            // Left out, its count goes into the error: every count stays within it.
            dropped += 1;
            out.error = out.error.saturating_add(key.count.min(summary.total));
        }
    }
    if out.keys.iter().map(|(_, c)| c).sum::<u64>() > out.total {
        return Err("keys: their counts add up to more than the total".into());
    }
    out.error = out.error.min(out.total);
    out.truncate(KEYS_PER_KIND);
    Ok((out, dropped))
}

/// The query of `GET /admin/v1/top`, checked.
#[derive(Debug, PartialEq, Eq)]
pub struct Query {
    pub rule: String,
    pub minutes: u64,
    pub limit: usize,
}

impl Query {
    pub fn parse(uri: &Uri) -> Result<Query, AppError> {
        let mut rule = None;
        let mut window = None;
        let mut limit = None;
        for pair in uri
            .query()
            .unwrap_or("")
            .split('&')
            .filter(|p| !p.is_empty())
        {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            let value = percent_decode_str(value)
                .decode_utf8()
                .map_err(|_| AppError::invalid(name.to_string(), "is not UTF-8"))?
                .into_owned();
            let slot = match name {
                "rule" => &mut rule,
                "window" => &mut window,
                "limit" => &mut limit,
                other => {
                    return Err(AppError::invalid(
                        crate::error::loggable(other),
                        "unknown parameter: rule, window and limit are",
                    ))
                }
            };
            if slot.replace(value).is_some() {
                return Err(AppError::invalid(name, "given more than once"));
            }
        }
        let rule = rule.ok_or_else(|| AppError::invalid("rule", "missing: ?rule=NAME"))?;
        crate::validate::target_name("rule", &rule)?;
        let minutes = match window.as_deref() {
            None => 5,
            Some(text) => text
                .strip_suffix('m')
                .and_then(|n| n.parse::<u64>().ok())
                .filter(|n| (1..=WINDOW_MAX_MINUTES).contains(n))
                .ok_or_else(|| {
                    AppError::invalid(
                        "window",
                        format!(
                            "must be whole minutes from 1m to {WINDOW_MAX_MINUTES}m, got {:?}",
                            crate::error::loggable(text)
                        ),
                    )
                })?,
        };
        let limit = match limit.as_deref() {
            None => DEFAULT_LIMIT,
            Some(text) => text
                .parse::<usize>()
                .ok()
                .filter(|n| (1..=KEYS_PER_KIND).contains(n))
                .ok_or_else(|| {
                    AppError::invalid("limit", format!("must be 1 to {KEYS_PER_KIND}"))
                })?,
        };
        Ok(Query {
            rule,
            minutes,
            limit,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_protocol::TopKey;

    fn report(rule: &str, keys: &[(&str, u64)], total: u64, error: u64) -> TopReport {
        TopReport {
            rule: rule.into(),
            admitted: TopSummary::default(),
            denied: TopSummary {
                total,
                error,
                keys: keys
                    .iter()
                    .map(|(k, c)| TopKey {
                        key: format!("{rule}\u{1f}{k}"),
                        count: *c,
                    })
                    .collect(),
            },
        }
    }

    fn message(result: Result<Query, AppError>) -> String {
        result.unwrap_err().to_string()
    }

    fn uri(query: &str) -> Uri {
        format!("/admin/v1/top?{query}").parse().unwrap()
    }

    #[test]
    fn the_query_names_a_rule_and_a_window_of_whole_minutes() {
        assert_eq!(
            Query::parse(&uri("rule=api&window=5m")).unwrap(),
            Query {
                rule: "api".into(),
                minutes: 5,
                limit: DEFAULT_LIMIT
            }
        );
        assert_eq!(
            Query::parse(&uri("rule=api%2Fgold&limit=64")).unwrap().rule,
            "api/gold"
        );
        assert!(message(Query::parse(&uri("window=5m"))).starts_with("rule: missing"));
        assert!(message(Query::parse(&uri("rule=a%20b"))).starts_with("rule: "));
        for window in ["0m", "16m", "5", "5s", "-1m", "99999999999999999999m"] {
            let m = message(Query::parse(&uri(&format!("rule=api&window={window}"))));
            assert!(
                m.starts_with("window: must be whole minutes"),
                "{window}: {m}"
            );
        }
        for limit in ["0", "65", "x"] {
            let m = message(Query::parse(&uri(&format!("rule=api&limit={limit}"))));
            assert!(m.starts_with("limit: "), "{m}");
        }
        assert!(message(Query::parse(&uri("rule=a&rule=b"))).contains("more than once"));
        assert!(message(Query::parse(&uri("rule=a&who=1"))).starts_with("who: unknown"));
    }

    #[test]
    fn reports_out_of_bounds_are_refused_and_bad_keys_dropped_into_the_error() {
        let board = Board::default();
        let now = 1_700_000_000_000;
        let big = report("api", &[("a", 1)], MAX_TOP_COUNT + 1, 0);
        assert!(
            matches!(board.record("c", 0, &big, now), Recorded::Refused(r) if r.starts_with("top[0].denied.total"))
        );
        let wrong = report("api", &[("a", 1)], 5, 6);
        assert!(
            matches!(board.record("c", 1, &wrong, now), Recorded::Refused(r) if r.contains("error"))
        );
        let many: Vec<(String, u64)> = (0..65).map(|i| (format!("k{i}"), 1)).collect();
        let many: Vec<(&str, u64)> = many.iter().map(|(k, c)| (k.as_str(), *c)).collect();
        let flood = report("api", &many, 100, 0);
        assert!(
            matches!(board.record("c", 2, &flood, now), Recorded::Refused(r) if r.contains("keys"))
        );
        let bad_name = report("a b", &[], 1, 0);
        assert!(
            matches!(board.record("c", 3, &bad_name, now), Recorded::Refused(r) if r.starts_with("top[3].rule"))
        );
        // Too long, another rule's, counted more than the total: dropped, their counts in the error.
        let mut mixed = report("api", &[("ok", 5), ("zero", 0)], 10, 1);
        mixed.denied.keys.push(TopKey {
            key: format!("api\u{1f}{}", "x".repeat(MAX_KEY_BYTES)),
            count: 2,
        });
        mixed.denied.keys.push(TopKey {
            key: "other\u{1f}k".into(),
            count: 1,
        });
        mixed.denied.keys.push(TopKey {
            key: "api\u{1f}huge".into(),
            count: u64::MAX,
        });
        assert_eq!(
            board.record("c", 4, &mixed, now),
            Recorded::Kept { dropped: 4 }
        );
        let answer = board.query("api", 1, 20, now);
        // 1 + 0 + 2 + 1 + 10, at most the total.
        assert_eq!(answer["denied"]["error_bound"], 10);
        assert_eq!(
            answer["denied"]["keys"],
            json!([{"key": "api\u{1f}ok", "count": 5, "at_most": 15}])
        );
        let overcounted = report("api", &[("a", 6), ("b", 6)], 10, 0);
        assert!(
            matches!(board.record("c", 5, &overcounted, now), Recorded::Refused(r) if r.contains("add up"))
        );
    }

    #[test]
    fn one_credential_cannot_take_anothers_room_or_keys() {
        let board = Board::default();
        let now = 1_700_000_000_000;
        assert_eq!(
            board.record("good", 0, &report("api", &[("alice", 40)], 50, 0), now),
            Recorded::Kept { dropped: 0 }
        );
        // The attacker floods every minute with as many keys and as big counts as it may...
        let keys: Vec<(String, u64)> = (0..64).map(|i| (format!("evil{i}"), 1 << 34)).collect();
        let keys: Vec<(&str, u64)> = keys.iter().map(|(k, c)| (k.as_str(), *c)).collect();
        for minute in 0..WINDOW_MAX_MINUTES {
            let r = report("api", &keys, MAX_TOP_COUNT, 0);
            board.record("evil", 0, &r, now + minute * MINUTE_MS);
        }
        // ...and as many rules as it may: past its share, nothing is kept.
        let mut kept = 0;
        for i in 0..(MAX_SERIES as u64) {
            let r = report(&format!("r{i}"), &[("x", 1)], 1, 0);
            if board.record("evil", 0, &r, now) != Recorded::Full {
                kept += 1;
            }
        }
        assert_eq!(kept, SERIES_PER_CREDENTIAL - 1, "one rule already taken");
        assert_eq!(
            board.record("other", 0, &report("r0", &[("x", 1)], 1, 0), now),
            Recorded::Kept { dropped: 0 },
            "another credential still has room"
        );
        // The good credential's key is still answered, its count whole, and no count overflowed.
        let answer = board.query("api", 1, 64, now);
        let keys = answer["denied"]["keys"].as_array().unwrap();
        assert_eq!(keys.len(), 64, "the limit");
        assert_eq!(
            keys[63],
            json!({"key": "api\u{1f}alice", "count": 40, "at_most": 40}),
            "listed, last"
        );
        assert_eq!(answer["credentials"], 2);
        let (_, all, _) = board.merged("api", 1, now);
        assert!(
            all.keys.contains(&("api\u{1f}alice".to_string(), 40)),
            "{:?}",
            &all.keys[60..]
        );
        assert_eq!(all.total, MAX_TOP_COUNT + 50);
    }

    /// Of C credentials, each keeps its own top `limit / C` keys in the answer whatever the
    /// others report; the other slots go to the largest counts; below C, all of them do.
    #[test]
    fn each_credential_keeps_its_top_share_of_the_limit() {
        let board = Board::default();
        let now = 1_700_000_000_000;
        let keys = |prefix: &str, n: u64, count: u64| -> Vec<(String, u64)> {
            (0..n)
                .map(|i| (format!("{prefix}{i:02}"), count - i))
                .collect()
        };
        let record = |credential: &str, keys: &[(String, u64)]| {
            let keys: Vec<(&str, u64)> = keys.iter().map(|(k, c)| (k.as_str(), *c)).collect();
            let total = keys.iter().map(|(_, c)| c).sum();
            let kept = board.record(credential, 0, &report("api", &keys, total, 0), now);
            assert_eq!(kept, Recorded::Kept { dropped: 0 });
        };
        // Two liars of 64 keys of about 5,000 and an honest credential of 10 keys of about 100.
        record("liar-1", &keys("x", 64, 5_000));
        record("liar-2", &keys("y", 64, 4_000));
        record("honest", &keys("h", 10, 100));
        let listed = |limit: usize| -> Vec<String> {
            let answer = board.query("api", 1, limit, now);
            let keys = answer["denied"]["keys"].as_array().unwrap().clone();
            keys.iter()
                .map(|k| {
                    k["key"]
                        .as_str()
                        .unwrap()
                        .trim_start_matches("api\u{1f}")
                        .to_owned()
                })
                .collect()
        };
        let has = |listed: &[String], prefix: &str| {
            listed.iter().filter(|k| k.starts_with(prefix)).count()
        };
        // 64 / 3 = 21 each: the honest one's 10, and 21 + 33 of the liars' (the 33 left by count).
        let all = listed(64);
        assert_eq!(all.len(), 64);
        assert_eq!(
            (has(&all, "h"), has(&all, "x"), has(&all, "y")),
            (10, 33, 21)
        );
        // 6 / 3 = 2 each, largest first.
        let six = listed(6);
        assert_eq!(six, ["x00", "x01", "y00", "y01", "h00", "h01"]);
        // Below the credentials, the largest counts.
        assert_eq!(listed(2), ["x00", "x01"]);
        // A key two credentials report is listed once, its counts summed.
        record("honest", &[("x00".to_string(), 7)]);
        let answer = board.query("api", 1, 3, now);
        assert_eq!(answer["denied"]["keys"][0]["count"], 5_007);
    }

    #[test]
    fn a_window_counts_its_minutes_only() {
        let board = Board::default();
        let start = 1_700_000_000_000 / MINUTE_MS * MINUTE_MS;
        board.record("c", 0, &report("api", &[("old", 7)], 7, 0), start);
        board.record(
            "c",
            0,
            &report("api", &[("new", 3)], 3, 0),
            start + 5 * MINUTE_MS,
        );
        let now = start + 5 * MINUTE_MS + 1;
        assert_eq!(board.query("api", 1, 20, now)["denied"]["total"], 3);
        assert_eq!(board.query("api", 5, 20, now)["denied"]["total"], 3);
        assert_eq!(board.query("api", 6, 20, now)["denied"]["total"], 10);
        assert_eq!(board.query("other", 6, 20, now)["denied"]["total"], 0);
        // A pair unheard for the longest window is forgotten.
        board.record("c", 0, &report("b", &[], 1, 0), start + 21 * MINUTE_MS);
        assert_eq!(
            board.query("api", 15, 20, start + 21 * MINUTE_MS)["credentials"],
            0
        );
    }
}
