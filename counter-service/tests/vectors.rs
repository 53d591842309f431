//! The Lua bucket arithmetic (`lua/check.lua`) equals `sluice_core::LimitState::take` bit for bit:
//! hand-checked vectors (`vectors/bucket.json`), then many seeded random cases, each run through
//! a real Redis with a fake clock and through the Rust function.
//!
//! The windows (`lua/window.lua`) decide as `sluice_core`'s `fixed_window` and `sliding_window`:
//! hand-checked steps across calendar boundaries (`vectors/window.json`), then many seeded random
//! traces, each step run through the service's check (`check_handler::decide`, with a fake clock)
//! and through `LimitState::check` / `LimitState::admit`: the same decisions, remaining, retry-after and
//! reset.
//!
//! The leases of cached windows (`lua/sync_window.lua`) say when the window admits one request
//! more than the `remaining` they answer (`token_ms`) as core's `LimitState::check` would on the
//! same counts: hand-checked syncs (`vectors/window.json`'s `leases`), then many seeded random
//! ones, core reading the counts Redis holds after each.
//!
//! The sliding logs (`lua/sliding_log.lua`) decide as `sluice_core`'s (`log.rs`, through a key's
//! record): many seeded random traces, with arrivals at the very microsecond an admitted
//! request stops counting, through the service's check and through core.

mod common;

use redis::Script;
use serde_json::Value;
use sluice_core::limit::table::Record;
use sluice_core::{Algorithm, Limit, LimitState, Period, Verdict};
use sluice_counter_service::scripts::CHECK_LUA;
use sluice_counter_service::{check_handler, keys, sync_handler, validate, AppState};
use sluice_protocol::{CheckRequest, LimitSpec};
use sluice_tests::redis::Redis;

fn limit(requests: u64, period_ms: u64, burst: u64) -> Limit {
    let period = match period_ms {
        1_000 => Period::Second,
        60_000 => Period::Minute,
        3_600_000 => Period::Hour,
        86_400_000 => Period::Day,
        // A duration: any whole number of seconds.
        other if other % 1_000 == 0 => Period::from_seconds(other / 1_000).unwrap(),
        other => panic!("no period of {other} ms in core"),
    };
    Limit::new(requests, period, Some(burst)).unwrap()
}

/// What Redis holds after one check.lua call: (allowed, remaining, tokens, ts).
fn lua_take(
    con: &mut redis::Connection,
    script: &Script,
    key: &str,
    limit: &Limit,
    before: Option<LimitState>,
    now_us: u64,
    cost: u64,
) -> (bool, u64, f64, u64) {
    let _: () = redis::cmd("DEL").arg(key).query(con).unwrap();
    if let Some(bucket) = before {
        let _: () = redis::cmd("HSET")
            .arg(key)
            .arg("tokens")
            .arg(bucket.tokens.to_string())
            .arg("ts")
            .arg(bucket.stamp_us)
            .query(con)
            .unwrap();
    }
    let spec = LimitSpec::from(limit);
    let reply: Vec<i64> = script
        .key(key)
        .arg(now_us)
        .arg(cost)
        .arg(1)
        .arg(spec.requests)
        .arg(spec.period_ms)
        .arg(spec.burst)
        .invoke(con)
        .unwrap();
    let (tokens, ts): (String, u64) = redis::cmd("HMGET")
        .arg(key)
        .arg("tokens")
        .arg("ts")
        .query(con)
        .unwrap();
    (reply[0] == 1, reply[1] as u64, tokens.parse().unwrap(), ts)
}

fn rust_take(
    limit: &Limit,
    before: Option<LimitState>,
    now_us: u64,
    cost: u64,
) -> (bool, u64, f64, u64) {
    let bucket = before.unwrap_or_else(|| LimitState::full(limit, now_us));
    let (verdict, after) = bucket.take(limit, now_us, cost);
    (
        verdict.allowed,
        verdict.remaining,
        after.tokens,
        after.stamp_us,
    )
}

#[test]
fn hand_checked_vectors_hold_in_rust_and_in_lua() {
    let redis = Redis::start().unwrap();
    let mut con = redis::Client::open(redis.url())
        .unwrap()
        .get_connection()
        .unwrap();
    let script = Script::new(CHECK_LUA);
    let file: Value = serde_json::from_str(include_str!("vectors/bucket.json")).unwrap();
    let cases = file["cases"].as_array().unwrap();
    assert!(cases.len() >= 8);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let l = &case["limit"];
        let limit = limit(
            l["requests"].as_u64().unwrap(),
            l["period_ms"].as_u64().unwrap(),
            l["burst"].as_u64().unwrap(),
        );
        let before = case["before"].as_object().map(|b| LimitState {
            tokens: b["tokens"].as_f64().unwrap(),
            stamp_us: b["ts"].as_u64().unwrap(),
        });
        let now = case["now_us"].as_u64().unwrap();
        let cost = case["cost"].as_u64().unwrap();
        let a = &case["after"];
        let expected = (
            a["allowed"].as_bool().unwrap(),
            a["remaining"].as_u64().unwrap(),
            a["tokens"].as_f64().unwrap(),
            a["ts"].as_u64().unwrap(),
        );
        assert_eq!(
            rust_take(&limit, before, now, cost),
            expected,
            "Rust: {name}"
        );
        let lua = lua_take(
            &mut con,
            &script,
            "sluice:vector",
            &limit,
            before,
            now,
            cost,
        );
        assert_eq!(lua, expected, "Lua: {name}");
    }
}

