//! Redis's time per call of the strict check script (`lua/prelude.lua` + `lua/check.lua`, as the
//! service loads it) in isolation, against `lua/token_bucket.lua`: a real `redis-server` on
//! loopback, one connection, `EVALSHA` on scripts loaded once, and `INFO commandstats`
//! (`cmdstat_evalsha`, usec per call) and `INFO cpu` (the whole server's CPU time, network reads
//! and writes included) read before and after each batch. The cases run
//! interleaved, round after round, so a busy machine slows them alike; the medians are printed.
//!
//! Cases: `check.lua` on one key with 0, 1 and 4 other proxies' leases (an `l:<proxy>` field each,
//! lease and round, as `sync.lua` writes them, or a baseline's layout; and 4 leases as text
//! without rounds, as written before rounds), `check.lua` on
//! a new key each call (as keys seen less than once a second are), and `token_bucket.lua` on one key and on a new key each
//! call, and a script making `check.lua`'s four Redis calls without its Lua. With `--baseline FILE`, the same `check.lua` cases also run with FILE in place of
//! `lua/check.lua` (e.g. `git show <commit>:lua/check.lua > check-before.lua`), interleaved.
//!
//! And `sync.lua` (`lua/prelude.lua` + `lua/sync.lua`), per entry: calls of 100 entries, each one
//! limit on its own key, on keys holding 3 and 0 other proxies' leases and rounds (the baseline's
//! in its own version's layout), and on new keys;
//! beside it a script making `sync.lua`'s Redis calls per entry without its Lua.
//! `--sync-baseline FILE` runs the same cases with FILE in place of `lua/sync.lua`.
//!
//! And `fleet.lua`, per load report: an honest proxy's report with no other report and after a
//! liar's 10,000 reports under made-up ids of one credential, and the liar's own reports.
//! `--fleet-baseline FILE` runs the same cases with FILE in place of `lua/fleet.lua` (a version
//! that kept every report in one hash); `--fleet` runs the fleet cases alone.
//!
//! `cargo run --release -p sluice-counter-service --example redis_scripts -- [--calls N]
//! [--rounds N] [--baseline FILE] [--sync-baseline FILE] [--fleet] [--fleet-baseline FILE]`
//! (`make bench-redis-scripts`; needs `redis-server`).

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::Duration;

use sluice_counter_service::scripts::{
    CHECK_LUA, FLEET_LUA, PRELUDE_LUA, SYNC_LUA, TOKEN_BUCKET_LUA,
};
use sluice_tests::redis::Redis;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// Returns early with an error made of a formatted message.
macro_rules! bail {
    ($($message:tt)*) => {
        return Err(format!($($message)*).into())
    };
}

/// `check.lua`'s four Redis calls (TIME, HGETALL, HSET, PEXPIRE) and its reply, without its Lua:
/// the floor any script making those calls pays.
const CALLS_ONLY_LUA: &str = "local t = redis.call('TIME') \
local h = redis.call('HGETALL', KEYS[1]) \
redis.call('HSET', KEYS[1], 'tokens', 999999999, 'ts', 1796087367751967) \
redis.call('PEXPIRE', KEYS[1], 2001) \
return {1, 999999999, 0, 2001}";

/// `sync.lua`'s Redis calls per entry (HGETALL, an HSET of the bucket and the proxy's lease field,
/// PEXPIRE) and its five numbers per entry, without its Lua: the floor any script making those
/// calls pays. ARGV as `sync.lua`'s (only the entry count is read).
const SYNC_CALLS_ONLY_LUA: &str = "local result = {} \
local lease = string.rep('x', 56) \
for i = 1, tonumber(ARGV[6]) do \
  local h = redis.call('HGETALL', KEYS[i]) \
  redis.call('HSET', KEYS[i], 'tokens', 999999999, 'ts', 1796087367751967, 'l:bench', lease) \
  redis.call('PEXPIRE', KEYS[i], 2001) \
  result[#result + 1] = 3 \
  result[#result + 1] = 300 \
  result[#result + 1] = 999999999 \
  result[#result + 1] = 0 \
  result[#result + 1] = 0 \
end \
return result";

