#!/usr/bin/env python3
"""Counter-service throughput vs one Redis round trip per request: key updates per second, same Redis, one run.

Usage (from the repository root, after `make deps build`; `make bench-service` does both):
    .venv/bin/python bench/service.py [--rounds 3] [--duration 10] [--batches 100,1000] [--keys 10000]
                                      [--clients 4] [--rb-clients 50]

One redis-server (no persistence) on a free loopback port and one sluice-counter-service in front of it are
started for the whole run, by the stack binary (`sluice-stack`, see bench/stack.py). Each round measures, in a rotating order, after a 2 s warm-up of the same load:

- sync-<B>: <clients> threads, each a keep-alive HTTP/1.1 connection posting `POST /v1/sync` batches of B
  entries back to back for <duration> s; each thread is its own proxy id and sweeps the same <keys> keys
  (every entry: one limit, spent 1). Key updates/s = entries answered 200 per second, cross-checked with the
  service's `sluice_sync_entries_total` and Redis's `EVALSHA` count.
- per-request: `redis-benchmark -c <rb-clients> -r <keys> EVALSHA <sha of lua/token_bucket.lua> 1
  tb:__rand_int__ <limit> <limit> 1`, one Redis round trip per decision, n sized for <duration> s by a short
  calibration run. Key updates/s = redis-benchmark's requests/s.

The same limit (1,000,000,000 per second, nothing denied) everywhere. Redis is flushed (FLUSHALL; scripts
stay) before each measurement. Prints markdown tables (medians over the rounds, then every run) with the CPU
seconds each process used; raw outputs and results.json go to .run/bench-service/. Standard library only:
the request bodies are encoded once before the clock starts, so the client only sends and reads bytes.
"""

import argparse
import csv
import hashlib
import http.client
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

sys.dont_write_bytecode = True  # no __pycache__ in bench/
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stack import ROOT, Stack, loadavg, machine, tool_version  # noqa: E402

LIMIT = 1_000_000_000  # per second, burst the same: nothing is ever denied
INTERVAL_MS = 100
WARMUP_S = 2
MAX_BATCHES_PER_CLIENT = 10_000_000  # a bound on every loop, far above what 10 s can reach


def sync_bodies(client, batch, keys):
    """The batches one client sends, in order, sweeping keys 0..keys-1 (each body a different slice)."""
    limit = [{"requests": LIMIT, "period_ms": 1000, "burst": LIMIT}]
    bodies = []
    start = 0
    while True:
        entries = [{"key": f"bench:{(start + i) % keys}", "limits": limit, "spent": 1, "denied": 0}
                   for i in range(batch)]
        bodies.append(json.dumps({"proxy": f"bench-{client}", "interval_ms": INTERVAL_MS, "entries": entries},
                                 separators=(",", ":")).encode())
        start = (start + batch) % keys
        if start == 0 or len(bodies) >= keys:
            return bodies


def sync_load(port, token, bodies_per_client, batch, seconds):
    """Clients post their batches back to back until the deadline; returns (entries answered 200, elapsed s,
    client CPU s, errors). A request in flight at the deadline is waited for and counted."""
    results = [None] * len(bodies_per_client)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
    begin = threading.Barrier(len(bodies_per_client) + 1)
    deadline = [0.0]

    def client(i):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        bodies = bodies_per_client[i]
        ok = errors = 0
        begin.wait()
        try:
            for n in range(MAX_BATCHES_PER_CLIENT):
                if time.monotonic() >= deadline[0]:
                    break
                conn.request("POST", "/v1/sync", body=bodies[n % len(bodies)], headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                if resp.status == 200 and data.startswith(b'{"grants":'):
                    ok += batch
                else:
                    errors += 1
                    if errors == 1:
                        print(f"bench: sync answered {resp.status}: {data[:200]!r}", file=sys.stderr)
        except OSError as e:
            errors += 1
            print(f"bench: sync client {i}: {e}", file=sys.stderr)
        finally:
            conn.close()
        results[i] = (ok, errors)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(bodies_per_client))]
    for t in threads:
        t.start()
    cpu0 = os.times()
    deadline[0] = time.monotonic() + seconds
    start = time.monotonic()
    begin.wait()
    for t in threads:
        t.join(seconds + 30)
    elapsed = time.monotonic() - start
    cpu1 = os.times()
    if any(r is None for r in results):
        sys.exit("bench: a sync client did not finish")
    return (sum(r[0] for r in results), elapsed, (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system),
            sum(r[1] for r in results))


def evalsha_delta(before, after):
    calls0, usec0 = before.get("evalsha", (0, 0))
    calls1, usec1 = after.get("evalsha", (0, 0))
    return {"evalsha": calls1 - calls0, "script_usec": usec1 - usec0}