/// splitmix64: a seeded generator, so a failure replays.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[test]
fn random_cases_agree_bit_for_bit() {
    let redis = Redis::start().unwrap();
    let mut con = redis::Client::open(redis.url())
        .unwrap()
        .get_connection()
        .unwrap();
    let script = Script::new(CHECK_LUA);
    let seed = 0x5eed_0001;
    let mut rng = Rng(seed);
    // The named periods, and durations: 10 s, 7 min (which divides no day), 15 min, 6 h, 2 days.
    let periods = [
        1_000,
        60_000,
        3_600_000,
        86_400_000,
        10_000,
        420_000,
        900_000,
        21_600_000,
        172_800_000,
    ];
    for case in 0..3_000 {
        let requests = match rng.below(4) {
            0 => 1 + rng.below(3),
            1 => 1 + rng.below(1_000),
            2 => 1 + rng.below(1 << 31),
            _ => [7, 13, 333, 1_000_003][rng.below(4) as usize],
        };
        let burst_range = if rng.below(2) == 0 { 100 } else { 1 << 31 };
        let burst = 1 + rng.below(burst_range);
        let period_ms = periods[rng.below(periods.len() as u64) as usize];
        let limit = limit(requests, period_ms, burst);
        let ts = 1_700_000_000_000_000 + rng.below(10_000_000_000);
        let before = match rng.below(10) {
            0 => None,
            _ => Some(LimitState {
                // any double in [-burst, burst], fractions with every bit
                tokens: (rng.unit() * 2.0 - 1.0) * burst as f64,
                stamp_us: ts,
            }),
        };
        let now = match rng.below(8) {
            0 => ts - rng.below(1_000_000), // the clock went backwards
            1 => ts,
            _ => ts + rng.below(2 * period_ms * 1_000),
        };
        let cost = rng.below(6);
        let rust = rust_take(&limit, before, now, cost);
        let lua = lua_take(
            &mut con,
            &script,
            "sluice:random",
            &limit,
            before,
            now,
            cost,
        );
        assert!(
            rust.0 == lua.0 && rust.1 == lua.1 && rust.2 == lua.2 && rust.3 == lua.3,
            "case {case} (seed {seed:#x}): {limit:?} before {before:?} now {now} cost {cost}: \
             Rust {rust:?} Lua {lua:?}"
        );
        assert_eq!(
            rust.2.to_bits(),
            lua.2.to_bits(),
            "case {case}: the same bits"
        );
    }
}

/// A vector's `per` as a configuration writes it: a name, a duration, or a number of seconds.
fn period(per: &Value) -> Period {
    match per.as_u64() {
        Some(seconds) => Period::from_seconds(seconds).unwrap(),
        None => Period::parse(per.as_str().unwrap()).unwrap(),
    }
}

/// One decision as the service answers it: (allowed, remaining, retry_after_ms, reset_ms).
type Answer = (bool, u64, u64, u64);

/// The windows of one key in core, decided as the filter's limiter decides a rule's limits:
/// all are checked, and all count the request only if all admit it; the limit that speaks is
/// the one with the fewest left (admitted) or the longest wait (denied).
struct CoreKey {
    limits: Vec<Limit>,
    record: Option<Record>,
}

impl CoreKey {
    fn new(limits: Vec<Limit>) -> CoreKey {
        CoreKey {
            limits,
            record: None,
        }
    }

    fn decide(&mut self, now_us: u64, cost: u64) -> Answer {
        let limits = &self.limits;
        let record = self
            .record
            .get_or_insert_with(|| Record::fresh(1, limits, now_us));
        let mut verdicts: Vec<Verdict> = record
            .states(limits)
            .map(|(limit, mut state)| state.check(limit, now_us, cost))
            .collect();
        let allowed = verdicts.iter().all(|v| v.allowed);
        if allowed {
            for (i, (limit, mut state)) in record.states(limits).enumerate() {
                verdicts[i] = state.admit(limit, now_us, cost);
            }
        }
        let mut chosen: Option<Verdict> = None;
        for verdict in &verdicts {
            let tighter = match chosen {
                None => true,
                Some(c) if allowed => verdict.remaining < c.remaining,
                Some(c) => !verdict.allowed && verdict.retry_after_us > c.retry_after_us,
            };
            if tighter && (allowed || !verdict.allowed) {
                chosen = Some(*verdict);
            }
        }
        let v = chosen.expect("a limit speaks");
        (
            allowed,
            v.remaining,
            v.retry_after_us.div_ceil(1_000),
            v.reset_us.div_ceil(1_000),
        )
    }
}

