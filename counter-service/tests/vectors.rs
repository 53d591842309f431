//! The Lua bucket arithmetic (`lua/check.lua`) equals `sluice_core::Bucket::take` bit for bit:
//! hand-checked vectors (`vectors/bucket.json`), then many seeded random cases, each run through
//! a real Redis with a fake clock and through the Rust function.

use redis::Script;
use serde_json::Value;
use sluice_core::{Bucket, Limit, Period};
use sluice_counter_service::scripts::CHECK_LUA;
use sluice_tests::redis::Redis;

fn limit(requests: u64, period_ms: u64, burst: u64) -> Limit {
    let period = match period_ms {
        1_000 => Period::Second,
        60_000 => Period::Minute,
        3_600_000 => Period::Hour,
        86_400_000 => Period::Day,
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
    before: Option<Bucket>,
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
    let spec = sluice_protocol::LimitSpec::from(limit);
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
    before: Option<Bucket>,
    now_us: u64,
    cost: u64,
) -> (bool, u64, f64, u64) {
    let bucket = before.unwrap_or_else(|| Bucket::full(limit, now_us));
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
        let before = case["before"].as_object().map(|b| Bucket {
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
    let periods = [1_000, 60_000, 3_600_000, 86_400_000];
    for case in 0..3_000 {
        let requests = match rng.below(4) {
            0 => 1 + rng.below(3),
            1 => 1 + rng.below(1_000),
            2 => 1 + rng.below(1 << 31),
            _ => [7, 13, 333, 1_000_003][rng.below(4) as usize],
        };
        let burst_range = if rng.below(2) == 0 { 100 } else { 1 << 31 };
        let burst = 1 + rng.below(burst_range);
        let period_ms = periods[rng.below(4) as usize];
        let limit = limit(requests, period_ms, burst);
        let ts = 1_700_000_000_000_000 + rng.below(10_000_000_000);
        let before = match rng.below(10) {
            0 => None,
            _ => Some(Bucket {
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