/// Entries per `sync.lua` call in the sync cases (a proxy's batch; the service's figure is per
/// entry).
const SYNC_BATCH: usize = 100;

/// A lease expiry far enough ahead (us, in 2100) that every lease is live during the run.
const LEASE_EXPIRY_US: u64 = 4_102_444_800_000_000;

/// One persistent connection (the fixture's `query` opens one per command).
struct Connection {
    writer: TcpStream,
    reader: BufReader<TcpStream>,
}

impl Connection {
    fn open(port: u16) -> Result<Connection> {
        let stream = TcpStream::connect(("127.0.0.1", port))?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        stream.set_nodelay(true)?;
        Ok(Connection {
            writer: stream.try_clone()?,
            reader: BufReader::new(stream),
        })
    }

    /// Sends one command and returns the integers of its reply (an integer or an array of them;
    /// empty for other replies). An error reply is an `Err`.
    fn call(&mut self, args: &[&str]) -> Result<Vec<i64>> {
        let mut packet = format!("*{}\r\n", args.len()).into_bytes();
        for arg in args {
            packet.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
            packet.extend_from_slice(arg.as_bytes());
            packet.extend_from_slice(b"\r\n");
        }
        self.writer.write_all(&packet)?;
        let mut numbers = Vec::new();
        self.read(&mut numbers)?;
        Ok(numbers)
    }

    fn read(&mut self, numbers: &mut Vec<i64>) -> Result<()> {
        let mut line = String::new();
        if self.reader.read_line(&mut line)? == 0 {
            bail!("Redis closed the connection");
        }
        let line = line.trim_end();
        let (kind, rest) = line.split_at(line.len().min(1));
        match kind {
            "+" => {}
            "-" => bail!("Redis: {rest}"),
            ":" => numbers.push(rest.parse()?),
            "$" => {
                let len: i64 = rest.parse()?;
                if len >= 0 {
                    let mut bytes = vec![0; len as usize + 2];
                    std::io::Read::read_exact(&mut self.reader, &mut bytes)?;
                }
            }
            "*" => {
                let len: i64 = rest.parse()?;
                for _ in 0..len.max(0) {
                    self.read(numbers)?;
                }
            }
            _ => bail!("not a RESP reply: {line:?}"),
        }
        Ok(())
    }
}

/// Redis's CPU time (`used_cpu_sys` + `used_cpu_user`, the whole server, its network reads and
/// writes included), in usec.
fn cpu_usec(redis: &Redis) -> Result<f64> {
    let text = redis.text(&["INFO", "cpu"])?;
    let seconds: f64 = text
        .lines()
        .filter_map(|line| {
            line.strip_prefix("used_cpu_sys:")
                .or_else(|| line.strip_prefix("used_cpu_user:"))
        })
        .filter_map(|value| value.trim().parse::<f64>().ok())
        .sum();
    Ok(seconds * 1e6)
}

/// `cmdstat_evalsha`: calls and usec since start; and the usec of every command but `INFO`
/// summed, as `make bench-redis` sums them (the calls a script makes are counted under their own
/// names too, so their time is in both `EVALSHA`'s and theirs).
fn evalsha_stats(redis: &Redis) -> Result<(u64, u64, u64)> {
    let text = redis.text(&["INFO", "commandstats"])?;
    let field = |line: &str, name: &str| -> u64 {
        line.split([':', ','])
            .find_map(|part| part.strip_prefix(name))
            .and_then(|value| value.parse().ok())
            .unwrap_or(0)
    };
    let (mut calls, mut usec, mut all) = (0, 0, 0);
    for line in text.lines().filter(|line| line.starts_with("cmdstat_")) {
        if line.starts_with("cmdstat_evalsha:") {
            calls = field(line, "calls=");
            usec = field(line, "usec=");
        }
        if !line.starts_with("cmdstat_info:") {
            all += field(line, "usec=");
        }
    }
    Ok((calls, usec, all))
}