/// The service's strict check of one key at a fake time, validated as a request would be. A
/// cost above the smallest burst is refused before any script runs (400 naming `cost`, as the
/// configuration refuses such a rule): that refusal is checked, and there is no answer (`None`)
/// to compare; the script never sees such a request.
fn service_decide(
    runtime: &tokio::runtime::Runtime,
    state: &AppState,
    key: &str,
    limits: &[Limit],
    now_us: u64,
    cost: u64,
) -> Option<Answer> {
    let request = CheckRequest {
        key: key.to_owned(),
        limits: limits.iter().map(LimitSpec::from).collect(),
        cost,
        penalty_ms: 0,
        proxy: None,
    };
    let least = limits.iter().map(Limit::burst).min().unwrap_or(0);
    match validate::check_request(&request, &state.settings) {
        Err(e) if cost > least => {
            assert!(
                e.to_string().starts_with("cost: "),
                "{request:?} refused for another reason: {e}"
            );
            return None;
        }
        Err(e) => panic!("{request:?} refused: {e}"),
        Ok(()) => assert!(
            cost <= least,
            "{request:?} accepted above the smallest burst"
        ),
    }
    let answer = runtime
        .block_on(check_handler::decide(state, &request, None, now_us))
        .unwrap();
    Some((
        answer.allowed,
        answer.remaining,
        answer.retry_after_ms,
        answer.reset_ms,
    ))
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn hand_checked_window_steps_hold_in_rust_and_in_lua() {
    let redis = Redis::start().unwrap();
    let runtime = runtime();
    let state = runtime.block_on(async { common::state(&redis.url()) });
    let file: Value = serde_json::from_str(include_str!("vectors/window.json")).unwrap();
    let cases = file["cases"].as_array().unwrap();
    assert!(cases.len() >= 6);
    for (n, case) in cases.iter().enumerate() {
        let name = case["name"].as_str().unwrap();
        let limits: Vec<Limit> = case["limits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| {
                Limit::windowed(
                    l["requests"].as_u64().unwrap(),
                    period(&l["per"]),
                    Algorithm::parse(l["algorithm"].as_str().unwrap()).unwrap(),
                )
                .unwrap()
            })
            .collect();
        let mut core = CoreKey::new(limits.clone());
        let steps = case["steps"].as_array().unwrap();
        // a cost above the smallest burst is refused before the script (service_decide: None)
        let lua: Vec<Option<Answer>> = common::within_shortest_expiry(|attempt| {
            let key = format!("hand:{n}:{attempt}");
            steps
                .iter()
                .map(|step| {
                    let now = step["now_us"].as_u64().unwrap();
                    let cost = step["cost"].as_u64().unwrap();
                    service_decide(&runtime, &state, &key, &limits, now, cost)
                })
                .collect()
        });
        for (i, (step, lua)) in steps.iter().zip(lua).enumerate() {
            let now = step["now_us"].as_u64().unwrap();
            let cost = step["cost"].as_u64().unwrap();
            let expected = (
                step["allowed"].as_bool().unwrap(),
                step["remaining"].as_u64().unwrap(),
                step["retry_after_ms"].as_u64().unwrap(),
                step["reset_ms"].as_u64().unwrap(),
            );
            assert_eq!(core.decide(now, cost), expected, "Rust: {name}, step {i}");
            if let Some(lua) = lua {
                assert_eq!(lua, expected, "Lua: {name}, step {i}");
            }
        }
    }
}

/// Durations (`"per": "10s"`, `"7m"`, `"15m"`, `"6h"`, `"2d"`), windows aligned to the epoch: 7
/// minutes divides no day, and 2 days turns on every other midnight.
const DURATIONS: [Period; 5] = [
    Period::Every(10),
    Period::Every(420),
    Period::Every(900),
    Period::Every(21_600),
    Period::Every(172_800),
];

/// Instants where windows turn (UTC): the ends of months (February 2028 has 29 days), Mondays
/// 00:00, Dec 31 and Jan 1.
const BOUNDARIES: [u64; 8] = [
    1_832_976_000_000_000, // 2028-02-01 00:00, after Jan 31
    1_835_481_600_000_000, // 2028-03-01 00:00, after Feb 29
    1_835_395_200_000_000, // 2028-02-29 00:00
    1_830_297_600_000_000, // 2028-01-01 00:00, after Dec 31 2027
    1_830_470_400_000_000, // 2028-01-03 00:00, a Monday
    1_796_083_200_000_000, // 2026-12-01 00:00, a Tuesday after a month of 30 days
    1_893_456_000_000_000, // 2030-01-01 00:00, a Tuesday
    1_798_761_600_000_000, // 2027-01-01 00:00, a Friday
];

