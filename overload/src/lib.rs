//! The parts of the overload benchmark (`bench/overload.py`) that run as programs:
//!
//! - `sluice-upstream`: an HTTP/1.1 server of fixed capacity (K requests served at once, S ms each,
//!   the rest waiting in an unbounded FIFO queue), so that latency grows with load as it does
//!   behind a real overloaded service;
//! - `sluice-load`: an open-loop load generator (request i leaves at start + i/R whether or not
//!   earlier ones were answered), which reports goodput and the latency of admitted requests per
//!   priority class.
//!
//! This library holds what both need and what is worth a unit test: the class split, percentiles,
//! and the deterministic failure schedule.

use std::fmt;

/// Request classes and their shares of the load, from `"high:0.2,low:0.8"`.
#[derive(Debug, Clone, PartialEq)]
pub struct Classes {
    names: Vec<String>,
    /// Cumulative shares, normalized so that the last is 1.
    cumulative: Vec<f64>,
}

/// Why a `--classes` value was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassesError(String);

impl fmt::Display for ClassesError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ClassesError {}

impl Classes {
    /// Parses `name:share,name:share,...`; shares are positive and need not sum to 1.
    pub fn parse(spec: &str) -> Result<Self, ClassesError> {
        let mut names = Vec::new();
        let mut shares = Vec::new();
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (name, share) = part
                .split_once(':')
                .ok_or_else(|| ClassesError(format!("{part:?}: expected name:share")))?;
            let name = name.trim();
            let valid = |c: char| c.is_ascii_alphanumeric() || "-_.".contains(c);
            if name.is_empty() || !name.chars().all(valid) {
                return Err(ClassesError(format!(
                    "{name:?}: a class name is 1 or more of a-z A-Z 0-9 - _ ."
                )));
            }
            if names.iter().any(|n| n == name) {
                return Err(ClassesError(format!("{name:?}: named twice")));
            }
            let share: f64 = share
                .trim()
                .parse()
                .map_err(|_| ClassesError(format!("{part:?}: the share is not a number")))?;
            if !(share.is_finite() && share > 0.0) {
                return Err(ClassesError(format!("{part:?}: the share must be > 0")));
            }
            names.push(name.to_string());
            shares.push(share);
        }
        if names.is_empty() {
            return Err(ClassesError("no class given".into()));
        }
        let total: f64 = shares.iter().sum();
        let mut sum = 0.0;
        let mut cumulative: Vec<f64> = shares
            .iter()
            .map(|s| {
                sum += s / total;
                sum
            })
            .collect();
        *cumulative.last_mut().expect("not empty") = 1.0;
        Ok(Self { names, cumulative })
    }

    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// Each class's share of the load (summing to 1).
    pub fn shares(&self) -> Vec<f64> {
        let mut prev = 0.0;
        self.cumulative
            .iter()
            .map(|c| {
                let share = c - prev;
                prev = *c;
                share
            })
            .collect()
    }

    /// The class of a uniform draw `u` in [0, 1).
    pub fn pick(&self, u: f64) -> usize {
        self.cumulative
            .iter()
            .position(|c| u < *c)
            .unwrap_or(self.names.len() - 1)
    }
}

/// SplitMix64: a small seeded generator, so that the class of request i is the same in every run
/// with the same seed (no dependency for something this small).
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1), from the top 53 bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The p-th percentile (0 < p <= 100) of sorted values, nearest rank; `None` when empty.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = (p / 100.0 * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// Whether the n-th request (from 0) fails when a fraction `rate` of them must: exactly
/// floor(n * rate) of the first n fail, spread evenly (rate 0.25 fails the 4th, 8th, 12th, ...).
pub fn fails(n: u64, rate: f64) -> bool {
    if rate <= 0.0 {
        return false;
    }
    if rate >= 1.0 {
        return true;
    }
    ((n + 1) as f64 * rate).floor() > (n as f64 * rate).floor()
}

/// Whether `url` is an absolute http:// URL to a loopback host (127.0.0.0/8, [::1] or
/// localhost): the only place the benchmark's load may go.
pub fn loopback_http(url: &str) -> bool {
    let Some(rest) = url.strip_prefix("http://") else {
        return false;
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    if authority.contains('@') {
        return false;
    }
    let host = match authority.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(""),
        None => authority.split(':').next().unwrap_or(""),
    };
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_parse_and_normalize() {
        let c = Classes::parse("high:0.2, low:0.8").unwrap();
        assert_eq!(c.names(), ["high", "low"]);
        let shares = c.shares();
        assert!((shares[0] - 0.2).abs() < 1e-12 && (shares[1] - 0.8).abs() < 1e-12);
        let c = Classes::parse("a:1,b:3").unwrap();
        assert_eq!(c.pick(0.0), 0);
        assert_eq!(c.pick(0.2499), 0);
        assert_eq!(c.pick(0.25), 1);
        assert_eq!(c.pick(0.999_999), 1);
    }

    #[test]
    fn classes_refuse_bad_specs() {
        for bad in [
            "", "high", "high:0", "high:-1", "high:x", "a:1,a:2", "b c:1", ":1",
        ] {
            assert!(Classes::parse(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn the_split_follows_the_shares() {
        let c = Classes::parse("high:0.2,low:0.8").unwrap();
        let mut rng = SplitMix64::new(1);
        let n = 100_000;
        let high = (0..n).filter(|_| c.pick(rng.next_f64()) == 0).count();
        let share = high as f64 / n as f64;
        assert!((share - 0.2).abs() < 0.01, "high share {share}");
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), Some(50.0));
        assert_eq!(percentile(&v, 99.0), Some(99.0));
        assert_eq!(percentile(&v, 100.0), Some(100.0));
        assert_eq!(percentile(&[7.0], 1.0), Some(7.0));
        assert_eq!(percentile(&[], 50.0), None);
    }

    #[test]
    fn failures_are_evenly_spread() {
        assert!(!(0..1000).any(|n| fails(n, 0.0)));
        assert!((0..1000).all(|n| fails(n, 1.0)));
        let quarter: Vec<u64> = (0..12).filter(|n| fails(*n, 0.25)).collect();
        assert_eq!(quarter, [3, 7, 11]);
        assert_eq!((0..10_000).filter(|n| fails(*n, 0.1)).count(), 1000);
        assert_eq!((0..1000).filter(|n| fails(*n, 1.0 / 3.0)).count(), 333);
    }

    #[test]
    fn only_loopback_urls_are_load_targets() {
        for ok in [
            "http://127.0.0.1:8080/api",
            "http://127.3.4.5/",
            "http://[::1]:9000/x",
            "http://localhost:1/capacity?workers=4",
        ] {
            assert!(loopback_http(ok), "{ok}");
        }
        for bad in [
            "https://127.0.0.1/",
            "http://10.0.0.1/",
            "http://example.com/",
            "http://127.0.0.1@example.com/",
            "http://[::2]/",
            "http://127.0.0.1.example.com/",
            "127.0.0.1:80/",
            "",
        ] {
            assert!(!loopback_http(bad), "{bad}");
        }
    }
}
