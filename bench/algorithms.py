#!/usr/bin/env python3
"""Accuracy of every rate-limit algorithm in real Envoy: sluice's admissions vs a reference of the algorithm's
definition, on the same arrivals; `local` on one Envoy with 4 workers, `cached` on 3 Envoys sharing one limit.

Usage (from the repository root, after `make deps build build-stack`; `make bench-algorithms` does all):
    .venv/bin/python bench/algorithms.py [--requests 20] [--sync-ms 100] [--epsilon-ms 2] [--connections 32]
                                         [--only token_bucket,gcra,...] [--modes local,cached] [--seed 1]

One limit of `--requests` per second (`burst` the same for token_bucket and gcra), key `header:x-client`, a fresh
key for every trace. Four open-loop arrival traces (each request leaves at its scheduled time whatever came back
before it: a pool of client threads, each with a keep-alive connection to every proxy), all on 127.0.0.1:

- steady: 2.13 x the rate, evenly spaced, 4 s (not exactly 2 x: see STEADY);
- bursty: 5 bursts of 1.5 x the limit sent at once, 0.87 s apart (see BURST_GAP);
- boundary: 1.5 x the limit spread over the last 100 ms before each of three whole-second (window) boundaries, and
  as many over the first 100 ms after it;
- poisson: 1.5 x the rate, exponential gaps from a seeded generator, 4 s.

`local`: one Envoy, `--concurrency 4`, every client connection on it (the kernel spreads connections over the
workers; the per-worker connection counts are printed). `cached`: three Envoys (`--concurrency 2` each) sharing
the limit through one counter service and Redis (started by the stack binary, see bench/stack.py), sync every
`--sync-ms`, the requests of a trace sent round robin over the proxies; each proxy's fallback is the same algorithm
with requests / 3. `sliding_log` is `local` only (a cached one is started anyway, to show it is refused);
`leaky_bucket` shapes instead of admitting and is measured by bench/shaping.py.

The Envoys (envoy/sluice-access-log.yaml.tmpl) log every request: the time the proxy started it (START_TIME, in
microseconds), the x-request-id the client sent, the status. The references below are written here from the
definitions in docs/algorithms.md, not from sluice's code, and are fed those times:

- following: for each request in the order the proxies started them, what the definition decides given the
  requests sluice actually admitted before it. A disagreement is *ambiguous* when the definition itself decides
  the other way at a time within --epsilon-ms of the logged one (the filter reads its clock a few microseconds
  after START_TIME), or, for a denial, once the admitted requests logged up to epsilon after it are counted as
  before it (two workers' order); otherwise it is a *real mismatch*;
- free-running: the definition deciding every request itself; its admissions are compared with sluice's in total
  and per whole-second window;
- over the limit: at each request sluice admitted, how far past the definition's own limit sluice's admissions
  were (token bucket and GCRA: requests admitted in a span beyond burst + rate x span; windows: beyond the
  window's limit), at the most favourable reading of the clock within epsilon. `local` is exact: bound 0.
  `cached` is bounded as docs/consistency.md and docs/algorithms.md say ("The bound of a cached window"): token
  bucket and GCRA by 1.5 sync intervals of the rate plus what proxies admitted from their fallback; windows by
  what proxies admitted from their fallback. Which admissions could be a fallback's is estimated from the
  documented conditions, as an upper estimate: on a proxy, those in the first sync interval plus the slowest
  sync round trip after its first request of the key, after a gap of three sync intervals (a lapsed lease),
  and, for windows, after its first request in each window (every lease ends with its window); and only as many
  as the proxy's fallback limit admits (a reference of it per proxy). They count in the bound whether or not
  their debt was repaid since.

Prints a markdown table (one row per algorithm x consistency x trace) and the machine; Envoy configs, logs,
access logs and results.json go to .run/bench-algorithms/. Everything it starts is stopped when it ends.
Standard library only.
"""

import argparse
import bisect
import copy
import http.client
import json
import math
import os
import queue
import random
import re
import shutil
import sys
import threading
import time
import uuid

sys.dont_write_bytecode = True  # no __pycache__ in bench/
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import Envoy, http_get  # noqa: E402
from stack import ROOT, Stack, loadavg, machine, tool_version  # noqa: E402