#[test]
fn random_window_traces_decide_alike_in_rust_and_in_lua() {
    let redis = Redis::start().unwrap();
    let runtime = runtime();
    let state = runtime.block_on(async { common::state(&redis.url()) });
    let seed = 0x5eed_0002;
    let mut rng = Rng(seed);
    let fixed = [
        Period::Second,
        Period::Minute,
        Period::Hour,
        Period::Day,
        Period::Week,
        Period::Month,
        DURATIONS[0],
        DURATIONS[1],
        DURATIONS[2],
        DURATIONS[3],
        DURATIONS[4],
    ];
    let sliding = [
        Period::Second,
        Period::Minute,
        Period::Hour,
        Period::Day,
        DURATIONS[0],
        DURATIONS[1],
        DURATIONS[2],
        DURATIONS[3],
        DURATIONS[4],
    ];
    const TRACES: usize = 2_000;
    let mut steps = 0;
    let mut denied = 0;
    let mut unjudged = 0;
    let mut per_kind = std::collections::BTreeMap::<String, usize>::new();
    for trace in 0..TRACES {
        let algorithm = if trace % 2 == 0 {
            Algorithm::FixedWindow
        } else {
            Algorithm::SlidingWindow
        };
        let periods: &[Period] = if algorithm == Algorithm::FixedWindow {
            &fixed
        } else {
            &sliding
        };
        let count = match rng.below(10) {
            0..=6 => 1,
            7 | 8 => 2,
            _ => 3,
        };
        let limits: Vec<Limit> = (0..count)
            .map(|_| {
                let period = periods[rng.below(periods.len() as u64) as usize];
                let most = (period.micros() / 2 - 1).min(1 << 31);
                let requests = match rng.below(8) {
                    0..=3 => 1 + rng.below(4),
                    4 | 5 => 1 + rng.below(30),
                    6 => 1 + rng.below(1_000),
                    _ => 1 + rng.below(most),
                };
                Limit::windowed(requests, period, algorithm).unwrap()
            })
            .collect();
        for limit in &limits {
            *per_kind
                .entry(format!("{} {}", algorithm.name(), limit.period()))
                .or_default() += 1;
        }
        let first = limits[0];
        let length = first.period().micros();
        let mut now = match rng.below(3) {
            // near a calendar boundary, a few windows of the first limit before it
            0 | 1 => {
                let boundary = BOUNDARIES[rng.below(BOUNDARIES.len() as u64) as usize];
                boundary - rng.below(3 * length.min(40 * 86_400_000_000)).min(boundary)
            }
            // anywhere from 2024 to 2030
            _ => 1_704_067_200_000_000 + rng.below(7 * 365 * 86_400_000_000),
        };
        let mut core = CoreKey::new(limits.clone());
        let mut key = format!("trace:{trace}");
        let mut clock = common::RedisClock::new();
        for step in 0..(10 + rng.below(40)) {
            // Mostly 1, as the filter sends; sometimes more, up to past the smallest limit (a
            // request that never fits: a wait of a few windows, well within the 2^53 us that
            // both sides count exactly).
            let least = limits.iter().map(Limit::requests).min().unwrap();
            let cost = match rng.below(10) {
                0 => 1 + rng.below(3),
                1 if step > 0 => 1 + rng.below(least + 2),
                _ => 1,
            };
            let answer = core.decide(now, cost);
            if let Some(lua) = service_decide(&runtime, &state, &key, &limits, now, cost) {
                if clock.judged() {
                    assert_eq!(
                        lua, answer,
                        "trace {trace} step {step} (seed {seed:#x}): {limits:?} at {now} cost \
                         {cost}: Lua {lua:?}, Rust {answer:?}"
                    );
                } else {
                    core = CoreKey::new(limits.clone());
                    key = format!("trace:{trace}:{}", clock.segment());
                }
            }
            steps += 1;
            denied += usize::from(!answer.0);
            // the next arrival: at once, soon, at about the limit's pace, across the end of the
            // window, or windows later
            let end = sluice_core::limit::calendar::end_us(first.period(), now);
            now = match rng.below(8) {
                0 => now,
                1 => now + rng.below(1_000),
                2 | 3 => now + rng.below(length / first.requests() + 1),
                4 => end - 1 - rng.below(3).min(end - 1 - now),
                5 => end + rng.below(3),
                6 => now + rng.below(length),
                _ => now + rng.below(3 * length),
            };
        }
        unjudged += clock.unjudged();
    }
    eprintln!(
        "{TRACES} traces, {steps} steps ({denied} denied, {unjudged} not judged: slower than a \
         key's shortest life) agree; limits per kind: {per_kind:?}"
    );
    assert!(
        steps >= 10 * TRACES && denied >= steps / 10 && unjudged * 100 <= steps,
        "{steps} steps, {denied} denied, {unjudged} not judged"
    );
    assert!(
        per_kind.len() == fixed.len() + sliding.len(),
        "every period of both windows: {per_kind:?}"
    );
}