#[derive(Clone, Copy, PartialEq)]
enum Script {
    Check,
    Baseline,
    TokenBucket,
    CallsOnly,
    Sync,
    SyncBaseline,
    SyncCallsOnly,
}

impl Script {
    /// Whether a call carries a batch of `SYNC_BATCH` entries (its figures are per entry).
    fn batched(self) -> bool {
        matches!(
            self,
            Script::Sync | Script::SyncBaseline | Script::SyncCallsOnly
        )
    }
}

struct Case {
    name: String,
    script: Script,
    /// Other proxies' leases on the key; `None`: a new key each call.
    leases: Option<usize>,
    /// Whether each lease has its `r:<proxy>` round beside it.
    rounds: bool,
    /// usec per call, one per round.
    figures: Vec<f64>,
    /// Redis CPU usec per call, one per round.
    cpu: Vec<f64>,
    /// Every command's usec (`INFO` excepted) per call, one per round.
    all: Vec<f64>,
}

impl Case {
    fn new(name: String, script: Script, leases: Option<usize>, rounds: bool) -> Case {
        Case {
            name,
            script,
            leases,
            rounds,
            figures: Vec::new(),
            cpu: Vec::new(),
            all: Vec::new(),
        }
    }
}

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    if sorted.is_empty() {
        return f64::NAN;
    }
    let middle = sorted.len() / 2;
    if sorted.len() % 2 == 1 {
        sorted[middle]
    } else {
        (sorted[middle - 1] + sorted[middle]) / 2.0
    }
}

/// Puts a live lease of proxy `proxy-<proxy>` and its last round on `key`: as one packed field
/// (`lua/prelude.lua`'s lease_pack), or, for a baseline of an earlier version, as text in the two
/// fields it read (p:q and r:q).
fn put_lease(redis: &Redis, key: &str, proxy: usize, text: bool) -> Result<()> {
    let written = (LEASE_EXPIRY_US - 1).to_string();
    if text {
        let lease = format!("3 {LEASE_EXPIRY_US} 1.5 1764550000000000");
        redis.query(&["HSET", key, &format!("p:proxy-{proxy}"), &lease])?;
        let round = format!("1 2 {written}");
        redis.query(&["HSET", key, &format!("r:proxy-{proxy}"), &round])?;
    } else {
        redis.query(&[
            "EVAL",
            "redis.call('HSET', KEYS[1], ARGV[1], struct.pack('<ddddddd', 3, tonumber(ARGV[2]), \
             1.5, 1764550000000000, 1, 2, tonumber(ARGV[3])))",
            "1",
            key,
            &format!("l:proxy-{proxy}"),
            &LEASE_EXPIRY_US.to_string(),
            &written,
        ])?;
    }
    Ok(())
}

