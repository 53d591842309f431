#!/usr/bin/env python3
"""Load shedding under overload in real Envoy: no protection vs Envoy's adaptive_concurrency vs sluice, open loop.

Usage (from the repository root, after `make deps build-filter`; `make bench-overload` does both):
    .venv/bin/python bench/overload.py [--duration 8] [--loads 0.5,1,1.5,2,3,10] [--only none,adaptive-concurrency]
                                       [--workers 8] [--service-ms 25] [--static-limit N] [--concurrency 2]
                                       [--no-halving]

The upstream is `sluice-upstream` (crate overload/): --workers requests served at once, --service-ms each, the rest
queued FIFO without bound, so its capacity is workers / service time (8 / 25 ms = 320 req/s) and its latency grows
with the queue. A request Envoy gave up on (route timeout 1 s, then 504) is still served when its turn comes, as a
thread-pool server does. The load is `sluice-load` (same crate), open loop: request i leaves at i/R whatever
happened to the earlier ones, classes high:0.2,low:0.8 in `x-sluice-class` (the high class at most half the capacity:
5% at 10x, `classes()`).

For each variant and each offered load (a multiple of the capacity), a fresh upstream and a fresh Envoy
(--concurrency 2) are started, warmed up for 1 s at half the capacity, then loaded for --duration seconds:

- none: no protection (envoy/overload-none.yaml.tmpl);
- adaptive-concurrency: Envoy's envoy.filters.http.adaptive_concurrency, gradient controller
  (envoy/overload-adaptive-concurrency.yaml.tmpl);
- sluice-static, sluice-adaptive: the sluice filter's `shedding` (envoy/overload-sluice.yaml.tmpl) with a static
  in-flight limit (1.5 x workers unless --static-limit) or an adaptive one; see shedding() below;
- sluice-adaptive-critical: sluice-adaptive with the high class never shed (threshold null, as the default
  `critical` class), counted in flight but admitted over the limit.

and once, before them, an unloaded run (0.1 x capacity, no protection) for the unloaded p99. After each variant's
loads, the halving case (HALVING_* below): 1.5 x capacity offered for 12 s while the upstream's workers halve from
4 s to 8 s (the load generator itself calls the upstream's /capacity at those times, so each phase starts exactly
with its capacity), reported by phase, with how long the adaptive limits take to reach the new capacity and, from
each request's record (.run/bench-overload/*.timeline.csv), how many admitted requests of the half phase were over
the p99 target before any answer could have shown a limiter the halving.

Progress on stderr, markdown tables on stdout, the plot in bench/overload.svg (goodput and p99 of admitted requests
against offered load), and the configs, logs, load outputs and results.json in .run/bench-overload/. Builds nothing
but `cargo build --release -p sluice-overload`; the filter is $SLUICE_WASM or
target/wasm32-wasip1/release/sluice_filter.wasm. Every process it starts is stopped when its run ends, and killed
if the script dies. Standard library only.
"""

import argparse
import json
import math
import os
import re
import resource
import select
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse

sys.dont_write_bytecode = True  # no __pycache__ in bench/
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import NO_PROXY, die_with_parent, free_ports, render  # noqa: E402
from stack import ROOT, cpu_seconds, loadavg, machine, tool_version  # noqa: E402

# ---- What is compared: the variants, the loads and the sluice configurations, all in one place. ----

HIGH_SHARE = 0.2  # the high class's share of the offered load, up to HIGH_RATE_MAX
# ... but never more than half the capacity of high requests: a surge is the low class's (a crawler, a retry storm),
# and a high class beyond the capacity could not be served whatever the shedder (at 10x, 20% high would be twice
# the capacity). So 20% up to 2.5x, 5% at 10x.
HIGH_RATE_MAX = 0.5


def classes(factor):
    """sluice-load's --classes at `factor` x the capacity: each request's x-sluice-class."""
    high = min(HIGH_SHARE, HIGH_RATE_MAX / factor)
    return f"high:{high:.4g},low:{1 - high:.4g}"


LOADS = [0.5, 1, 1.5, 2, 3, 10]  # offered load, as multiples of the upstream's capacity
# The halving case: offered HALVING_LOAD x the full capacity for HALVING_S seconds; the upstream serves with half its
# workers from the first third to the second (GET /capacity?workers=N), so the capacity of the moment is full, half,
# full. The targets, per phase: goodput >= 90% of the capacity of the moment, p99 of admitted <= 2 x unloaded, the
# high class >= 99% served, an adaptive limit at the new capacity within 2 s (at most 1.5 x the workers after the
# halving, at least the workers after the restore).
HALVING_LOAD = 1.5
HALVING_S = 12.0
HALVING_SAMPLE_S = 0.2
UNLOADED = 0.1  # the unloaded run (no protection), for the unloaded p99
WARMUP = (0.5, 1.0)  # (load as a multiple of capacity, seconds) before each measured run
ROUTE_TIMEOUT_MS = 1000  # `timeout: 1s` of the route in every envoy/overload-*.yaml.tmpl