#[test]
fn random_sliding_log_traces_decide_alike_in_rust_and_in_lua() {
    let redis = Redis::start().unwrap();
    let runtime = runtime();
    let state = runtime.block_on(async { common::state(&redis.url()) });
    let seed = 0x5eed_0003;
    let mut rng = Rng(seed);
    let periods = [
        Period::Second,
        Period::Minute,
        Period::Hour,
        Period::Day,
        DURATIONS[0],
        DURATIONS[1],
        DURATIONS[2],
        DURATIONS[3],
        DURATIONS[4],
    ];
    const TRACES: usize = 600;
    let (mut steps, mut denied, mut at_expiry, mut unjudged) = (0, 0, 0, 0);
    for trace in 0..TRACES {
        let count = match rng.below(10) {
            0..=6 => 1,
            7 | 8 => 2,
            _ => 3,
        };
        let limits: Vec<Limit> = (0..count)
            .map(|_| {
                let period = periods[rng.below(periods.len() as u64) as usize];
                let requests = match rng.below(8) {
                    0..=4 => 1 + rng.below(5),
                    5 | 6 => 1 + rng.below(30),
                    _ => 1 + rng.below(sluice_core::limit::MAX_LOG),
                };
                Limit::logged(requests, period).unwrap()
            })
            .collect();
        let first = limits[0];
        let length = first.period().micros();
        let mut now = 1_704_067_200_000_000 + rng.below(7 * 365 * 86_400_000_000);
        let mut core = CoreKey::new(limits.clone());
        let mut admitted: Vec<u64> = Vec::new();
        let mut key = format!("log:{trace}");
        let mut clock = common::RedisClock::new();
        for step in 0..(10 + rng.below(60)) {
            let least = limits.iter().map(Limit::requests).min().unwrap();
            let cost = match rng.below(10) {
                0 => 1 + rng.below(3),
                1 if step > 0 => 1 + rng.below(least + 2),
                _ => 1,
            };
            let answer = core.decide(now, cost);
            let mut fresh = false;
            if let Some(lua) = service_decide(&runtime, &state, &key, &limits, now, cost) {
                if clock.judged() {
                    assert_eq!(
                        lua, answer,
                        "trace {trace} step {step} (seed {seed:#x}): {limits:?} at {now} cost \
                         {cost}: Lua {lua:?}, Rust {answer:?}"
                    );
                } else {
                    fresh = true;
                    core = CoreKey::new(limits.clone());
                    admitted.clear();
                    key = format!("log:{trace}:{}", clock.segment());
                }
            }
            steps += 1;
            denied += usize::from(!answer.0);
            if answer.0 && !fresh {
                admitted.extend(std::iter::repeat_n(now, cost as usize));
            }
            // the next arrival: at once, soon, at about the limit's pace, at the microsecond an
            // admitted request stops counting (or one before), or periods later
            now = match rng.below(8) {
                0 => now,
                1 => now + rng.below(1_000),
                2 | 3 => now + rng.below(length / first.requests() + 1),
                4 | 5 if !admitted.is_empty() => {
                    let some = admitted[rng.below(admitted.len() as u64) as usize];
                    let expiry = some + length - rng.below(2);
                    at_expiry += 1;
                    expiry.max(now)
                }
                6 => now + rng.below(length),
                _ => now + rng.below(3 * length),
            };
        }
        unjudged += clock.unjudged();
    }
    eprintln!(
        "{TRACES} traces, {steps} steps ({denied} denied, {at_expiry} at an expiry, {unjudged} \
         not judged: slower than a key's shortest life) agree"
    );
    assert!(
        steps >= 10 * TRACES
            && denied >= steps / 10
            && at_expiry >= steps / 10
            && unjudged * 100 <= steps,
        "{steps} steps, {denied} denied, {at_expiry} at an expiry, {unjudged} not judged"
    );
}

/// The windows of one entry key as `lua/sync_window.lua` left them on Redis, read into core's
/// state (`sluice_core::limit::algorithm`'s layout: a fixed window's count and start; a sliding
/// window's current count, and its previous count and window number packed). `None` when a
/// sliding window's previous count is not whole: the script caps a count at what one report may
/// count (`requests x (1 + report_window_ms / period_ms)`, a fraction), which core's layout,
/// made for whole requests, cannot hold.
fn stored_windows(redis: &Redis, key: &str, limits: &[Limit]) -> Option<Vec<LimitState>> {
    let number = |field: Option<String>| -> f64 { field.map_or(0.0, |v| v.parse().unwrap()) };
    limits
        .iter()
        .map(|limit| {
            let redis_key = keys::limit_key(key, &LimitSpec::from(limit));
            let field = |name: &str| {
                redis
                    .query(&["HGET", &redis_key, name])
                    .unwrap()
                    .text()
                    .map(str::to_owned)
            };
            if limit.algorithm() == Algorithm::SlidingWindow {
                let previous = number(field("p"));
                let window = number(field("w")) as u64;
                (previous.fract() == 0.0).then(|| LimitState {
                    tokens: number(field("c")),
                    stamp_us: ((previous as u64) << 32) | (window & 0xffff_ffff),
                })
            } else {
                Some(LimitState {
                    tokens: number(field("n")),
                    stamp_us: number(field("w")) as u64,
                })
            }
        })
        .collect()
}