/// Runs one sync case: `batches` calls of `SYNC_BATCH` entries, each entry one limit on its own
/// key (the case's keys, each holding `case.leases` other proxies' leases and rounds, or new keys
/// each call), reported by proxy `bench` with a new round each call. Returns the EVALSHA usec,
/// Redis CPU usec and every command's usec, per entry.
fn run_sync_case(
    redis: &Redis,
    connection: &mut Connection,
    sha: &str,
    case: &Case,
    index: usize,
    batches: usize,
    fresh: &mut u64,
) -> Result<(f64, f64, f64)> {
    let key_of = |n: u64| format!("sluice:{{{n:016x}}}:api-key-{n}:1000000000/1000/1000000000");
    let base = (index as u64 + 1) << 32;
    if let Some(leases) = case.leases {
        for k in 0..SYNC_BATCH as u64 {
            let key = key_of(base + k);
            redis.query(&["DEL", &key])?;
            for proxy in 0..leases {
                put_lease(redis, &key, proxy, case.script == Script::SyncBaseline)?;
            }
        }
    }
    let before = evalsha_stats(redis)?;
    let cpu_before = cpu_usec(redis)?;
    for call in 0..batches {
        let keys: Vec<String> = (0..SYNC_BATCH as u64)
            .map(|k| match case.leases {
                Some(_) => key_of(base + k),
                None => {
                    *fresh += 1;
                    key_of(*fresh)
                }
            })
            .collect();
        let counter = (call + 1).to_string();
        let count = SYNC_BATCH.to_string();
        let mut args = vec!["EVALSHA", sha, &count];
        args.extend(keys.iter().map(String::as_str));
        args.extend(["0", "bench", "100", "300", "1300", &count]);
        for _ in 0..SYNC_BATCH {
            args.extend([
                "1",
                "1",
                "0",
                "7",
                &counter,
                "1000000000",
                "1000",
                "1000000000",
            ]);
        }
        let reply = connection.call(&args)?;
        if reply.len() != 6 * SYNC_BATCH || reply.chunks(6).any(|entry| entry[0] < 1) {
            bail!(
                "{}: the call answered {reply:?}, not a grant per entry",
                case.name
            );
        }
    }
    let cpu_after = cpu_usec(redis)?;
    let after = evalsha_stats(redis)?;
    let calls_made = after.0 - before.0;
    if calls_made != batches as u64 {
        bail!(
            "{}: Redis counted {calls_made} calls, not {batches}",
            case.name
        );
    }
    let entries = (batches * SYNC_BATCH) as f64;
    Ok((
        (after.1 - before.1) as f64 / entries,
        (cpu_after - cpu_before) / entries,
        (after.2 - before.2) as f64 / entries,
    ))
}