def measure_sync(redis, service, token, batch, tag, workdir):
    bodies = [sync_bodies(c, batch, ARGS.keys) for c in range(ARGS.clients)]
    redis.command("FLUSHALL")
    sync_load(service.port, token, bodies, batch, WARMUP_S)
    m0, s0 = service.metrics(), redis.commandstats()
    r0, v0 = redis.cpu(), service.cpu()
    entries, elapsed, client_cpu, errors = sync_load(service.port, token, bodies, batch, ARGS.duration)
    r1, v1 = redis.cpu(), service.cpu()
    m1, s1 = service.metrics(), redis.commandstats()
    counted = m1.get("sluice_sync_entries_total", 0) - m0.get("sluice_sync_entries_total", 0)
    result = {
        "variant": tag, "batch": batch, "updates_per_s": entries / elapsed, "entries": entries,
        "seconds": elapsed, "errors": errors, "service_entries": int(counted),
        "batches": int(m1.get("sluice_syncs_total", 0) - m0.get("sluice_syncs_total", 0)),
        **evalsha_delta(s0, s1),
        "cpu_redis": r1 - r0, "cpu_service": v1 - v0, "cpu_client": client_cpu,
        "clients": ARGS.clients,
    }
    with open(os.path.join(workdir, f"{tag}.json"), "w") as f:
        json.dump(result, f, indent=2)
    return result