/// Core's wait for one request more than `remaining` on windows in `states` at `now_us` (ms):
/// each window charged `remaining`, then `LimitState::check` of a request of cost 1.
fn core_token_ms(limits: &[Limit], states: &[LimitState], remaining: u64, now_us: u64) -> u64 {
    limits
        .iter()
        .zip(states)
        .map(|(limit, state)| {
            let charged = state.charge(limit, now_us, remaining);
            charged
                .check(limit, now_us, 1)
                .0
                .retry_after_us
                .div_ceil(1_000)
        })
        .max()
        .unwrap_or(0)
}

fn window_limits(specs: &Value) -> Vec<Limit> {
    specs
        .as_array()
        .unwrap()
        .iter()
        .map(|l| {
            Limit::windowed(
                l["requests"].as_u64().unwrap(),
                period(&l["per"]),
                Algorithm::parse(l["algorithm"].as_str().unwrap()).unwrap(),
            )
            .unwrap()
        })
        .collect()
}

/// A cached window's grant says when the window admits one more than its `remaining`
/// (`token_ms`): by hand, and in core from the counts Redis holds.
#[test]
fn hand_checked_window_leases_hold_in_rust_and_in_lua() {
    let redis = Redis::start().unwrap();
    let runtime = runtime();
    let state = runtime.block_on(async { common::state(&redis.url()) });
    let file: Value = serde_json::from_str(include_str!("vectors/window.json")).unwrap();
    let cases = file["leases"].as_array().unwrap();
    assert!(cases.len() >= 4);
    for (n, case) in cases.iter().enumerate() {
        let name = case["name"].as_str().unwrap();
        let limits = window_limits(&case["limits"]);
        let syncs = case["syncs"].as_array().unwrap();
        // each grant, and the windows Redis holds after it
        let answers: Vec<_> = common::within_shortest_expiry(|attempt| {
            let key = format!("lease:{n}:{attempt}");
            syncs
                .iter()
                .map(|sync| {
                    let request = common::batch(
                        "a",
                        100,
                        vec![common::entry(
                            &key,
                            &limits.iter().map(LimitSpec::from).collect::<Vec<_>>(),
                            sync["spent"].as_u64().unwrap(),
                            sync["denied"].as_u64().unwrap(),
                        )],
                    );
                    let now = sync["now_us"].as_u64().unwrap();
                    let grants = runtime
                        .block_on(sync_handler::apply(&state, &request, now))
                        .unwrap();
                    (grants, stored_windows(&redis, &key, &limits).unwrap())
                })
                .collect()
        });
        for (i, (sync, (grants, states))) in syncs.iter().zip(answers).enumerate() {
            let now = sync["now_us"].as_u64().unwrap();
            let expected = (
                sync["remaining"].as_u64().unwrap(),
                sync["reset_ms"].as_u64().unwrap(),
                Some(sync["token_ms"].as_u64().unwrap()),
            );
            let grant = &grants[0];
            assert_eq!(
                (grant.remaining, grant.reset_ms, grant.token_ms),
                expected,
                "Lua: {name}, sync {i}: {grant:?}"
            );
            assert_eq!(
                Some(core_token_ms(&limits, &states, grant.remaining, now)),
                expected.2,
                "Rust: {name}, sync {i}: {states:?}"
            );
        }
    }
}

