//! A known Zipf workload: a seeded stream of keys whose true counts the tests count themselves,
//! to assert the top-keys error bound against (`sluice_core::top`).

use std::collections::HashMap;

/// `n` keys drawn from `keys` distinct ones, key of rank `r` (from 1) with weight `1 / r^s`,
/// from a SplitMix64 stream seeded with `seed`: the same stream on every run. Each key is
/// `{rule}␟10.0.X.Y`, as the filter builds a client-address key.
pub fn stream(seed: u64, rule: &str, keys: usize, s: f64, n: usize) -> Vec<String> {
    let keys = keys.max(1);
    let weights: Vec<f64> = (1..=keys).map(|r| 1.0 / (r as f64).powf(s)).collect();
    let sum: f64 = weights.iter().sum();
    let mut acc = 0.0;
    let cdf: Vec<f64> = weights
        .iter()
        .map(|w| {
            acc += w / sum;
            acc
        })
        .collect();
    let mut state = seed;
    (0..n)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            let u = ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64;
            let rank = cdf.partition_point(|&c| c < u).min(keys - 1);
            format!("{rule}\u{1f}10.0.{}.{}", rank / 256, rank % 256)
        })
        .collect()
}

/// The true count of every key of `stream`.
pub fn counts(stream: &[String]) -> HashMap<String, u64> {
    let mut counts = HashMap::new();
    for key in stream {
        *counts.entry(key.clone()).or_insert(0) += 1;
    }
    counts
}