fn main() -> Result<()> {
    let mut calls = 5_000usize;
    let mut rounds = 9usize;
    let mut baseline = None;
    let mut sync_baseline = None;
    let mut fleet_baseline = None;
    let mut fleet_only = false;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--calls" => calls = value()?.parse()?,
            "--rounds" => rounds = value()?.parse()?,
            "--baseline" => {
                let path = value()?;
                let body = std::fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?;
                baseline = Some(format!("{PRELUDE_LUA}\n{body}"));
            }
            "--sync-baseline" => {
                let path = value()?;
                let body = std::fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?;
                sync_baseline = Some(format!("{PRELUDE_LUA}\n{body}"));
            }
            "--fleet-baseline" => {
                let path = value()?;
                let body = std::fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?;
                fleet_baseline = Some(format!("{PRELUDE_LUA}\n{body}"));
            }
            "--fleet" => fleet_only = true,
            other => bail!("unknown argument {other}"),
        }
    }

    let redis = Redis::start_with(&["--save", "", "--appendonly", "no"])?;
    let mut connection = Connection::open(redis.port())?;
    if fleet_only {
        return run_fleet(&redis, &mut connection, calls, rounds, fleet_baseline);
    }
    let load = |text: &str| redis.text(&["SCRIPT", "LOAD", text]);
    let check_sha = load(CHECK_LUA)?;
    let bucket_sha = load(TOKEN_BUCKET_LUA)?;
    let calls_sha = load(CALLS_ONLY_LUA)?;
    let baseline_sha = match &baseline {
        Some(text) => Some(load(text)?),
        None => None,
    };
    let sync_sha = load(SYNC_LUA)?;
    let sync_calls_sha = load(SYNC_CALLS_ONLY_LUA)?;
    let sync_baseline_sha = match &sync_baseline {
        Some(text) => Some(load(text)?),
        None => None,
    };
    let version = redis.text(&["INFO", "server"])?;
    let version = version
        .lines()
        .find_map(|line| line.strip_prefix("redis_version:"))
        .unwrap_or("?")
        .to_owned();

    let mut cases = Vec::new();
    let mut scripts = vec![Script::Check];
    if baseline_sha.is_some() {
        scripts.insert(0, Script::Baseline);
    }
    for (leases, rounds) in [
        (Some(0), true),
        (Some(1), true),
        (Some(4), true),
        (Some(4), false),
        (None, true),
    ] {
        for &script in &scripts {
            let which = if script == Script::Baseline {
                "check.lua (baseline)"
            } else {
                "check.lua"
            };
            let on = match leases {
                Some(n) if rounds => format!("one key, {n} leases"),
                Some(n) => format!("one key, {n} leases without their rounds"),
                None => "a new key each call".to_owned(),
            };
            cases.push(Case::new(format!("{which}, {on}"), script, leases, rounds));
        }
    }
    for leases in [Some(0), None] {
        let on = if leases.is_some() {
            "one key"
        } else {
            "a new key each call"
        };
        cases.push(Case::new(
            format!("token_bucket.lua, {on}"),
            Script::TokenBucket,
            leases,
            true,
        ));
    }

    cases.push(Case::new(
        "check.lua's four Redis calls alone, one key".to_owned(),
        Script::CallsOnly,
        Some(0),
        true,
    ));

    let mut syncs = vec![Script::Sync, Script::SyncCallsOnly];
    if sync_baseline_sha.is_some() {
        syncs.insert(0, Script::SyncBaseline);
    }
    for (leases, rounds) in [(Some(3), true), (Some(0), true), (None, true)] {
        for &script in &syncs {
            let which = match script {
                Script::SyncBaseline => "sync.lua (baseline)",
                Script::SyncCallsOnly => "sync.lua's Redis calls alone",
                _ => "sync.lua",
            };
            let on = match leases {
                Some(n) => format!("{SYNC_BATCH} keys, {n} other leases each, per entry"),
                None => format!("{SYNC_BATCH} new keys a call, per entry"),
            };
            cases.push(Case::new(format!("{which}, {on}"), script, leases, rounds));
        }
    }

    // A limit no call exhausts: every check is admitted and writes the key, as most do.
    let (requests, period_ms, burst) = ("1000000000", "1000", "1000000000");
    let mut fresh = 0u64;
    for round in 0..rounds {
        for (index, case) in cases.iter_mut().enumerate() {
            let sha = match case.script {
                Script::Check => check_sha.as_str(),
                Script::Baseline => baseline_sha.as_deref().unwrap_or_default(),
                Script::TokenBucket => bucket_sha.as_str(),
                Script::CallsOnly => calls_sha.as_str(),
                Script::Sync => sync_sha.as_str(),
                Script::SyncBaseline => sync_baseline_sha.as_deref().unwrap_or_default(),
                Script::SyncCallsOnly => sync_calls_sha.as_str(),
            };
            if case.script.batched() {
                let (figure, cpu, all) = run_sync_case(
                    &redis,
                    &mut connection,
                    sha,
                    case,
                    index,
                    calls / SYNC_BATCH.max(1) * 4,
                    &mut fresh,
                )?;
                case.figures.push(figure);
                case.cpu.push(cpu);
                case.all.push(all);
                continue;
            }
            // A key of the service's shape (keys.rs), one per case.
            let key = format!(
                "sluice:{{00000000000000{index:02x}}}:api-key-{index}:1000000000/1000/1000000000"
            );
            redis.query(&["DEL", &key])?;
            for proxy in 0..case.leases.unwrap_or(0) {
                if case.rounds {
                    put_lease(&redis, &key, proxy, case.script == Script::Baseline)?;
                } else {
                    let lease = format!("3 {LEASE_EXPIRY_US} 1.5 1764550000000000");
                    redis.query(&["HSET", &key, &format!("p:proxy-{proxy}"), &lease])?;
                }
            }
            let before = evalsha_stats(&redis)?;
            let cpu_before = cpu_usec(&redis)?;
            for _ in 0..calls {
                let key = match case.leases {
                    Some(_) => key.clone(),
                    None => {
                        fresh += 1;
                        format!(
                            "sluice:{{{fresh:016x}}}:api-key-{fresh}:1000000000/1000/1000000000"
                        )
                    }
                };
                let reply = match case.script {
                    Script::TokenBucket => {
                        connection.call(&["EVALSHA", sha, "1", &key, burst, requests, "1", "0"])?
                    }
                    _ => connection.call(&[
                        "EVALSHA", sha, "1", &key, "0", "1", "1", requests, period_ms, burst,
                    ])?,
                };
                if reply.first() != Some(&1) {
                    bail!("{}: the call answered {reply:?}, not admitted", case.name);
                }
            }
            let cpu_after = cpu_usec(&redis)?;
            let after = evalsha_stats(&redis)?;
            let calls_made = after.0 - before.0;
            if calls_made != calls as u64 {
                bail!(
                    "{}: Redis counted {calls_made} calls, not {calls}",
                    case.name
                );
            }
            case.figures
                .push((after.1 - before.1) as f64 / calls_made as f64);
            case.cpu.push((cpu_after - cpu_before) / calls_made as f64);
            case.all
                .push((after.2 - before.2) as f64 / calls_made as f64);
        }
        eprintln!("round {}/{rounds} done", round + 1);
        // new keys of the last round go, so every round starts from the same database
        redis.query(&["FLUSHALL"])?;
    }

    println!("Redis {version}, {rounds} rounds of {calls} calls per case, interleaved, one call at a time on one connection; `INFO commandstats` usec per `EVALSHA`, and Redis's CPU time (`INFO cpu`) per call:");
    println!();
    println!("| case | median µs / call | min | max | every command's µs / call (median) | Redis CPU µs / call (median) |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: |");
    for case in &cases {
        let min = case.figures.iter().copied().fold(f64::INFINITY, f64::min);
        let max = case.figures.iter().copied().fold(0.0, f64::max);
        println!(
            "| {} | {:.2} | {min:.2} | {max:.2} | {:.2} | {:.1} |",
            case.name,
            median(&case.figures),
            median(&case.all),
            median(&case.cpu)
        );
    }
    // a tenth of the calls: the baseline's calls after 10,000 reports take milliseconds each
    run_fleet(
        &redis,
        &mut connection,
        (calls / 10).max(1),
        rounds,
        fleet_baseline,
    )
}