def shedding(limit, high=...):
    """sluice's configuration for the sluice variants: one bulkhead over every path, in-flight `limit`; the high
    class's threshold `high` (--high-threshold unless given; None: never shed, as the default `critical` class)."""
    high = ARGS.high_threshold if high is ... else high
    bulkhead = {
        "name": "upstream",
        "match": {"path_prefix": "/"},
        "limit": limit,
        "timeout_ms": 1000,
    }
    if ARGS.queue_wait_ms > 0:
        bulkhead["queue"] = {"size": 64, "max_wait_ms": ARGS.queue_wait_ms, "drop": "oldest"}
    return {
        "rules": [],
        "shedding": {
            "mode": "enforce",
            "class_header": "x-sluice-class",
            "default_class": "basic",
            "classes": {"high": high, "low": 0.7},
            "bulkheads": [bulkhead],
        },
    }


def static_limit():
    """The static in-flight limit: --static-limit, or 1.5 x the upstream's workers, rounded (12 for 8)."""
    return ARGS.static_limit if ARGS.static_limit is not None else int(math.floor(1.5 * ARGS.workers + 0.5))


SLUICE_ADAPTIVE_LIMIT = {"adaptive": {"min": 4, "max": 64, "initial": 16, "tolerance": 1.25, "window_ms": 100}}

# name -> (template, sluice configuration or None)
VARIANTS = {
    "none": ("overload-none.yaml.tmpl", None),
    "adaptive-concurrency": ("overload-adaptive-concurrency.yaml.tmpl", None),
    "sluice-static": ("overload-sluice.yaml.tmpl", lambda: shedding({"static": static_limit()})),
    "sluice-adaptive": ("overload-sluice.yaml.tmpl", lambda: shedding(SLUICE_ADAPTIVE_LIMIT)),
    "sluice-adaptive-critical": ("overload-sluice.yaml.tmpl", lambda: shedding(SLUICE_ADAPTIVE_LIMIT, high=None)),
}

# Envoy stats kept per run: counters as deltas over the measured run, gauges sampled every SAMPLE_S.
STATS_FILTER = (r"adaptive_concurrency|wasmcustom\.sluice|^cluster\.upstream\.upstream_(rq_timeout|rq_total|rq_pending_"
                r"overflow|cx_total|rq_[0-9]xx)$|^http\.edge\.downstream_rq_[0-9]xx$")
SAMPLE_S = 0.5
COLORS = {"none": "#d62728", "adaptive-concurrency": "#1f77b4", "sluice-static": "#2ca02c",
          "sluice-adaptive": "#9467bd", "sluice-adaptive-critical": "#8c564b"}


class Failed(Exception):
    """A run that could not be measured (Envoy refused the configuration, a process did not start)."""


def sluice_json(config):
    return json.dumps(config, separators=(",", ":"))


def get_json(url, timeout=2.0):
    with NO_PROXY.open(url, timeout=timeout) as r:
        return json.loads(r.read().decode())


def log_excerpt(path, limit=2):
    """The lines of a log most likely to say why a process failed: the filter's own (`wasm log sluice ...`: an
    invalid configuration names its field), else Envoy's errors, without their timestamp and source prefix."""
    try:
        with open(path, errors="replace") as f:
            lines = [line.rstrip() for line in f if line.strip()]
    except OSError:
        return ""
    own = [line[line.index("wasm log "):] for line in lines if "wasm log " in line]
    errors = [re.sub(r"^(\[[^\]]*\])+ \[[^\]]*\] ", "", line) for line in lines
              if re.search(r"\]\[(critical|error)\]", line)]
    return " | ".join((own or errors or lines)[-limit:])