/// Random syncs of three proxies on cached windows (one to three limits, fixed or sliding, any
/// period, reports of any size, arrivals across window ends): every grant's `token_ms` is core's
/// wait for one request more than its `remaining` on the counts Redis holds after it.
#[test]
fn random_window_leases_agree_with_core() {
    let redis = Redis::start().unwrap();
    let runtime = runtime();
    let state = runtime.block_on(async { common::state(&redis.url()) });
    let seed = 0x5eed_0004;
    let mut rng = Rng(seed);
    let fixed = [
        Period::Second,
        Period::Minute,
        Period::Hour,
        Period::Day,
        Period::Week,
        Period::Month,
        DURATIONS[0],
        DURATIONS[1],
        DURATIONS[2],
        DURATIONS[3],
        DURATIONS[4],
    ];
    let sliding = [
        Period::Second,
        Period::Minute,
        Period::Hour,
        Period::Day,
        DURATIONS[0],
        DURATIONS[1],
        DURATIONS[2],
        DURATIONS[3],
        DURATIONS[4],
    ];
    const TRACES: usize = 400;
    let (mut syncs, mut waits, mut later, mut capped) = (0, 0, 0, 0);
    for trace in 0..TRACES {
        let algorithm = if trace % 2 == 0 {
            Algorithm::FixedWindow
        } else {
            Algorithm::SlidingWindow
        };
        let periods: &[Period] = if algorithm == Algorithm::FixedWindow {
            &fixed
        } else {
            &sliding
        };
        let count = 1 + rng.below(3) as usize;
        let limits: Vec<Limit> = (0..count)
            .map(|_| {
                let period = periods[rng.below(periods.len() as u64) as usize];
                let requests = match rng.below(4) {
                    0 | 1 => 1 + rng.below(10),
                    2 => 1 + rng.below(100),
                    _ => 1 + rng.below(10_000),
                };
                Limit::windowed(requests, period, algorithm).unwrap()
            })
            .collect();
        let specs: Vec<LimitSpec> = limits.iter().map(LimitSpec::from).collect();
        let first = limits[0];
        let length = first.period().micros();
        let mut now = 1_704_067_200_000_000 + rng.below(7 * 365 * 86_400_000_000);
        let key = format!("leases:{trace}");
        for _ in 0..(5 + rng.below(20)) {
            let proxy = ["a", "b", "c"][rng.below(3) as usize];
            let least = limits.iter().map(Limit::requests).min().unwrap();
            let spent = match rng.below(4) {
                0 => 0,
                1 => 1,
                _ => rng.below(least / 2 + 2),
            };
            let request = common::batch(
                proxy,
                100,
                vec![common::entry(&key, &specs, spent, rng.below(3))],
            );
            let grants = runtime
                .block_on(sync_handler::apply(&state, &request, now))
                .unwrap();
            let grant = &grants[0];
            syncs += 1;
            let Some(states) = stored_windows(&redis, &key, &limits) else {
                capped += 1;
                continue;
            };
            let core = core_token_ms(&limits, &states, grant.remaining, now);
            assert_eq!(
                grant.token_ms,
                Some(core),
                "trace {trace} (seed {seed:#x}): {limits:?} at {now}, {proxy} spent {spent}: \
                 {grant:?}, core's state {states:?}"
            );
            waits += usize::from(core > 0);
            later += usize::from(core > 0 && core < grant.reset_ms);
            let end = sluice_core::limit::calendar::end_us(first.period(), now);
            now = match rng.below(6) {
                0 => now + rng.below(1_000),
                1 | 2 => now + rng.below(length / first.requests() + 1),
                3 => end + rng.below(3),
                4 => now + rng.below(length),
                _ => now + rng.below(3 * length),
            };
        }
    }
    eprintln!(
        "{TRACES} traces, {syncs} syncs ({waits} with a wait, {later} sooner than reset, \
         {capped} at a fractional cap)"
    );
    assert!(
        waits >= syncs / 4 && later >= syncs / 20 && capped <= syncs / 10,
        "{syncs} syncs, {waits} with a wait, {later} sooner than the reset, {capped} capped"
    );
}

/// A rule's penalty as core's limiter keeps it: one local rule of `limits` (in the
/// configuration's syntax) and `penalty` seconds, each request decided at `now_us` as
/// (allowed, remaining, retry_after_ms, reset_ms).
struct CorePenalty {
    limiter: sluice_core::Limiter,
    store: sluice_core::MemoryStore,
}

impl CorePenalty {
    fn new(limits: &Value, penalty: u64) -> CorePenalty {
        let json = serde_json::json!({"rules": [{"name": "p", "key": ["const:k"],
            "penalty": penalty, "limits": limits}]});
        let policy = sluice_core::parse(json.to_string().as_bytes()).unwrap();
        CorePenalty {
            limiter: sluice_core::Limiter::new(policy),
            store: sluice_core::MemoryStore::default(),
        }
    }

    fn decide(&mut self, now_us: u64) -> Answer {
        let conditions = sluice_core::limiter::Conditions {
            now_us,
            service_up: true,
            service_back_us: 0,
            load: Default::default(),
        };
        let evaluation = self.limiter.decide(
            &mut sluice_core::PlainRequest::get("/"),
            conditions,
            &mut self.store,
        );
        match evaluation.decision {
            sluice_core::Decision::Allow {
                quota: Some((_, quota)),
            } => (true, quota.remaining, 0, quota.reset_us.div_ceil(1_000)),
            sluice_core::Decision::Deny {
                quota,
                retry_after_us,
                ..
            } => (
                false,
                quota.remaining,
                retry_after_us.div_ceil(1_000),
                quota.reset_us.div_ceil(1_000),
            ),
            other => panic!("{other:?}"),
        }
    }
}

/// The service's strict check of one key with a penalty, at a fake time.
fn service_penalized(
    runtime: &tokio::runtime::Runtime,
    state: &AppState,
    key: &str,
    limits: &[LimitSpec],
    penalty_ms: u64,
    now_us: u64,
) -> Answer {
    let request = CheckRequest {
        key: key.to_owned(),
        limits: limits.to_vec(),
        cost: 1,
        penalty_ms,
        proxy: None,
    };
    validate::check_request(&request, &state.settings)
        .unwrap_or_else(|e| panic!("{request:?} refused: {e}"));
    let answer = runtime
        .block_on(check_handler::decide(state, &request, None, now_us))
        .unwrap();
    (
        answer.allowed,
        answer.remaining,
        answer.retry_after_ms,
        answer.reset_ms,
    )
}