def redis_benchmark(redis, sha, n, out_path=None):
    args = ["redis-benchmark", "-h", "127.0.0.1", "-p", str(redis.port), "-c", str(ARGS.rb_clients),
            "-n", str(n), "-r", str(ARGS.keys), "--csv",
            "EVALSHA", sha, "1", "tb:__rand_int__", str(LIMIT), str(LIMIT), "1"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    timer = threading.Timer(ARGS.duration * 3 + 60, proc.kill)  # bounded, whatever n is
    timer.start()
    try:
        out, err = proc.communicate()
        # the child has been reaped by communicate(); its CPU time is in our children's rusage
    finally:
        timer.cancel()
    if proc.returncode != 0:
        sys.exit(f"bench: redis-benchmark failed ({proc.returncode}): {err.decode()[-500:]}")
    text = out.decode()
    if out_path:
        with open(out_path, "w") as f:
            f.write(" ".join(args) + "\n" + text)
    rows = list(csv.reader(io.StringIO(text)))
    header, values = rows[0], rows[-1]
    row = dict(zip(header, values))
    return float(row["rps"]), row


def measure_per_request(redis, sha, tag, workdir):
    redis.command("FLUSHALL")
    rps, _ = redis_benchmark(redis, sha, 20_000)  # warm-up and calibration
    n = max(10_000, min(int(rps * ARGS.duration), 50_000_000))
    redis.command("FLUSHALL")
    s0, r0 = redis.commandstats(), redis.cpu()
    c0 = os.times()
    start = time.monotonic()
    rps, row = redis_benchmark(redis, sha, n, os.path.join(workdir, f"{tag}.txt"))
    elapsed = time.monotonic() - start
    c1 = os.times()
    r1, s1 = redis.cpu(), redis.commandstats()
    keys = redis.command("DBSIZE")
    result = {
        "variant": tag, "batch": 1, "updates_per_s": rps, "entries": n, "seconds": elapsed, "errors": 0,
        **evalsha_delta(s0, s1), "keys_in_redis": keys,
        "cpu_redis": r1 - r0, "cpu_service": 0.0,
        "cpu_client": (c1.children_user - c0.children_user) + (c1.children_system - c0.children_system),
        "clients": ARGS.rb_clients, "p50_ms": float(row.get("p50_latency_ms", "nan")),
    }
    with open(os.path.join(workdir, f"{tag}.json"), "w") as f:
        json.dump(result, f, indent=2)
    return result


def main():
    workdir = os.path.join(ROOT, ".run", "bench-service")
    os.makedirs(workdir, exist_ok=True)
    for name in os.listdir(workdir):
        os.remove(os.path.join(workdir, name))
    if not shutil.which("redis-benchmark"):
        sys.exit("bench: redis-benchmark not found (Debian: apt-get install redis-tools; `make deps` installs it)")
    info = machine()
    info["redis"] = tool_version([ARGS.redis_server, "--version"])
    info["redis_benchmark"] = tool_version(["redis-benchmark", "--version"])
    info["load_before"] = loadavg()
    variants = [f"sync-{b}" for b in ARGS.batches] + ["per-request"]
    print(f"bench-service: {ARGS.rounds} round(s) x {len(variants)} variants, {ARGS.duration} s each, "
          f"{ARGS.keys} keys; {info['nproc']} CPUs, {info['cpu']}", file=sys.stderr)
    stack = Stack(workdir, ARGS.redis_server, ARGS.service, ["--redis-timeout-ms", str(ARGS.redis_timeout_ms)])
    redis, service = stack.redis, stack.service
    runs = []
    try:
        with open(os.path.join(ROOT, "lua", "token_bucket.lua"), "rb") as f:
            script = f.read()
        sha = redis.command("SCRIPT", "LOAD", script)
        if sha != hashlib.sha1(script).hexdigest():
            sys.exit("bench: SCRIPT LOAD returned an unexpected sha")
        for r in range(ARGS.rounds):
            order = variants[r % len(variants):] + variants[: r % len(variants)]
            for variant in order:
                tag = f"r{r + 1}-{variant}"
                if variant == "per-request":
                    result = measure_per_request(redis, sha, tag, workdir)
                else:
                    result = measure_sync(redis, service, stack.token, int(variant.split("-")[1]), tag, workdir)
                result["round"] = r + 1
                result["variant"] = variant
                runs.append(result)
                print(f"  round {r + 1} {variant:12} {result['updates_per_s']:>10.0f} key updates/s  "
                      f"EVALSHA {result['evalsha']}  CPU s: redis {result['cpu_redis']:.1f} service "
                      f"{result['cpu_service']:.1f} client {result['cpu_client']:.1f}  errors {result['errors']}",
                      file=sys.stderr)
    finally:
        stack.stop()
    info["load_after"] = loadavg()
    with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump({"machine": info, "args": vars(ARGS), "runs": runs}, f, indent=2)
    print(table(runs, variants, info))


def table(runs, variants, info):
    med = {}
    for v in variants:
        mine = [r for r in runs if r["variant"] == v]
        med[v] = {k: statistics.median(r[k] for r in mine)
                  for k in ("updates_per_s", "cpu_redis", "cpu_service", "cpu_client", "seconds")}
        med[v]["script_us"] = statistics.median(r["script_usec"] / r["entries"] for r in mine)
    base = med["per-request"]["updates_per_s"]
    lines = [
        f"{ARGS.keys} keys, {ARGS.duration} s per run, {ARGS.rounds} round(s), medians; sync: {ARGS.clients} "
        f"keep-alive clients; per-request: redis-benchmark -c {ARGS.rb_clients}; {info['redis']}; "
        f"{info['nproc']} CPUs ({info['cpu']})",
        "",
        "| variant | entries per request | key updates/s | vs per-request | script µs per key update | Redis CPU "
        "| service CPU | client CPU |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for v in variants:
        m = med[v]
        batch = "1" if v == "per-request" else v.split("-")[1]
        share = {k: m[k] / m["seconds"] for k in ("cpu_redis", "cpu_service", "cpu_client")}
        lines.append(
            f"| {v} | {batch} | {m['updates_per_s']:.0f} | {m['updates_per_s'] / base:.2f} | {m['script_us']:.1f} | "
            f"{share['cpu_redis']:.2f} | {share['cpu_service']:.2f} | {share['cpu_client']:.2f} |"
        )
    lines += [
        "",
        "(Script µs: Redis's own time executing the EVALSHA calls (INFO commandstats) per key update. CPU: cores "
        f"busy on average over the run, from the processes' own CPU time; the machine has {info['nproc']}. "
        f"1-minute load average {info['load_before']:.2f} before the run, {info['load_after']:.2f} after.)",
        "",
        "Each run:",
        "",
        "| round | variant | key updates/s | entries | seconds | errors | service entries | batches | EVALSHA calls |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in runs:
        lines.append(
            f"| {r['round']} | {r['variant']} | {r['updates_per_s']:.0f} | {r['entries']} | {r['seconds']:.1f} | "
            f"{r['errors']} | {r.get('service_entries', '-')} | {r.get('batches', '-')} | {r['evalsha']} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=int, default=10, help="seconds of each measured run")
    parser.add_argument("--batches", default="100,1000", help="entries per sync batch, comma-separated")
    parser.add_argument("--keys", type=int, default=10_000, help="distinct keys")
    parser.add_argument("--clients", type=int, default=4, help="concurrent sync clients (one proxy id each)")
    parser.add_argument("--rb-clients", type=int, default=50, help="redis-benchmark connections (-c)")
    parser.add_argument("--redis-timeout-ms", type=int, default=1000,
                        help="the service's --redis-timeout-ms (a 1000-entry script call can take tens of ms)")
    parser.add_argument("--redis-server", default=os.environ.get("SLUICE_REDIS_SERVER",
                                                                 shutil.which("redis-server") or "redis-server"))
    parser.add_argument("--service", default=os.environ.get(
        "SLUICE_COUNTER_SERVICE", os.path.join(ROOT, "target/release/sluice-counter-service")))
    ARGS = parser.parse_args()
    ARGS.batches = [int(b) for b in ARGS.batches.split(",")]
    main()