TEMPLATE = "sluice-access-log.yaml.tmpl"
ALGORITHMS = ["token_bucket", "gcra", "fixed_window", "sliding_window", "sliding_log"]
BUCKETS = ("token_bucket", "gcra")
LOCAL_ONLY = ("sliding_log",)
TRACES = ["steady", "bursty", "boundary", "poisson"]
PER_US = 1_000_000  # every limit is per second
RULE = "r"
# The steady trace's rate, x the limit's: about 2, but not a ratio of small integers, so arrivals do not keep falling
# on the token bucket's refill instants (at exactly 2 x, every other arrival finds exactly one token).
STEADY = 2.13
# Seconds between the bursty trace's bursts: not a whole number of 1 / rate (at 0.8 s and 20/s, exactly 16 tokens
# come back between two bursts, so one request of each burst finds the bucket at exactly one token).
BURST_GAP = 0.87


# ---------------------------------------------------------------------------------------------------------------
# The references: each algorithm's definition, on integer microseconds. `admits(t)`: would a request at t be
# admitted given the requests recorded so far; `add(t)`: record an admitted request; `over(t)`: how many requests
# past the definition's limit an admission at t would be (> 0: the definition would not admit it).
# A query earlier than the last recorded request is read at that request's time (a request decided after another
# was decided at a later clock).


class TokenBucketRef:
    """`burst` tokens, full at first; refilled continuously at `requests` per period, never above `burst`; a request
    is admitted when at least one whole token is there, and takes it. Tokens are counted in millionths of a token
    per microsecond of period (level is tokens x PER_US), so the arithmetic is exact."""

    def __init__(self, requests, burst):
        self.full, self.rate, self.one = burst * PER_US, requests, PER_US
        self.level, self.last = self.full, None

    def _level(self, t):
        return self.full if self.last is None else min(self.full, self.level + (t - self.last) * self.rate)

    def _at(self, t):
        return t if self.last is None else max(t, self.last)

    def admits(self, t):
        return self._level(self._at(t)) >= self.one

    def add(self, t):
        t = self._at(t)
        self.level, self.last = self._level(t) - self.one, t

    def over(self, t):
        return 1 - self._level(self._at(t)) / self.one


class GcraRef:
    """The generic cell rate algorithm (virtual scheduling): emission interval T = period / requests, tolerance
    tau = (burst - 1) x T; a request at t conforms when TAT - t <= tau, and then TAT = max(TAT, t) + T. Times are
    scaled by `requests` (T = PER_US), so the arithmetic is exact."""

    def __init__(self, requests, burst):
        self.scale, self.emission, self.tau = requests, PER_US, (burst - 1) * PER_US
        self.tat, self.last = None, None

    def _at(self, t):
        return (t if self.last is None else max(t, self.last)) * self.scale

    def admits(self, t):
        return self.tat is None or self.tat - self._at(t) <= self.tau

    def add(self, t):
        now = self._at(t)
        self.tat = (now if self.tat is None else max(self.tat, now)) + self.emission
        self.last = now // self.scale

    def over(self, t):
        now = self._at(t)
        return (max(now if self.tat is None else self.tat, now) - now - self.tau) / self.emission