/// The limits of a policy as the wire carries them.
fn wire_limits(limits: &Value) -> Vec<LimitSpec> {
    let json = serde_json::json!({"rules": [{"name": "p", "key": ["const:k"], "limits": limits}]});
    let policy = sluice_core::parse(json.to_string().as_bytes()).unwrap();
    policy.rules[0].limits.iter().map(LimitSpec::from).collect()
}

#[test]
fn hand_checked_penalty_steps_hold_in_rust_and_in_lua() {
    let redis = Redis::start().unwrap();
    let runtime = runtime();
    let state = runtime.block_on(async { common::state(&redis.url()) });
    let file: Value = serde_json::from_str(include_str!("vectors/penalty.json")).unwrap();
    let cases = file["cases"].as_array().unwrap();
    assert!(cases.len() >= 3);
    for (n, case) in cases.iter().enumerate() {
        let name = case["name"].as_str().unwrap();
        let penalty = case["penalty"].as_u64().unwrap();
        let mut core = CorePenalty::new(&case["limits"], penalty);
        let limits = wire_limits(&case["limits"]);
        let steps = case["steps"].as_array().unwrap();
        let lua: Vec<Answer> = common::within_shortest_expiry(|attempt| {
            let key = format!("penalty:{n}:{attempt}");
            steps
                .iter()
                .map(|step| {
                    let now = step["now_us"].as_u64().unwrap();
                    service_penalized(&runtime, &state, &key, &limits, penalty * 1_000, now)
                })
                .collect()
        });
        for (i, (step, lua)) in steps.iter().zip(lua).enumerate() {
            let now = step["now_us"].as_u64().unwrap();
            let expected = (
                step["allowed"].as_bool().unwrap(),
                step["remaining"].as_u64().unwrap(),
                step["retry_after_ms"].as_u64().unwrap(),
                step["reset_ms"].as_u64().unwrap(),
            );
            assert_eq!(core.decide(now), expected, "Rust: {name}, step {i}");
            assert_eq!(lua, expected, "Lua: {name}, step {i}");
        }
    }
}

/// Seeded random traces of keys with a penalty, for each algorithm the service decides: the
/// same decisions, waits and resets in core and in Lua, arrivals now and then at the very
/// microsecond a penalty ends.
#[test]
fn random_penalty_traces_decide_alike_in_rust_and_in_lua() {
    let redis = Redis::start().unwrap();
    let runtime = runtime();
    let state = runtime.block_on(async { common::state(&redis.url()) });
    let mut rng = Rng(0x5eed_0009);
    let mut denials = 0;
    let mut penalized = 0;
    let mut unjudged = 0;
    for trace in 0..24 {
        let requests = 1 + rng.below(4);
        let (per, seconds) = [("second", 1), ("minute", 60), ("10s", 10)][rng.below(3) as usize];
        let limits = match trace % 3 {
            0 => serde_json::json!([{"requests": requests, "per": per, "burst": 1 + rng.below(4)}]),
            1 => {
                serde_json::json!([{"requests": requests, "per": per, "algorithm": "fixed_window"}])
            }
            _ => {
                serde_json::json!([{"requests": requests, "per": per, "algorithm": "sliding_log"}])
            }
        };
        let penalty = 1 + rng.below(3 * seconds);
        let mut core = CorePenalty::new(&limits, penalty);
        let wire = wire_limits(&limits);
        let mut key = format!("penalty-random:{trace}");
        let mut clock = common::RedisClock::new();
        let mut now = 1_700_000_000_000_000 + rng.below(86_400_000_000);
        let mut ends = 0;
        for step in 0..40 {
            now += match rng.below(5) {
                0 => 0,
                1 if ends > now => ends - now,
                _ => rng.below(seconds * 1_000_000 / requests),
            };
            let rust = core.decide(now);
            let lua = service_penalized(&runtime, &state, &key, &wire, penalty * 1_000, now);
            if !clock.judged() {
                core = CorePenalty::new(&limits, penalty);
                key = format!("penalty-random:{trace}:{}", clock.segment());
                ends = 0;
                continue;
            }
            assert_eq!(
                rust, lua,
                "trace {trace} ({limits}, penalty {penalty}), step {step}"
            );
            if !rust.0 {
                denials += 1;
                if rust.2 >= penalty * 1_000 {
                    ends = now + penalty * 1_000_000;
                } else {
                    penalized += 1;
                }
            }
        }
        unjudged += clock.unjudged();
    }
    assert!(
        denials > 50 && penalized > 20 && unjudged <= 10,
        "{denials} denials, {penalized} in a penalty, {unjudged} steps not judged"
    );
}