/// The fleet cases: one `fleet.lua` call per load report, of an honest proxy under its own
/// credential, with no other report and after a liar sent 10,000 reports under made-up ids of
/// one credential (fresh for an hour); and the liar's own calls, each under a new id. With
/// `--fleet-baseline FILE` (e.g. `git show <commit>:lua/fleet.lua > fleet-before.lua`), the same
/// cases with the version that kept every report in one hash (`sluice:fleet:load`, its ARGV).
struct FleetCase {
    name: String,
    /// The version before (one hash, its ARGV), not the current one.
    baseline: bool,
    /// Made-up ids the liar reported under before the case.
    fakes: usize,
    /// The calls measured are the liar's (each a new id), not the honest proxy's.
    liar: bool,
    figures: Vec<f64>,
}

/// A report as `fleet.lua` (current, or the baseline) is called for it; `window_ms` is how long
/// it stays fresh.
fn fleet_args<'a>(
    sha: &'a str,
    baseline: bool,
    credential: &'a str,
    proxy: &'a str,
    utilization: &'a str,
    numbers: &'a [String; 2],
) -> Vec<&'a str> {
    let [window_ms, proxies_key] = numbers;
    if baseline {
        // interval_ms, fresh_intervals 3, min_fresh_ms 1000, max_fields 10000: fresh for window_ms
        vec![
            "EVALSHA",
            sha,
            "1",
            "sluice:fleet:load",
            "0",
            proxy,
            utilization,
            "0",
            "1",
            window_ms,
            "1",
            "1000",
            "10000",
        ]
    } else {
        vec![
            "EVALSHA",
            sha,
            "2",
            "sluice:fleet:{fleet}:credentials",
            proxies_key,
            "0",
            credential,
            proxy,
            utilization,
            "0",
            "1",
            window_ms,
            "256",
            "100",
        ]
    }
}