class FixedWindowRef:
    """Windows of one period aligned to the Unix epoch (a second starts at each whole second); a request is
    admitted when fewer than `requests` were admitted in its window."""

    def __init__(self, requests, burst=None):
        self.limit, self.counts, self.last = requests, {}, None

    def _at(self, t):
        return t if self.last is None else max(t, self.last)

    def admits(self, t):
        return self.counts.get(self._at(t) // PER_US, 0) < self.limit

    def add(self, t):
        t = self._at(t)
        self.counts[t // PER_US] = self.counts.get(t // PER_US, 0) + 1
        self.last = t

    def over(self, t):
        return self.counts.get(self._at(t) // PER_US, 0) + 1 - self.limit


class SlidingWindowRef(FixedWindowRef):
    """The same windows; a request at `elapsed` into its window is admitted when it fits: the weighted count with
    it included stays within the limit, previous x (1 - elapsed / period) + current + 1 <= requests (previous: the
    admissions of the window just before)."""

    def _weighted_x_period(self, t):
        window, elapsed = divmod(self._at(t), PER_US)
        return self.counts.get(window - 1, 0) * (PER_US - elapsed) + self.counts.get(window, 0) * PER_US

    def admits(self, t):
        return self._weighted_x_period(t) + PER_US <= self.limit * PER_US

    def over(self, t):
        return self._weighted_x_period(t) / PER_US + 1 - self.limit


class SlidingLogRef:
    """Exact: a request at t is admitted when fewer than `requests` were admitted in (t - period, t]."""

    def __init__(self, requests, burst=None):
        self.limit, self.times = requests, []

    def _at(self, t):
        return t if not self.times else max(t, self.times[-1])

    def _inside(self, t):
        return len(self.times) - bisect.bisect_right(self.times, self._at(t) - PER_US)

    def admits(self, t):
        return self._inside(t) < self.limit

    def add(self, t):
        self.times.append(self._at(t))

    def over(self, t):
        return self._inside(t) + 1 - self.limit


REFERENCES = {"token_bucket": TokenBucketRef, "gcra": GcraRef, "fixed_window": FixedWindowRef,
              "sliding_window": SlidingWindowRef, "sliding_log": SlidingLogRef}


# ---------------------------------------------------------------------------------------------------------------
# Traces: offsets in seconds from a whole Unix second (so window boundaries are at whole offsets).


def traces(rate, seed):
    burst = int(1.5 * rate)
    rng = random.Random(seed)
    poisson, t = [], 0.2
    while True:
        t += rng.expovariate(1.5 * rate)
        if t >= 4.2:
            break
        poisson.append(t)
    boundary = []
    for b in (1, 2, 3):
        boundary += [b - 0.1 + 0.09 * j / (burst - 1) for j in range(burst)]
        boundary += [b + 0.01 + 0.09 * j / (burst - 1) for j in range(burst)]
    return {
        "steady": [0.25 + i / (STEADY * rate) for i in range(int(4 * STEADY * rate))],
        "bursty": [0.3 + BURST_GAP * b for b in range(5) for _ in range(burst)],
        "boundary": boundary,
        "poisson": poisson,
    }


# ---------------------------------------------------------------------------------------------------------------
# The client: open loop over a pool of threads, each with a keep-alive connection to every proxy.


class Client:
    def __init__(self, ports, connections):
        self.ports, self.work = ports, queue.Queue()
        self.ready = threading.Barrier(connections + 1)
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(connections)]
        for th in self.threads:
            th.start()
        self.ready.wait(30)

    def _connect(self, port):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.connect()
        return conn

    def _run(self):
        conns = {port: self._connect(port) for port in self.ports}
        self.ready.wait(30)
        while True:
            rec = self.work.get()
            if rec is None:
                break
            port = self.ports[rec["proxy"]]
            rec["sent"] = time.time()
            try:
                conn = conns[port] or self._connect(port)
                conns[port] = conn
                conn.request("GET", "/accuracy", headers={"x-client": rec["key"], "x-request-id": rec["id"]})
                resp = conn.getresponse()
                resp.read()
                rec["status"] = resp.status
            except (OSError, http.client.HTTPException) as e:
                rec["status"], rec["error"] = None, repr(e)
                if conns[port]:
                    conns[port].close()
                conns[port] = None
            self.work.task_done()
        for conn in conns.values():
            if conn:
                conn.close()

    def play(self, offsets, key, proxies):
        """Sends one request per offset (seconds after a whole second at least 0.3 s away), round robin over the
        proxies, each at its time; returns the records once every answer is in."""
        start = math.floor(time.time()) + 1
        if start - time.time() < 0.3:
            start += 1
        recs = [{"id": str(uuid.uuid4()), "key": key, "proxy": i % proxies, "scheduled": start + off}
                for i, off in enumerate(sorted(offsets))]
        for rec in recs:
            wait = rec["scheduled"] - time.time()
            if wait > 0:
                time.sleep(wait)
            self.work.put(rec)
        self.work.join()
        return recs

    def close(self):
        for _ in self.threads:
            self.work.put(None)
        for th in self.threads:
            th.join(15)


# ---------------------------------------------------------------------------------------------------------------
# A session: one algorithm in one consistency on its own Envoy(s), every trace on a fresh key.


def fallback_share(rate, proxies):
    return max(1, math.ceil(rate / proxies))  # README: a fallback of about requests / proxies


def plugin_config(algorithm, consistency, rate, proxies, token):
    limit = {"requests": rate, "per": "second", "algorithm": algorithm}
    if algorithm in BUCKETS:
        limit["burst"] = rate
    rule = {"name": RULE, "match": {"path_prefix": "/"}, "key": ["header:x-client"], "limits": [limit],
            "mode": "enforce", "consistency": consistency}
    config = {"headers": "none", "rules": [rule]}
    if consistency == "cached":
        share = fallback_share(rate, proxies)
        fallback = {"requests": share, "per": "second", "algorithm": algorithm}
        if algorithm in BUCKETS:
            fallback["burst"] = share
        rule["fallback"] = {"policy": "fail_open", "limits": [fallback]}
        config["service"] = {"cluster": "sluice_service", "token": token, "timeout_ms": 200,
                             "sync_interval_ms": ARGS.sync_ms}
    return json.dumps(config, separators=(",", ":"))


def refusal(log_path):
    try:
        with open(log_path) as f:
            text = f.read()
    except OSError:
        return "Envoy did not start"
    m = re.search(r"invalid configuration: (.*)", text)
    return m.group(1).strip() if m else "Envoy did not start (see its log)"


def read_access_log(path):
    out = {}
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[2].isdigit():
                seconds, _, micros = parts[0].partition(".")
                out[parts[1]] = (int(seconds) * PER_US + int(micros.ljust(6, "0")[:6]), int(parts[2]))
    return out


def sync_rtt_max_ms(envoy):
    """The slowest sync round trip of a proxy: P100 of the filter's sync.latency_ms histogram (None if empty)."""
    try:
        _, text = http_get(f"http://127.0.0.1:{envoy.admin}/stats?filter=sync.latency_ms", timeout=5)
    except OSError:
        return None
    m = re.search(r"P100\([^,]*,([0-9.]+)\)", text)
    return float(m.group(1)) if m else None


def run_session(algorithm, consistency, stack, workdir, offsets):
    """Runs every trace on one algorithm and consistency; returns (rows' raw data, session info) or a refusal."""
    tag = f"{consistency}-{algorithm}"
    proxies = ARGS.proxies if consistency == "cached" else 1
    concurrency = ARGS.cached_concurrency if consistency == "cached" else ARGS.local_concurrency
    config = plugin_config(algorithm, consistency, ARGS.requests, proxies, stack.token if stack else "")
    service_port = str(stack.service.port) if stack else "1"  # local rules never call the service
    envoys, logs = [], []
    try:
        for p in range(proxies):
            pdir = os.path.join(workdir, f"{tag}-p{p}")  # one directory each: Envoy's pid file is per directory
            os.makedirs(pdir, exist_ok=True)
            logs.append(os.path.join(pdir, "access.log"))
            values = {"PLUGIN_CONFIG": config, "SERVICE_PORT": service_port, "ACCESS_LOG": logs[-1]}
            try:
                envoys.append(Envoy(ARGS.envoy, ARGS.wasm, TEMPLATE, values, concurrency, pdir, "envoy"))
            except SystemExit:
                return None, {"refused": refusal(os.path.join(pdir, "envoy.envoy.log"))}
        client = Client([e.listen for e in envoys], ARGS.connections)
        records = {}
        try:
            for name in ARGS.traces:
                key = f"{tag}-{name}-{uuid.uuid4().hex[:8]}"
                began = time.time()
                records[name] = client.play(offsets[name], key, proxies)
                print(f"  {tag:22} {name:8} {len(records[name]):4} requests in {time.time() - began:.1f} s",
                      file=sys.stderr)
        finally:
            client.close()
        info = {"proxies": proxies, "concurrency": concurrency, "stats": [], "workers": [], "rtt_ms": []}
        for e in envoys:
            c = e.counters()
            info["stats"].append({k: c.get(f"wasmcustom.sluice.{k}", 0) for k in (
                f"rule.{RULE}.allowed", f"rule.{RULE}.denied", f"rule.{RULE}.unavailable", "sync.ok", "sync.failed",
                "sync.timeout")})
            workers = {}
            for name, value in c.items():
                m = re.match(r"listener\.127\.0\.0\.1_%d\.worker_(\d+)\.downstream_cx_total$" % e.listen, name)
                if m:
                    workers[int(m.group(1))] = value
            info["workers"].append([workers[w] for w in sorted(workers)])
            info["rtt_ms"].append(sync_rtt_max_ms(e) if consistency == "cached" else None)
    finally:
        for e in envoys:
            e.stop()  # flushes the access logs
    logged = {}
    for path in logs:
        logged.update(read_access_log(path))
    for recs in records.values():
        for rec in recs:
            rec["start_us"], rec["code"] = logged.get(rec["id"], (None, None))
    return records, info


# ---------------------------------------------------------------------------------------------------------------
# Analysis.


def fallback_eligible(events, algorithm, interval_us, rtt_us, eps):
    """Marks the admissions a proxy could have decided from its fallback (see the module's docstring): in a time
    without a lease, and within what the proxy's fallback (the same algorithm, requests / proxies) admits."""
    reach = interval_us + rtt_us
    share = fallback_share(ARGS.requests, ARGS.proxies)
    by_proxy = {}
    for e in events:
        by_proxy.setdefault(e["proxy"], []).append(e)
    for mine in by_proxy.values():
        since, previous = None, None
        fallback = REFERENCES[algorithm](share, share)
        for e in mine:
            t = e["start_us"]
            if (previous is None or t - previous >= 3 * interval_us
                    or (algorithm not in BUCKETS and t // PER_US != previous // PER_US)):
                since = t
            e["fallback"] = (e["admitted"] and t - since <= reach
                             and any(fallback.admits(x) for x in (t - eps, t, t + eps)))
            if e["fallback"]:
                fallback.add(t)
            previous = t


def analyse(algorithm, consistency, recs, interval_us, rtt_us, make=None):
    eps = int(ARGS.epsilon_ms * 1000)
    make = make or REFERENCES[algorithm]
    rate = ARGS.requests
    events = sorted((r for r in recs if r["code"] in (200, 429)), key=lambda r: (r["start_us"], r["sent"]))
    for e in events:
        e["admitted"] = e["code"] == 200
    cached = consistency == "cached"
    if cached:
        fallback_eligible(events, algorithm, interval_us, rtt_us, eps)
    allowance = rate * 1.5 * interval_us / PER_US if cached and algorithm in BUCKETS else 0.0

    follow, free, nonfb = make(rate, rate), make(rate, rate), make(rate, rate)
    real, clock, order, free_admitted = 0, 0, 0, 0
    worst = {"over": 0.0, "bound": allowance, "at": None}
    within = True
    mismatches = []
    per_window = {}
    for i, e in enumerate(events):
        t = e["start_us"]
        window = per_window.setdefault(t // PER_US, [0, 0])
        if free.admits(t):
            free.add(t)
            free_admitted += 1
            window[1] += 1
        around = (t - eps, t, t + eps)
        if follow.admits(t) != e["admitted"]:
            kind = "real"
            if any(follow.admits(x) == e["admitted"] for x in around):
                kind = "clock"
            elif not e["admitted"]:
                later = [x["start_us"] for x in events[i + 1:] if x["start_us"] <= t + eps and x["admitted"]]
                if later:
                    alt = copy.deepcopy(follow)
                    for x in later:
                        alt.add(x)
                    if any(not alt.admits(x) for x in around):
                        kind = "order"
            real += kind == "real"
            clock += kind == "clock"
            order += kind == "order"
            mismatches.append({"t_us": t, "proxy": e["proxy"], "sluice": e["admitted"], "kind": kind})
        if e["admitted"]:
            window[0] += 1
            over = min(follow.over(x) for x in around)
            nf_over = min(nonfb.over(x) for x in around)
            flagged = cached and e["fallback"]
            bound = allowance + (over - nf_over) + (1 if flagged else 0) if cached else 0.0
            if nf_over - (1 if flagged else 0) > allowance + 1e-9:
                within = False
            if over > worst["over"] + 1e-9:
                worst = {"over": over, "bound": bound, "at": t}
            follow.add(t)
            if not flagged:
                nonfb.add(t)
    diffs = [s - r for s, r in per_window.values()]
    return {
        "sent": len(recs),
        "answered": len(events),
        "errors": sum(1 for r in recs if r["code"] not in (200, 429)),
        "sluice": sum(1 for e in events if e["admitted"]),
        "reference": free_admitted,
        "real": real, "clock": clock, "order": order,
        "window_over": max([0] + diffs), "window_under": min([0] + diffs),
        "over": worst["over"], "bound": worst["bound"], "within": within,
        "fallback_eligible": sum(1 for e in events if e.get("fallback")),
        "mismatches": mismatches,
        "send_lag_ms_max": max((r["sent"] - r["scheduled"]) * 1000 for r in recs),
    }


# ---------------------------------------------------------------------------------------------------------------


def row(algorithm, consistency, trace, a):
    bound = "0 (exact)" if consistency == "local" else f"{a['bound']:.1f}"
    return (f"| {algorithm} | {consistency} | {trace} | {a['sent']} | {a['sluice']} | {a['reference']} | "
            f"{a['sluice'] - a['reference']:+d} | +{a['window_over']} / {a['window_under']} | {a['real']} | "
            f"{a['clock']} / {a['order']} | {a['over']:.1f} | {bound} | {'yes' if a['within'] else '**no**'} |")


def main():
    workdir = os.path.join(ROOT, ".run", "bench-algorithms")
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    began = time.time()
    info = machine()
    version = tool_version([ARGS.envoy, "--version"]).split("version:")[-1].strip()
    info["envoy"] = version.split("/")[1] if version.count("/") >= 2 else version
    info["load_before"] = loadavg()
    offsets = traces(ARGS.requests, ARGS.seed)
    print(f"bench-algorithms: {', '.join(ARGS.only)} x {', '.join(ARGS.modes)}, {ARGS.requests}/s, traces "
          + ", ".join(f"{n} ({len(offsets[n])})" for n in ARGS.traces)
          + f"; {info['nproc']} CPUs, {info['cpu']}", file=sys.stderr)
    stack = None
    results, sessions = [], []
    try:
        if "cached" in ARGS.modes:
            stack = Stack(workdir, ARGS.redis_server, ARGS.service)
        for consistency in ARGS.modes:
            for algorithm in ARGS.only:
                if stack:
                    stack.check_alive()
                records, sinfo = run_session(algorithm, consistency, stack if consistency == "cached" else None,
                                             workdir, offsets)
                sinfo.update(algorithm=algorithm, consistency=consistency)
                sessions.append(sinfo)
                if records is None:
                    print(f"  {consistency}-{algorithm}: refused: {sinfo['refused']}", file=sys.stderr)
                    continue
                rtts = [r for r in sinfo["rtt_ms"] if r is not None]
                rtt_ms = max(rtts) if rtts else 200.0  # no sync measured: the callout timeout
                sinfo["rtt_max_ms"] = rtt_ms
                for trace in ARGS.traces:
                    a = analyse(algorithm, consistency, records[trace], ARGS.sync_ms * 1000, int(rtt_ms * 1000))
                    a.update(algorithm=algorithm, consistency=consistency, trace=trace)
                    results.append(a)
                    for m in a["mismatches"]:
                        if m["kind"] == "real" and consistency == "local":
                            print(f"    real mismatch: {trace} t={m['t_us'] / 1e6:.6f} sluice "
                                  f"{'admitted' if m['sluice'] else 'denied'}", file=sys.stderr)
                with open(os.path.join(workdir, f"{consistency}-{algorithm}.records.json"), "w") as f:
                    json.dump(records, f)
    finally:
        if stack:
            stack.stop()
    info["load_after"] = loadavg()
    took = time.time() - began
    with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump({"machine": info, "args": vars(ARGS), "seconds": took, "sessions": sessions,
                   "results": results}, f, indent=2)
    print(f"A limit of {ARGS.requests} requests per second (burst {ARGS.requests} for token_bucket and gcra), one "
          f"fresh key per trace; ε = {ARGS.epsilon_ms:g} ms. local: one Envoy, --concurrency "
          f"{ARGS.local_concurrency}; cached: {ARGS.proxies} Envoys, --concurrency {ARGS.cached_concurrency}, sync "
          f"every {ARGS.sync_ms} ms, fallback of {fallback_share(ARGS.requests, ARGS.proxies)} per second each. Envoy "
          f"{info['envoy']}; {info['nproc']} CPUs ({info['cpu']}); 1-minute load average {info['load_before']:.2f} "
          f"before, {info['load_after']:.2f} after; {took:.0f} s in all.\n")
    print("| algorithm | consistency | trace | sent | admitted: sluice | reference | difference | per second: "
          "most over / under | real mismatches | ambiguous: clock / order | over the limit (max) | bound | within |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for s in sessions:
        if "refused" in s:
            print(f"| {s['algorithm']} | {s['consistency']} | - | - | - | - | - | - | - | - | - | - | refused by the "
                  f"configuration: {s['refused']} |")
            continue
        for a in results:
            if a["algorithm"] == s["algorithm"] and a["consistency"] == s["consistency"]:
                print(row(a["algorithm"], a["consistency"], a["trace"], a))
    print("\nleaky_bucket shapes (holds requests until their slot) instead of admitting or denying: bench/shaping.py.")
    print("\nPer session: rule allowed / denied / unavailable (sum over proxies), syncs ok / failed, slowest sync round "
          "trip, connections per worker:\n")
    for s in sessions:
        if "refused" in s:
            continue
        st = s["stats"]
        total = {k: sum(x[k] for x in st) for k in st[0]}
        rtt = f", slowest sync {s['rtt_max_ms']:.0f} ms" if s["consistency"] == "cached" else ""
        print(f"- {s['consistency']} {s['algorithm']}: {total[f'rule.{RULE}.allowed']} / "
              f"{total[f'rule.{RULE}.denied']} / {total[f'rule.{RULE}.unavailable']}, syncs {total['sync.ok']} / "
              f"{total['sync.failed'] + total['sync.timeout']}{rtt}, workers "
              + " ; ".join("/".join(str(n) for n in w) for w in s["workers"]))
    lag = max((a["send_lag_ms_max"] for a in results), default=0)
    errors = sum(a["errors"] for a in results)
    print(f"\nLatest send after its scheduled time: {lag:.1f} ms; requests without a 200 or 429 in the access log: "
          f"{errors}.")
    print(f"bench-algorithms: done in {took:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20, help="the limit: requests per second")
    parser.add_argument("--sync-ms", type=int, default=100, help="sync interval of the cached proxies")
    parser.add_argument("--epsilon-ms", type=float, default=2.0,
                        help="a disagreement within this of an event of the definition is ambiguous")
    parser.add_argument("--connections", type=int, default=32, help="client threads (one connection per proxy each)")
    parser.add_argument("--proxies", type=int, default=3, help="Envoys sharing the cached limit")
    parser.add_argument("--local-concurrency", type=int, default=4, help="Envoy workers for local")
    parser.add_argument("--cached-concurrency", type=int, default=2, help="Envoy workers of each cached proxy")
    parser.add_argument("--seed", type=int, default=1, help="of the Poisson trace")
    parser.add_argument("--only", default=",".join(ALGORITHMS), help="comma-separated algorithms")
    parser.add_argument("--modes", default="local,cached", help="comma-separated: local, cached")
    parser.add_argument("--traces", default=",".join(TRACES), help="comma-separated traces")
    parser.add_argument("--envoy", default=os.environ.get("SLUICE_ENVOY", os.path.join(ROOT, ".venv/bin/envoy")))
    parser.add_argument("--wasm", default=os.environ.get(
        "SLUICE_WASM", os.path.join(ROOT, "target/wasm32-wasip1/release/sluice_filter.wasm")))
    parser.add_argument("--redis-server", default=os.environ.get("SLUICE_REDIS_SERVER",
                                                                 shutil.which("redis-server") or "redis-server"))
    parser.add_argument("--service", default=os.environ.get(
        "SLUICE_COUNTER_SERVICE", os.path.join(ROOT, "target/release/sluice-counter-service")))
    ARGS = parser.parse_args()
    ARGS.only = [a for a in ARGS.only.split(",") if a]
    ARGS.modes = [m for m in ARGS.modes.split(",") if m]
    ARGS.traces = [t for t in ARGS.traces.split(",") if t]
    for name, given, known in (("--only", ARGS.only, ALGORITHMS), ("--modes", ARGS.modes, ["local", "cached"]),
                               ("--traces", ARGS.traces, TRACES)):
        if not given or set(given) - set(known):
            sys.exit(f"bench: {name} takes some of {', '.join(known)}")
    main()
