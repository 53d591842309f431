// Traffic patterns, as the CSV the core reads: `seconds,client,path`. Seeded, so a shared link
// replays the very same requests.

export const MAX_REQUESTS = 50000;

// A small seeded generator (mulberry32): the same seed, the same trace.
function rng(seed) {
  let a = (seed >>> 0) || 1;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

// Client i's name: an address of a documentation network, so client_ip keys read naturally.
export function clientName(i) {
  return i < 254 ? `198.51.100.${i + 1}` : `10.1.${(i >> 8) & 255}.${i & 255}`;
}

function weights(n, skew) {
  if (n <= 1) return [1];
  if (skew === "half") return [n - 1, ...Array(n - 1).fill(1)];
  if (skew === "zipf") return Array.from({ length: n }, (_, i) => 1 / (i + 1));
  return Array(n).fill(1);
}

function picker(n, skew, random) {
  const w = weights(n, skew);
  const total = w.reduce((s, x) => s + x, 0);
  const cumulative = [];
  let acc = 0;
  for (const x of w) cumulative.push((acc += x / total));
  let next = 0;
  return () => {
    if (skew === "even") return next++ % n; // round robin: each client its exact share
    const u = random();
    const i = cumulative.findIndex((c) => u < c);
    return i < 0 ? n - 1 : i;
  };
}

// Arrival times in seconds for pattern `p`.
function times(p, random) {
  const d = Math.max(0, +p.duration || 0);
  const out = [];
  const push = (t) => out.length < MAX_REQUESTS + 1 && t < d && out.push(t);
  switch (p.pattern) {
    case "steady": {
      const r = Math.max(0, +p.rate || 0);
      for (let i = 0; r > 0 && i / r < d && out.length <= MAX_REQUESTS; i++) push(i / r);
      break;
    }
    case "poisson": {
      const r = Math.max(0, +p.rate || 0);
      for (let t = 0; r > 0 && out.length <= MAX_REQUESTS; ) {
        t += -Math.log(1 - random()) / r;
        if (t >= d) break;
        push(t);
      }
      break;
    }
    case "ramp": {
      // Rate from `rateFrom` to `rateTo` linearly: request k comes when the expected count
      // from 0 reaches k + 1/2.
      const b = Math.max(0, +p.rateFrom || 0);
      const a = (Math.max(0, +p.rateTo || 0) - b) / (2 * (d || 1));
      for (let k = 0.5; out.length <= MAX_REQUESTS; k++) {
        const t = a === 0 ? (b > 0 ? k / b : Infinity) : (-b + Math.sqrt(b * b + 4 * a * k)) / (2 * a);
        if (!(t < d)) break;
        push(t);
      }
      break;
    }
    case "bursts": {
      // A steady background at `rate`, and `burstSize` requests within 200 ms every `burstEvery` s.
      const r = Math.max(0, +p.rate || 0);
      for (let i = 0; r > 0 && i / r < d && out.length <= MAX_REQUESTS; i++) push(i / r);
      const every = Math.max(0.1, +p.burstEvery || 1);
      const size = Math.max(1, Math.floor(+p.burstSize || 1));
      for (let s = every / 4; s < d && out.length <= MAX_REQUESTS; s += every) {
        for (let j = 0; j < size; j++) push(s + (0.2 * j) / size);
      }
      out.sort((x, y) => x - y);
      break;
    }
  }
  return out;
}

// The trace for pattern `p` as CSV, with how many requests it has and whether it was cut.
export function generate(p) {
  const random = rng(+p.seed || 1);
  let ts = times(p, random);
  const cut = ts.length > MAX_REQUESTS;
  if (cut) ts = ts.slice(0, MAX_REQUESTS);
  const n = Math.max(1, Math.min(1000, Math.floor(+p.clients || 1)));
  const pick = picker(n, p.skew || "even", random);
  const path = (p.path || "/").trim().replace(/,/g, "") || "/";
  const lines = ["seconds,client,path"];
  for (const t of ts) lines.push(`${t.toFixed(6)},${clientName(pick())},${path}`);
  return { csv: lines.join("\n") + "\n", count: ts.length, cut };
}