fn run_fleet(
    redis: &Redis,
    connection: &mut Connection,
    calls: usize,
    rounds: usize,
    baseline: Option<String>,
) -> Result<()> {
    let sha = redis.text(&["SCRIPT", "LOAD", FLEET_LUA])?;
    let baseline_sha = match &baseline {
        Some(text) => Some(redis.text(&["SCRIPT", "LOAD", text])?),
        None => None,
    };
    let mut cases = Vec::new();
    for is_baseline in [true, false] {
        if is_baseline && baseline_sha.is_none() {
            continue;
        }
        let which = if is_baseline {
            "fleet.lua (baseline)"
        } else {
            "fleet.lua"
        };
        for (fakes, liar) in [(0, false), (10_000, false), (10_000, true)] {
            let who = if liar {
                "the liar, a new id each call"
            } else {
                "an honest proxy"
            };
            cases.push(FleetCase {
                name: format!("{which}, {who}, after {fakes} made-up ids"),
                baseline: is_baseline,
                fakes,
                liar,
                figures: Vec::new(),
            });
        }
    }
    // an hour: every report stays fresh during the run
    let long = [
        3_600_000.to_string(),
        "sluice:fleet:{fleet}:proxies:liar".to_owned(),
    ];
    let honest_numbers = [
        3_600_000.to_string(),
        "sluice:fleet:{fleet}:proxies:edge".to_owned(),
    ];
    for round in 0..rounds {
        for case in cases.iter_mut() {
            redis.query(&["FLUSHALL"])?;
            let sha = if case.baseline {
                baseline_sha.as_deref().unwrap_or_default()
            } else {
                sha.as_str()
            };
            if case.baseline {
                // written directly: the baseline's own calls would take minutes to fill its hash
                let time = redis.query(&["TIME"])?;
                let now_ms = match time {
                    sluice_tests::redis::Reply::Array(parts) => {
                        parts
                            .first()
                            .and_then(|p| p.text())
                            .unwrap_or("0")
                            .parse::<u64>()?
                            * 1000
                    }
                    other => bail!("TIME answered {other:?}"),
                };
                let value = format!("1,0,1,1200000,{now_ms}");
                let names: Vec<String> =
                    (0..case.fakes).map(|i| format!("liar/fake-{i}")).collect();
                for chunk in names.chunks(1000) {
                    let mut hset = vec!["HSET", "sluice:fleet:load"];
                    for name in chunk {
                        hset.push(name);
                        hset.push(&value);
                    }
                    redis.query(&hset)?;
                }
            } else {
                for i in 0..case.fakes {
                    let proxy = format!("liar/fake-{i}");
                    connection.call(&fleet_args(sha, false, "liar", &proxy, "1", &long))?;
                }
            }
            let before = evalsha_stats(redis)?;
            for i in 0..calls {
                let reply = if case.liar {
                    let proxy = format!("liar/new-{i}");
                    connection.call(&fleet_args(sha, case.baseline, "liar", &proxy, "1", &long))?
                } else {
                    let args = fleet_args(
                        sha,
                        case.baseline,
                        "edge",
                        "edge/p1",
                        "0.2",
                        &honest_numbers,
                    );
                    connection.call(&args)?
                };
                if !case.liar && !case.baseline && reply.get(1) != Some(&1) {
                    bail!("{}: the report was not recorded: {reply:?}", case.name);
                }
            }
            let after = evalsha_stats(redis)?;
            let made = after.0 - before.0;
            if made != calls as u64 {
                bail!("{}: Redis counted {made} calls, not {calls}", case.name);
            }
            case.figures.push((after.1 - before.1) as f64 / made as f64);
        }
        eprintln!("fleet round {}/{rounds} done", round + 1);
    }
    redis.query(&["FLUSHALL"])?;
    println!();
    println!("fleet.lua, {rounds} rounds of {calls} calls per case, interleaved; `INFO commandstats` usec per `EVALSHA`:");
    println!();
    println!("| case | median µs / call | min | max |");
    println!("| --- | ---: | ---: | ---: |");
    for case in &cases {
        let min = case.figures.iter().copied().fold(f64::INFINITY, f64::min);
        let max = case.figures.iter().copied().fold(0.0, f64::max);
        println!(
            "| {} | {:.2} | {min:.2} | {max:.2} |",
            case.name,
            median(&case.figures)
        );
    }
    Ok(())
}
