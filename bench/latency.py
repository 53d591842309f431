#!/usr/bin/env python3
"""Request latency of sluice's consistency modes in real Envoy: no limiter, local, cached, strict, one run.

Usage (from the repository root, after `make deps build`; `make bench-latency` does both):
    .venv/bin/python bench/latency.py [--rounds 3] [--duration 10] [--connections 8] [--threads 2]
                                      [--concurrency 2]

One redis-server (no persistence) and one sluice-counter-service are started on free loopback ports for the
whole run, by the stack binary (`sluice-stack`, see bench/stack.py). Each round starts a fresh Envoy per variant
(bench.py's Envoy, from a template) (rotating order), warms it up for 2 s, then runs
`wrk -t<threads> -c<connections> -d<duration>s --latency` against its edge listener:

- none: no limiter (envoy/no-limiter.yaml.tmpl);
- sluice-local, sluice-cached, sluice-strict: sluice (envoy/sluice-service-bench.yaml.tmpl, with the cluster
  `sluice_service` pointing at the counter service) with one rule keyed by client IP, 1,000,000,000 requests per
  second (nothing is denied), `"consistency"` local, cached or strict; the same `service` block in all three
  (sync every 100 ms, callout timeout 200 ms).

Prints markdown tables (medians over the rounds, then every run with the filter's own counters: allowed,
denied, strict checks sent and failed, syncs sent / ok / failed, so a run decided by a fallback instead of the
service shows). Raw wrk outputs, Envoy configs and logs, results.json go to .run/bench-latency/.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

sys.dont_write_bytecode = True  # no __pycache__ in bench/
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import Envoy, parse_wrk, wrk  # noqa: E402
from stack import ROOT, Stack, loadavg, machine, tool_version  # noqa: E402

LIMIT = 1_000_000_000  # per second, burst the same: nothing is ever denied
SERVICE_TEMPLATE = "sluice-service-bench.yaml.tmpl"
STATS = {
    "allowed": "wasmcustom.sluice.rule.bench.allowed",
    "denied": "wasmcustom.sluice.rule.bench.denied",
    "unavailable": "wasmcustom.sluice.rule.bench.unavailable",
    "check_sent": "wasmcustom.sluice.check.sent",
    "check_failed": "wasmcustom.sluice.check.failed",
    "sync_sent": "wasmcustom.sluice.sync.sent",
    "sync_ok": "wasmcustom.sluice.sync.ok",
    "sync_failed": "wasmcustom.sluice.sync.failed",
    "sync_timeout": "wasmcustom.sluice.sync.timeout",
}


def sluice_config(consistency, token):
    rule = {
        "name": "bench",
        "match": {"path_prefix": "/api/"},
        "key": ["client_ip"],
        "limits": [{"requests": LIMIT, "per": "second", "burst": LIMIT}],
        "mode": "enforce",
        "consistency": consistency,
    }
    service = {"cluster": "sluice_service", "token": token, "timeout_ms": 200, "sync_interval_ms": 100}
    return json.dumps({"headers": "legacy", "service": service, "rules": [rule]}, separators=(",", ":"))


VARIANTS = ["none", "sluice-local", "sluice-cached", "sluice-strict"]


def envoy_for(variant, service_port, token, workdir, tag):
    if variant == "none":
        return Envoy(ARGS.envoy, ARGS.wasm, "no-limiter.yaml.tmpl", {}, ARGS.concurrency, workdir, tag)
    values = {"PLUGIN_CONFIG": sluice_config(variant.split("-")[1], token), "SERVICE_PORT": str(service_port)}
    return Envoy(ARGS.envoy, ARGS.wasm, SERVICE_TEMPLATE, values, ARGS.concurrency, workdir, tag)


def main():
    workdir = os.path.join(ROOT, ".run", "bench-latency")
    os.makedirs(workdir, exist_ok=True)
    for name in os.listdir(workdir):
        os.remove(os.path.join(workdir, name))
    info = machine()
    version = tool_version([ARGS.envoy, "--version"]).split("version:")[-1].strip()  # <sha>/1.36.4/Clean/...
    info["envoy"] = version.split("/")[1] if version.count("/") >= 2 else version
    info["wrk"] = tool_version(["wrk", "-v"])
    info["redis"] = tool_version([ARGS.redis_server, "--version"])
    info["load_before"] = loadavg()
    print(f"bench-latency: {ARGS.rounds} round(s) x {len(VARIANTS)} variants, wrk -t{ARGS.threads} "
          f"-c{ARGS.connections} -d{ARGS.duration}s, Envoy --concurrency {ARGS.concurrency}; "
          f"{info['nproc']} CPUs, {info['cpu']}", file=sys.stderr)
    stack = Stack(workdir, ARGS.redis_server, ARGS.service)
    runs = []
    try:
        for r in range(ARGS.rounds):
            order = VARIANTS[r % len(VARIANTS):] + VARIANTS[: r % len(VARIANTS)]
            for variant in order:
                tag = f"r{r + 1}-{variant}"
                stack.check_alive()
                envoy = envoy_for(variant, stack.service.port, stack.token, workdir, tag)
                try:
                    url = f"http://127.0.0.1:{envoy.listen}/api/bench"
                    wrk(url, ARGS.threads, ARGS.connections, 2)  # warm-up (and the first sync, for cached)
                    before = envoy.counters()
                    result = parse_wrk(wrk(url, ARGS.threads, ARGS.connections, ARGS.duration,
                                           os.path.join(workdir, f"{tag}.wrk.txt")))
                    after = envoy.counters()
                finally:
                    envoy.stop()
                result.update(round=r + 1, variant=variant)
                if variant != "none":
                    for k, stat in STATS.items():
                        result[k] = after.get(stat, 0) - before.get(stat, 0)
                runs.append(result)
                print(f"  round {r + 1} {variant:14} {result['rps']:>8.0f} req/s  p50 {result['p50_ms']:.3f} ms  "
                      f"p99 {result['p99_ms']:.3f} ms  non-2xx {result['non2xx']}  checks "
                      f"{result.get('check_sent', '-')} (failed {result.get('check_failed', '-')})  syncs ok "
                      f"{result.get('sync_ok', '-')} (failed {result.get('sync_failed', '-')})", file=sys.stderr)
    finally:
        stack.stop()
    info["load_after"] = loadavg()
    with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump({"machine": info, "args": vars(ARGS), "runs": runs}, f, indent=2)
    print(table(runs, info))


def table(runs, info):
    med = {}
    for v in VARIANTS:
        mine = [r for r in runs if r["variant"] == v]
        med[v] = {k: statistics.median(r[k] for r in mine) for k in ("rps", "p50_ms", "p99_ms")}
    base = med["none"]
    local = med["sluice-local"]
    lines = [
        f"wrk -t{ARGS.threads} -c{ARGS.connections} -d{ARGS.duration}s --latency, Envoy {info['envoy']} "
        f"--concurrency {ARGS.concurrency}, {ARGS.rounds} round(s), medians; {info['nproc']} CPUs ({info['cpu']}); "
        f"1-minute load average {info['load_before']:.2f} before, {info['load_after']:.2f} after",
        "",
        "| variant | requests/s | p50 ms | p99 ms | req/s vs none | p50 vs local | p99 vs local |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for v in VARIANTS:
        m = med[v]
        lines.append(
            f"| {v} | {m['rps']:.0f} | {m['p50_ms']:.3f} | {m['p99_ms']:.3f} | {m['rps'] / base['rps']:.2f} | "
            f"{m['p50_ms'] / local['p50_ms']:.2f} | {m['p99_ms'] / local['p99_ms']:.2f} |"
        )
    lines += [
        "",
        "Each run (the filter's own counters over the measured run, warm-up excluded):",
        "",
        "| round | variant | requests/s | p50 ms | p99 ms | requests | non-2xx | allowed | denied | checks sent "
        "| checks failed | syncs sent | syncs ok | syncs failed |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in runs:
        lines.append(
            f"| {r['round']} | {r['variant']} | {r['rps']:.0f} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | "
            f"{r['requests']} | {r['non2xx']} | {r.get('allowed', '-')} | {r.get('denied', '-')} | "
            f"{r.get('check_sent', '-')} | {r.get('check_failed', '-')} | {r.get('sync_sent', '-')} | "
            f"{r.get('sync_ok', '-')} | {r.get('sync_failed', '-')} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=int, default=10, help="seconds of each measured wrk run")
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=2, help="Envoy worker threads")
    parser.add_argument("--only", help="comma-separated variants to run (default: all; `none` and "
                                       "`sluice-local` are needed for the ratios)")
    parser.add_argument("--envoy", default=os.environ.get("SLUICE_ENVOY", os.path.join(ROOT, ".venv/bin/envoy")))
    parser.add_argument("--wasm", default=os.environ.get(
        "SLUICE_WASM", os.path.join(ROOT, "target/wasm32-wasip1/release/sluice_filter.wasm")))
    parser.add_argument("--redis-server", default=os.environ.get("SLUICE_REDIS_SERVER",
                                                                 shutil.which("redis-server") or "redis-server"))
    parser.add_argument("--service", default=os.environ.get(
        "SLUICE_COUNTER_SERVICE", os.path.join(ROOT, "target/release/sluice-counter-service")))
    ARGS = parser.parse_args()
    if ARGS.only:
        keep = set(ARGS.only.split(","))
        VARIANTS = [v for v in VARIANTS if v in keep] or sys.exit("bench: --only matches no variant")
    main()
