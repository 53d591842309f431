//! A fixed-memory latency histogram, for the adaptive controller's percentile: 88 buckets, four
//! to an octave, from 16 µs to 67 s (each within 19% of its neighbour; a percentile is
//! interpolated within its bucket). Each worker fills one between its ticks; the bulkhead's
//! window sums them until the window ends, as Envoy's `adaptive_concurrency` keeps a histogram
//! of its sample window.

/// Buckets: 22 octaves (2^4 to 2^26 µs) of four.
pub const BUCKETS: usize = 88;
/// Bytes of an encoded histogram.
pub const BYTES: usize = BUCKETS * 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Histogram {
    pub counts: [u32; BUCKETS],
}

impl Default for Histogram {
    fn default() -> Histogram {
        Histogram {
            counts: [0; BUCKETS],
        }
    }
}

/// The bucket of a latency.
fn bucket(latency_us: u64) -> usize {
    if latency_us < 16 {
        return 0;
    }
    let octave = 63 - latency_us.leading_zeros() as usize;
    let sub = ((latency_us >> (octave - 2)) & 3) as usize;
    ((octave - 4) * 4 + sub).min(BUCKETS - 1)
}

/// The lowest latency of a bucket, and its width.
fn edges(bucket: usize) -> (f64, f64) {
    let octave = bucket / 4 + 4;
    let sub = (bucket % 4) as u64;
    let width = 1u64 << (octave - 2);
    (((4 + sub) * width) as f64, width as f64)
}

impl Histogram {
    pub fn add(&mut self, latency_us: u64) {
        if let Some(c) = self.counts.get_mut(bucket(latency_us)) {
            *c = c.saturating_add(1);
        }
    }

    pub fn merge(&mut self, other: &Histogram) {
        for (c, o) in self.counts.iter_mut().zip(other.counts.iter()) {
            *c = c.saturating_add(*o);
        }
    }

    pub fn is_empty(&self) -> bool {
        self.counts.iter().all(|&c| c == 0)
    }

    pub fn count(&self) -> f64 {
        self.counts.iter().map(|&c| c as f64).sum()
    }

    /// The `percentile` (0 to 100) of the latencies, interpolated within its bucket; 0 when
    /// empty.
    pub fn percentile(&self, percentile: f64) -> f64 {
        let total = self.count();
        if total <= 0.0 {
            return 0.0;
        }
        let target = (percentile / 100.0).clamp(0.0, 1.0) * total;
        let mut below = 0.0;
        for (i, &c) in self.counts.iter().enumerate() {
            let c = c as f64;
            if c > 0.0 && below + c >= target {
                let (low, width) = edges(i);
                return low + width * ((target - below) / c).clamp(0.0, 1.0);
            }
            below += c;
        }
        let (low, width) = edges(BUCKETS - 1);
        low + width
    }

    pub fn encode_into(&self, out: &mut Vec<u8>) {
        for c in &self.counts {
            out.extend_from_slice(&c.to_le_bytes());
        }
    }

    /// Decodes exactly [`BYTES`] bytes; anything else reads as empty.
    pub fn decode(bytes: &[u8]) -> Histogram {
        let mut h = Histogram::default();
        if bytes.len() != BYTES {
            return h;
        }
        for (c, b) in h.counts.iter_mut().zip(bytes.chunks_exact(4)) {
            *c = b.try_into().map_or(0, u32::from_le_bytes);
        }
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_the_range_in_order_and_percentiles_land_within_a_bucket() {
        let mut last = 0;
        for us in [
            0u64,
            15,
            16,
            20,
            24,
            28,
            32,
            1_000,
            25_000,
            1 << 25,
            u64::MAX,
        ] {
            let b = bucket(us);
            assert!(b >= last && b < BUCKETS, "{us}: {b}");
            last = b;
            if (16..1 << 26).contains(&us) {
                let (low, width) = edges(b);
                assert!(
                    low <= us as f64 && (us as f64) < low + width,
                    "{us}: {low} {width}"
                );
            }
        }
        // 90 answers at 10 ms and 10 at 100 ms: p90 is 10 ms, p95 100 ms, the mean 19 ms.
        let mut h = Histogram::default();
        for _ in 0..90 {
            h.add(10_000);
        }
        for _ in 0..10 {
            h.add(100_000);
        }
        let p90 = h.percentile(90.0);
        assert!((8_192.0..=10_240.0).contains(&p90), "{p90}");
        let p95 = h.percentile(95.0);
        assert!((98_304.0..=114_688.0).contains(&p95), "{p95}");
        assert_eq!(Histogram::default().percentile(90.0), 0.0);
        let mut bytes = Vec::new();
        h.encode_into(&mut bytes);
        assert_eq!(Histogram::decode(&bytes), h);
        assert!(Histogram::decode(&bytes[1..]).is_empty());
    }
}