class Process:
    """A child process with its log and pid file, killed with this script (PR_SET_PDEATHSIG)."""

    def __init__(self, args, workdir, name, stdout=None):
        self.name = name
        self.log_path = os.path.join(workdir, f"{name}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(args, stdout=stdout or self.log, stderr=self.log, preexec_fn=die_with_parent)
        self.pidfile = os.path.join(workdir, f"{name.split('.')[-1]}.pid")
        with open(self.pidfile, "w") as f:
            f.write(str(self.proc.pid))

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        self.log.close()
        if os.path.exists(self.pidfile):
            os.remove(self.pidfile)


class Upstream(Process):
    def __init__(self, workdir, tag):
        args = [os.path.join(BIN, "sluice-upstream"), "--port", "0", "--workers", str(ARGS.workers),
                "--service-ms", str(ARGS.service_ms)]
        super().__init__(args, workdir, f"{tag}.upstream", stdout=subprocess.PIPE)
        ready, _, _ = select.select([self.proc.stdout], [], [], 10)
        line = self.proc.stdout.readline().decode() if ready else ""
        try:
            self.port = json.loads(line)["port"]
        except (ValueError, KeyError):
            self.stop()
            raise Failed(f"sluice-upstream did not start ({line.strip()!r}): {log_excerpt(self.log_path)}")

    def stats(self):
        return get_json(f"http://127.0.0.1:{self.port}/stats")


class Envoy(Process):
    def __init__(self, template, sluice_config, upstream_port, workdir, tag):
        self.listen, self.admin = free_ports(2)
        values = {"LISTEN_PORT": str(self.listen), "ADMIN_PORT": str(self.admin), "UPSTREAM_PORT": str(upstream_port)}
        if sluice_config is not None:
            values.update(WASM=ARGS.wasm, PLUGIN_CONFIG=sluice_json(sluice_config))
        config = os.path.join(workdir, f"{tag}.envoy.yaml")
        with open(config, "w") as f:
            f.write(render(template, values))
        args = [ARGS.envoy, "-c", config, "--concurrency", str(ARGS.concurrency), "--disable-hot-restart",
                "--log-level", "warn"]
        super().__init__(args, workdir, f"{tag}.envoy")
        deadline = time.time() + 30
        while True:
            if self.proc.poll() is not None:
                self.stop()
                raise Failed(f"Envoy exited with {self.proc.returncode} at start: {log_excerpt(self.log_path)}")
            try:
                with NO_PROXY.open(f"http://127.0.0.1:{self.admin}/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                self.stop()
                raise Failed(f"Envoy not ready within 30 s: {log_excerpt(self.log_path)}")
            time.sleep(0.05)
        # Ready is not enough: a filter that failed to configure answers every request with an error.
        status = None
        for _ in range(20):
            try:
                with NO_PROXY.open(f"http://127.0.0.1:{self.listen}/health", timeout=2) as r:
                    status = r.status
            except urllib.error.HTTPError as e:
                status = e.code
            except OSError as e:
                status = str(e)
            if status == 200:
                return
            time.sleep(0.1)
        self.stop()
        raise Failed(f"Envoy answers GET /health with {status}, not 200: {log_excerpt(self.log_path)}")

    def stats(self):
        """{name: value} of the counters and gauges matching STATS_FILTER."""
        query = urllib.parse.urlencode({"filter": STATS_FILTER})
        with NO_PROXY.open(f"http://127.0.0.1:{self.admin}/stats?{query}", timeout=5) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if value.isdigit():
                out[name] = int(value)
        return out


def machine_busy():
    """(busy, total) jiffies of every CPU, from /proc/stat: the whole machine, the benchmark and anything else."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def load(url, rate, seconds, workdir, tag, sample=None, phases=None, sample_s=SAMPLE_S, calls=()):
    """Runs sluice-load to the end (bounded), calling sample() every sample_s meanwhile; its JSON and CPU seconds.
    `calls`: (seconds, url) the load GETs at that time on its own clock, so a phase starts exactly with its call."""
    args = [os.path.join(BIN, "sluice-load"), "--url", url, "--rate", f"{rate:g}", "--duration-s", f"{seconds:g}",
            "--timeout-ms", str(ARGS.timeout_ms), "--classes", classes(rate / CAPACITY)]
    if phases:
        args += ["--phases", ",".join(f"{p:g}" for p in phases),
                 "--timeline", os.path.join(workdir, f"{tag}.timeline.csv")]
    for at, call in calls:
        args += ["--call", f"{at:g}={call}"]
    out_path = os.path.join(workdir, f"{tag}.load.json")
    err_path = os.path.join(workdir, f"{tag}.load.log")
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(args, stdout=out, stderr=err, preexec_fn=die_with_parent)
        bound = seconds + ARGS.timeout_ms / 1000 + 30  # sending, its stragglers, and a margin
        deadline = time.time() + bound
        try:
            while proc.poll() is None:
                if time.time() > deadline:
                    raise Failed(f"sluice-load did not finish within {bound:.0f} s")
                if sample:
                    sample()
                try:
                    proc.wait(sample_s)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    children_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        with open(err_path) as f:
            raise Failed(f"sluice-load exited with {proc.returncode}: {f.read().strip()[-300:]}")
    with open(out_path) as f:
        result = json.load(f)
    cpu = (children_after.ru_utime + children_after.ru_stime) - (children_before.ru_utime + children_before.ru_stime)
    return result, cpu


def measure(variant, factor, workdir, tag, halving=False):
    """One run: fresh upstream and Envoy, warm-up, measured load. The run's record (or Failed). With `halving`, the
    upstream's workers halve from the first third of the run to the second."""
    template, sluice = VARIANTS[variant]
    rate = factor * CAPACITY
    seconds = HALVING_S if halving else ARGS.duration
    switches = [(HALVING_S / 3, max(1, ARGS.workers // 2)), (2 * HALVING_S / 3, ARGS.workers)] if halving else []
    upstream = Upstream(workdir, tag)
    try:
        envoy = Envoy(template, sluice() if sluice else None, upstream.port, workdir, tag)
        try:
            url = f"http://127.0.0.1:{envoy.listen}/api/work"
            load(url, WARMUP[0] * CAPACITY, WARMUP[1], workdir, f"{tag}.warmup")
            samples = []
            t0 = time.time()

            def sample():
                try:
                    gauges = {k: v for k, v in envoy.stats().items()
                              if re.search(r"limit|rtt_msecs|in_?flight|queue", k)}
                    up = upstream.stats()
                    samples.append({"t": round(time.time() - t0, 2), "upstream_in_service": up["in_service"],
                                    "upstream_queued": up["queued"], **gauges})
                except (OSError, ValueError, KeyError):
                    pass

            envoy_before, up_before = envoy.stats(), upstream.stats()
            cpu_before = {"envoy": cpu_seconds(envoy.proc.pid), "upstream": cpu_seconds(upstream.proc.pid)}
            busy_before, wall = machine_busy(), time.time()
            phases = [at for at, _ in switches] if halving else None
            calls = [(at, f"http://127.0.0.1:{upstream.port}/capacity?workers={workers}") for at, workers in switches]
            result, load_cpu = load(url, rate, seconds, workdir, tag, sample, phases,
                                    HALVING_SAMPLE_S if halving else SAMPLE_S, calls)
            if any(c.get("status") != 200 for c in result.get("calls", [])):
                raise Failed(f"the upstream's capacity did not change: {result.get('calls')}")
            switched = [{"t": at, "workers": workers} for at, workers in switches]
            # The samples' times onto the load's clock (that of the switches and the phases): the load starts
            # after its process does, some tens of milliseconds after t0.
            shift = result.get("start_unix_s", t0) - t0
            for s in samples:
                s["t"] = round(s["t"] - shift, 3)
            busy_after, wall = machine_busy(), time.time() - wall
            cpu = {k: cpu_seconds(p.proc.pid) - cpu_before[k] for k, p in (("envoy", envoy), ("upstream", upstream))}
            cpu["load"] = load_cpu
            envoy_after, up_after = envoy.stats(), upstream.stats()
        finally:
            envoy.stop()
    finally:
        upstream.stop()
    ncpu = os.cpu_count() or 1
    machine_pct = 100 * (busy_after[0] - busy_before[0]) / max(1, busy_after[1] - busy_before[1])
    return {
        "variant": variant, "factor": factor, "offered": rate, "load": result,
        # Envoy's stats (STATS_FILTER): the change over the measured run (counters), and the values at its end (gauges).
        "envoy_delta": {k: v - envoy_before.get(k, 0) for k, v in envoy_after.items()},
        "envoy_after": envoy_after,
        "upstream": {"served": up_after["served"] - up_before["served"], "max_queue": up_after["max_queue"],
                     "failed": up_after["failed"] - up_before["failed"],
                     "service_ms_mean": up_after["service_ms_mean"]},
        # CPU over the measured run, as a share of one core (load: the whole of sluice-load, sending and waiting).
        "cpu_pct": {k: round(100 * v / wall, 1) for k, v in cpu.items()},
        "machine_busy_pct": round(machine_pct, 1), "cpus": ncpu,
        "samples": samples, "halving": halving, "switched": switched,
        "timeline": os.path.join(workdir, f"{tag}.timeline.csv") if halving else None,
    }


def progress(run):
    ld = run["load"]
    o = ld["overall"]
    cls = ld["classes"]
    status = [f"{k}:{v}" for k, v in o["status"].items()]
    status += [f"{k}:{o[k]}" for k in ("errors", "timeouts") if o[k]]
    print(f"  {run['variant']:20} {run['factor']:>4g}x {run['offered']:>6.0f} req/s  "
          f"sent {ld['achieved_rate']:>7.1f}/s  goodput {o['goodput']:>6.1f}/s  "
          f"p50 {fmt_ms(o['p50_ms'])}  p99 {fmt_ms(o['p99_ms'])} ms  "
          f"high {pct(cls.get('high'))}  low {pct(cls.get('low'))}  [{', '.join(status)}]"
          f"  cpu envoy {run['cpu_pct']['envoy']:.0f}% load {run['cpu_pct']['load']:.0f}% "
          f"machine {run['machine_busy_pct']:.0f}%", file=sys.stderr)


def fmt_ms(ms):
    if ms is None:
        return "-"
    return f"{ms:.1f}" if ms < 100 else f"{ms:.0f}"


def pct(stats):
    return f"{100 * stats['success_rate']:.1f}%" if stats and stats["sent"] else "-"


def statuses(o):
    parts = [f"{k}: {v}" for k, v in o["status"].items()]
    if o["errors"]:
        parts.append(f"errors: {o['errors']}")
    if o["timeouts"]:
        parts.append(f"timeouts: {o['timeouts']}")
    return ", ".join(parts) or "-"


def tables(runs, unloaded, failures, info):
    lines = [
        f"Upstream {ARGS.workers} workers x {ARGS.service_ms} ms = {CAPACITY:.0f} req/s (FIFO queue, no bound), "
        f"open-loop load {ARGS.duration:g} s per run, classes high:0.2,low:0.8 (high at most 0.5 x capacity), route timeout 1 s; Envoy {info['envoy']} "
        f"--concurrency {ARGS.concurrency}; {info['nproc']} CPUs ({info['cpu']}); 1-minute load average "
        f"{info['load_before']:.2f} before, {info['load_after']:.2f} after.",
        "",
    ]
    if unloaded:
        o = unloaded["load"]["overall"]
        lines += [f"Unloaded ({UNLOADED:g} x capacity = {unloaded['offered']:.0f} req/s, no protection): "
                  f"p50 {fmt_ms(o['p50_ms'])} ms, p99 {fmt_ms(o['p99_ms'])} ms, {statuses(o)}.", ""]
    for variant in VARIANT_ORDER:
        lines.append(f"### {variant}")
        lines.append("")
        if variant in failures:
            lines += [f"**Not measured:** {failures[variant]}", ""]
            continue
        lines += [
            "| offered x | offered req/s | sent req/s | goodput req/s | goodput / capacity | p50 ms | p99 ms "
            "| high ok | low ok | statuses | upstream max queue | CPU busy |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |",
        ]
        for r in (r for r in runs if r["variant"] == variant and not r.get("halving")):
            ld, o = r["load"], r["load"]["overall"]
            flag = "" if abs(ld["achieved_rate"] / r["offered"] - 1) <= 0.02 else " (!)"
            lines.append(
                f"| {r['factor']:g} | {r['offered']:.0f} | {ld['achieved_rate']:.0f}{flag} | {o['goodput']:.0f} | "
                f"{o['goodput'] / CAPACITY:.2f} | {fmt_ms(o['p50_ms'])} | {fmt_ms(o['p99_ms'])} | "
                f"{pct(ld['classes'].get('high'))} | {pct(ld['classes'].get('low'))} | {statuses(o)} | "
                f"{r['upstream']['max_queue']} | {r['machine_busy_pct']:.0f}% |")
        lines.append("")
    halving = [r for r in runs if r.get("halving")]
    if halving:
        unloaded_p99 = unloaded["load"]["overall"]["p99_ms"] if unloaded else None
        lines += [
            f"### Capacity halving: {HALVING_LOAD:g} x {CAPACITY:.0f} req/s offered for {HALVING_S:g} s; the upstream "
            f"serves with {max(1, ARGS.workers // 2)} workers instead of {ARGS.workers} from "
            f"{HALVING_S / 3:g} s to {2 * HALVING_S / 3:g} s",
            "",
            "| variant | goodput / capacity of the moment (full, half, full) | p99 ms (full, half, full) "
            "| high ok (full, half, full) | limit at the new capacity after the halving, s | after the restore, s "
            "| half phase: over the p99 target, before any answer was | of them, 1% of admitted |",
            "| --- | --- | --- | --- | ---: | ---: | ---: | ---: |",
        ]
        for r in halving:
            caps = [CAPACITY, CAPACITY * max(1, ARGS.workers // 2) / ARGS.workers, CAPACITY]
            ph = r["load"].get("phases", [])
            good = ", ".join(f"{p['overall']['goodput'] / c:.2f}" for p, c in zip(ph, caps))
            p99 = ", ".join(fmt_ms(p["overall"]["p99_ms"]) for p in ph)
            high = ", ".join(pct(p["classes"].get("high")) for p in ph)
            down, up = settle_times(r)
            blind = blind_slow(r, 2 * unloaded_p99) if unloaded_p99 else None
            blind = ("-", "-") if blind is None else (f"{blind[0]}", f"{blind[1]}, {blind[2] / 100:.1f}")
            lines.append(f"| {r['variant']} | {good} | {p99} | {high} | {down} | {up} | {blind[0]} | {blind[1]} |")
        lines += ["", f"Unloaded p99: {fmt_ms(unloaded_p99)} ms (target: p99 of admitted at most twice that). "
                  "Each phase counts the requests sent in it; the limit is Envoy's `concurrency_limit` gauge "
                  "(adaptive-concurrency) or sluice's `limit` gauge, sampled every "
                  f"{HALVING_SAMPLE_S:g} s; \"at the new capacity\": at most 1.5 x the workers after the halving, at "
                  "least the workers after the restore; - when the variant has no adaptive limit. \"Over the p99 target, before "
                  "any answer was\": the half phase's admitted requests slower than the target that were sent before the "
                  "first answer after the halving slower than the target arrived, so admitted before any answer over the "
                  "target had come back; when they are more than 1% of the phase's admitted requests, a limiter that "
                  "reacts to answers over the target could not have met the p99 target in that run, however fast.", ""]
    lines += [
        "Goodput: 2xx answers per second of the run (2xx / duration). "
        "p50, p99: latency of the 2xx answers, from when each request was sent. high ok, low ok: share of "
        "each class answered 2xx. sent req/s: the rate the generator achieved, (!) when more than 2% off. "
        "CPU busy: all CPUs of the machine over the run, the benchmark and anything else.",
    ]
    return "\n".join(lines)


def blind_slow(run, target_ms):
    """In the half phase of a halving run: (admitted requests slower than target_ms sent before the first answer after
    the halving slower than target_ms arrived, all of them, the phase's admitted), from the load's timeline; None
    without one."""
    path = run.get("timeline")
    if not path or not os.path.exists(path) or len(run.get("switched", [])) < 2:
        return None
    down, up = run["switched"][0]["t"], run["switched"][1]["t"]
    with open(path) as f:
        ok = [(float(sent), float(ms)) for sent, _, status, ms in (line.strip().split(",") for line in f.readlines()[1:])
              if status.startswith("2")]
    first = min((sent + ms / 1000 for sent, ms in ok if sent + ms / 1000 > down and ms > target_ms), default=up)
    phase = [(sent, ms) for sent, ms in ok if down <= sent < up]
    slow = [sent for sent, ms in phase if ms > target_ms]
    return sum(1 for sent in slow if sent < first), len(slow), len(phase)


def settle_times(run):
    """Seconds from each capacity switch to the first sample of the adaptive limit at the new capacity ('-' without
    an adaptive limit, 'never' when it did not get there before the next switch or the end)."""
    def limit(sample):
        for k, v in sample.items():
            if k.endswith("concurrency_limit") or re.search(r"wasmcustom\.sluice\.shed\.[^.]+\.limit$", k):
                return v
        return None
    if run["variant"] not in ("adaptive-concurrency", "sluice-adaptive", "sluice-adaptive-critical") or len(run.get("switched", [])) < 2:
        return "-", "-"
    (down, half), (up, full) = [(s["t"], s["workers"]) for s in run["switched"][:2]]
    out = []
    for start, end, ok in ((down, up, lambda v: v <= 1.5 * half), (up, float("inf"), lambda v: v >= full)):
        hit = next((s["t"] - start for s in run["samples"]
                    if start <= s["t"] < end and limit(s) is not None and ok(limit(s))), None)
        out.append("never" if hit is None else f"{hit:.1f}")
    return tuple(out)


# ---- The plot: hand-made SVG, two panels. ----

def svg_plot(runs, unloaded, failures, path):
    width, height = 1000, 450
    panel_w, panel_h = 400, 290
    origins = [(80, 90), (580, 90)]  # top-left of each panel's plot area
    factors = sorted({r["factor"] for r in runs}) or LOADS
    x_max = max(factors + [1]) * 1.1
    goodputs = [r["load"]["overall"]["goodput"] for r in runs]
    y0_max = max(goodputs + [CAPACITY]) * 1.15
    p99s = [r["load"]["overall"]["p99_ms"] for r in runs if r["load"]["overall"]["p99_ms"]]
    if unloaded and unloaded["load"]["overall"]["p99_ms"]:
        p99s.append(unloaded["load"]["overall"]["p99_ms"])
    lo = 10 ** math.floor(math.log10(min(p99s))) if p99s else 10
    hi = max(p99s + [ROUTE_TIMEOUT_MS]) * 1.6
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{width / 2}" y="22" text-anchor="middle" font-size="15">Overload: open-loop load against an '
           f'upstream of {CAPACITY:.0f} req/s ({ARGS.workers} workers x {ARGS.service_ms} ms), Envoy --concurrency '
           f'{ARGS.concurrency}</text>']

    def sx(ox, f):
        return ox + f / x_max * panel_w

    def sy_lin(oy, v):
        return oy + panel_h - v / y0_max * panel_h

    def sy_log(oy, v):
        v = min(max(v, lo), hi)
        return oy + panel_h - (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo)) * panel_h

    def axes(ox, oy, title, ylabel, yticks, sy):
        out.append(f'<text x="{ox + panel_w / 2}" y="{oy - 10}" text-anchor="middle" font-size="13">{title}</text>')
        out.append(f'<rect x="{ox}" y="{oy}" width="{panel_w}" height="{panel_h}" fill="none" stroke="#333"/>')
        for f in [0] + factors:
            x = sx(ox, f)
            out.append(f'<line x1="{x:.1f}" y1="{oy}" x2="{x:.1f}" y2="{oy + panel_h}" stroke="#eee"/>')
            out.append(f'<text x="{x:.1f}" y="{oy + panel_h + 16}" text-anchor="middle">{f:g}</text>')
        for v, label in yticks:
            y = sy(oy, v)
            out.append(f'<line x1="{ox}" y1="{y:.1f}" x2="{ox + panel_w}" y2="{y:.1f}" stroke="#eee"/>')
            out.append(f'<text x="{ox - 6}" y="{y + 4:.1f}" text-anchor="end">{label}</text>')
        out.append(f'<text x="{ox + panel_w / 2}" y="{oy + panel_h + 36}" text-anchor="middle">'
                   f'offered load (x capacity, {CAPACITY:.0f} req/s)</text>')
        out.append(f'<text transform="translate({ox - 55},{oy + panel_h / 2}) rotate(-90)" '
                   f'text-anchor="middle">{ylabel}</text>')

    # Left: goodput, with what an ideal shedder delivers: min(offered, capacity).
    ox, oy = origins[0]
    step = 10 ** math.floor(math.log10(y0_max / 2))
    step = next(s for s in (step, 2 * step, 5 * step, 10 * step) if y0_max / s <= 8)
    axes(ox, oy, "Goodput (2xx per second)", "goodput, req/s",
         [(v * step, f"{v * step:g}") for v in range(int(y0_max / step) + 1)], sy_lin)
    ideal = [(0, 0), (1, CAPACITY), (x_max, CAPACITY)]
    out.append('<polyline fill="none" stroke="#999" stroke-dasharray="5,4" points="'
               + " ".join(f"{sx(ox, f):.1f},{sy_lin(oy, v):.1f}" for f, v in ideal) + '"/>')
    out.append(f'<text x="{sx(ox, x_max) - 4:.1f}" y="{sy_lin(oy, CAPACITY) - 5:.1f}" text-anchor="end" '
               f'fill="#777">capacity</text>')
    # Right: p99 of the 2xx answers, log scale, with the unloaded p99 and the route timeout.
    ox, oy = origins[1]
    ticks = [m * 10 ** e for e in range(int(math.log10(lo)), int(math.log10(hi)) + 1) for m in (1, 2, 5)]
    axes(ox, oy, "p99 latency of admitted (2xx) requests", "p99, ms (log)",
         [(t, f"{t:g}") for t in ticks if lo <= t <= hi], sy_log)
    refs = [(ROUTE_TIMEOUT_MS, "route timeout 1 s")]
    if unloaded and unloaded["load"]["overall"]["p99_ms"]:
        refs.append((unloaded["load"]["overall"]["p99_ms"],
                     f"unloaded p99 {fmt_ms(unloaded['load']['overall']['p99_ms'])} ms"))
    for v, label in refs:
        y = sy_log(oy, v)
        out.append(f'<line x1="{ox}" y1="{y:.1f}" x2="{ox + panel_w}" y2="{y:.1f}" stroke="#999" '
                   f'stroke-dasharray="5,4"/>')
        out.append(f'<text x="{ox + panel_w - 4}" y="{y - 5:.1f}" text-anchor="end" fill="#777">{label}</text>')

    for variant in VARIANT_ORDER:
        mine = sorted((r for r in runs if r["variant"] == variant and not r.get("halving")), key=lambda r: r["factor"])
        color = COLORS.get(variant, "#333")
        for (ox, oy), key, sy in ((origins[0], "goodput", sy_lin), (origins[1], "p99_ms", sy_log)):
            pts = [(sx(ox, r["factor"]), sy(oy, r["load"]["overall"][key])) for r in mine
                   if r["load"]["overall"][key] is not None]
            if len(pts) > 1:
                out.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="'
                           + " ".join(f"{x:.1f},{y:.1f}" for x, y in pts) + '"/>')
            for x, y in pts:
                out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3.5" fill="{color}"/>')
    # Legend, one row under the title.
    x = 80
    for variant in VARIANT_ORDER:
        label = variant + (" (not measured)" if variant in failures else "")
        color = COLORS.get(variant, "#333")
        out.append(f'<line x1="{x}" y1="48" x2="{x + 22}" y2="48" stroke="{color}" stroke-width="2"/>')
        out.append(f'<circle cx="{x + 11}" cy="48" r="3.5" fill="{color}"/>')
        out.append(f'<text x="{x + 28}" y="52">{label}</text>')
        x += 42 + 6.5 * len(label)
    out.append(f'<text x="10" y="{height - 8}" fill="#777" font-size="10">bench/overload.py, {ARGS.duration:g} s '
               f'per point, classes high:0.2 (at most 0.5 x capacity), low the rest, route timeout 1 s</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def build():
    cargo = os.environ.get("CARGO", "cargo")
    print("bench-overload: cargo build --release -p sluice-overload", file=sys.stderr)
    done = subprocess.run([cargo, "build", "--release", "-p", "sluice-overload"], cwd=ROOT, stdout=sys.stderr,
                          preexec_fn=die_with_parent)
    if done.returncode != 0:
        sys.exit("bench-overload: the build of sluice-overload failed")


def main():
    workdir = os.path.join(ROOT, ".run", "bench-overload")
    os.makedirs(workdir, exist_ok=True)
    for name in os.listdir(workdir):
        if os.path.isfile(os.path.join(workdir, name)):
            os.remove(os.path.join(workdir, name))
    build()
    info = machine()
    version = tool_version([ARGS.envoy, "--version"]).split("version:")[-1].strip()  # <sha>/1.36.4/Clean/...
    info["envoy"] = version.split("/")[1] if version.count("/") >= 2 else version
    info["load_before"] = loadavg()
    print(f"bench-overload: {len(VARIANT_ORDER)} variant(s) x loads {','.join(f'{f:g}' for f in ARGS.loads)} x "
          f"{CAPACITY:.0f} req/s, {ARGS.duration:g} s each, Envoy --concurrency {ARGS.concurrency}; "
          f"{info['nproc']} CPUs, {info['cpu']}", file=sys.stderr)

    runs, failures, unloaded = [], {}, None
    results_path = os.path.join(workdir, "results.json")

    def save():
        with open(results_path, "w") as f:
            json.dump({"machine": info, "args": vars(ARGS), "capacity": CAPACITY, "classes": {f: classes(f) for f in ARGS.loads},
                       "sluice": {v: VARIANTS[v][1]() for v in VARIANT_ORDER if VARIANTS[v][1]},
                       "unloaded": unloaded, "failures": failures, "runs": runs}, f, indent=2)

    try:
        unloaded = measure("none", UNLOADED, workdir, "unloaded")
        unloaded["variant"] = "unloaded"
        progress(unloaded)
    except Failed as e:
        print(f"  unloaded run failed: {e}", file=sys.stderr)
    for variant in VARIANT_ORDER:
        if VARIANTS[variant][1] and not os.path.isfile(ARGS.wasm):
            failures[variant] = f"no filter at {ARGS.wasm} (run `make build-filter`)"
            print(f"  {variant:20} not measured: {failures[variant]}", file=sys.stderr)
            continue
        for factor in ARGS.loads:
            tag = f"{variant}-{factor:g}x"
            try:
                run = measure(variant, factor, workdir, tag)
            except Failed as e:
                # The same configuration fails the same way at every load: report it once, go on with the others.
                failures[variant] = f"{e} (logs: .run/bench-overload/{tag}.*)"
                print(f"  {variant:20} not measured: {failures[variant]}", file=sys.stderr)
                break
            runs.append(run)
            progress(run)
            rate = run["load"]["achieved_rate"]
            if abs(rate / run["offered"] - 1) > 0.02:
                print(f"  warning: the generator sent {rate:.1f} req/s of {run['offered']:.0f} offered "
                      f"(send lag p99 {run['load']['send_lag_ms']['p99']} ms)", file=sys.stderr)
            save()
        if ARGS.halving and variant not in failures:
            try:
                run = measure(variant, HALVING_LOAD, workdir, f"{variant}-halving", halving=True)
            except Failed as e:
                print(f"  {variant:20} halving not measured: {e}", file=sys.stderr)
                continue
            runs.append(run)
            progress(run)
            print(f"  {variant:20} halving: goodput by phase "
                  + ", ".join(f"{p['overall']['goodput']:.0f}/s" for p in run["load"].get("phases", []))
                  + f"; limit settles {settle_times(run)}", file=sys.stderr)
            save()
    info["load_after"] = loadavg()
    save()
    svg_plot(runs, unloaded, failures, ARGS.svg)
    print(f"bench-overload: results in {os.path.relpath(results_path, ROOT)}, plot in "
          f"{os.path.relpath(ARGS.svg, ROOT)}", file=sys.stderr)
    print(tables(runs, unloaded, failures, info))


def on_sigterm(*_):
    sys.exit(143)  # unwinds through every `finally`, so each process is stopped


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=8, help="seconds of each measured run (default 8)")
    parser.add_argument("--loads", default=",".join(f"{f:g}" for f in LOADS),
                        help="offered loads, multiples of the capacity (default %(default)s)")
    parser.add_argument("--only", help=f"comma-separated variants (default: all of {', '.join(VARIANTS)})")
    parser.add_argument("--workers", type=int, default=8, help="upstream requests served at once (default 8)")
    parser.add_argument("--service-ms", type=int, default=25, help="upstream service time, ms (default 25)")
    parser.add_argument("--queue-wait-ms", type=int, default=15,
                        help="sluice's queue: max_wait_ms per waiter (default 15; 0: no queue, 503 at once)")
    parser.add_argument("--high-threshold", type=float, default=1.0,
                        help="utilization above which sluice sheds the high class (low: 0.7)")
    parser.add_argument("--static-limit", type=int, help="sluice-static's in-flight limit (default 1.5 x workers)")
    parser.add_argument("--timeout-ms", type=int, default=5000,
                        help="sluice-load's timeout of each request, ms (default 5000; Envoy's route times out at 1 s)")
    parser.add_argument("--concurrency", type=int, default=2, help="Envoy worker threads (default 2)")
    parser.add_argument("--no-halving", dest="halving", action="store_false",
                        help="skip the case where the upstream's capacity halves in the middle of the run")
    parser.add_argument("--envoy", default=os.environ.get("SLUICE_ENVOY", os.path.join(ROOT, ".venv/bin/envoy")))
    parser.add_argument("--wasm", default=os.environ.get(
        "SLUICE_WASM", os.path.join(ROOT, "target/wasm32-wasip1/release/sluice_filter.wasm")))
    parser.add_argument("--svg", default=os.path.join(ROOT, "bench", "overload.svg"), help="where the plot goes")
    ARGS = parser.parse_args()
    try:
        ARGS.loads = [float(x) for x in ARGS.loads.split(",") if x.strip()]
    except ValueError:
        sys.exit(f"bench-overload: --loads {ARGS.loads!r}: expected numbers like 0.5,1,2")
    if not ARGS.loads or min(ARGS.loads) <= 0 or ARGS.duration <= 0 or ARGS.workers <= 0 or ARGS.service_ms <= 0:
        sys.exit("bench-overload: --loads, --duration, --workers and --service-ms must be > 0")
    if ARGS.static_limit is not None and ARGS.static_limit <= 0:
        sys.exit("bench-overload: --static-limit must be > 0")
    VARIANT_ORDER = list(VARIANTS)
    if ARGS.only:
        keep = [v.strip() for v in ARGS.only.split(",")]
        unknown = [v for v in keep if v not in VARIANTS]
        if unknown:
            sys.exit(f"bench-overload: unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
        VARIANT_ORDER = [v for v in VARIANTS if v in keep]
    CAPACITY = ARGS.workers * 1000 / ARGS.service_ms
    BIN = os.path.join(os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target")), "release")
    signal.signal(signal.SIGTERM, on_sigterm)
    main()
