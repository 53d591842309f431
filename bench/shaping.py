#!/usr/bin/env python3
"""The leaky bucket in real Envoy: when requests of a burst leave vs the ideal schedule.

    .venv/bin/python bench/shaping.py [--rate 50] [--burst 100] [--rounds 3]

sluice (envoy/sluice.yaml.tmpl, 2 workers) shapes every request to `--rate` per second with room for the
whole burst. Each round sends `--burst` requests at the same moment (one thread and connection each) and
records when each answer comes back, from the moment the burst was released; the built-in upstream answers at
once, so that time less the round trip of an unshaped request (measured first, median of 50) is when the
request left the filter. Sorted, the i-th should leave at i / rate. The threads' own start-up spreads the burst
over a few milliseconds: a request that reaches the proxy after its slot leaves when it comes. Prints the deviation (measured - ideal) percentiles as markdown; standard
library only, everything it starts is stopped when it ends.
"""

import argparse
import json
import os
import statistics
import sys
import threading
import time
import urllib.error

sys.dont_write_bytecode = True  # no __pycache__ in bench/
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import NO_PROXY, Envoy  # noqa: E402
from stack import ROOT  # noqa: E402


def get(url, timeout=10.0):
    try:
        with NO_PROXY.open(url, timeout=timeout) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def percentile(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=int, default=50, help="requests per second the bucket lets leave")
    parser.add_argument("--burst", type=int, default=100, help="requests sent at once per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--envoy", default=os.environ.get("SLUICE_ENVOY", os.path.join(ROOT, ".venv/bin/envoy")))
    parser.add_argument("--wasm", default=os.environ.get(
        "SLUICE_WASM", os.path.join(ROOT, "target/wasm32-wasip1/release/sluice_filter.wasm")))
    args = parser.parse_args()
    workdir = os.path.join(ROOT, ".run", "bench-shaping")
    os.makedirs(workdir, exist_ok=True)
    plugin = {"rules": [
        {"name": "shape", "match": {"path_prefix": "/shaped/"}, "key": ["const:all"],
         "limits": [{"requests": args.rate, "per": "second", "algorithm": "leaky_bucket",
                     "queue": args.burst, "max_delay_ms": 60000}]}]}
    envoy = Envoy(args.envoy, args.wasm, "sluice.yaml.tmpl",
                  {"PLUGIN_CONFIG": json.dumps(plugin, separators=(",", ":"))}, 2, workdir, "shaping")
    port = envoy.listen
    try:
        base = []
        for _ in range(50):
            t = time.perf_counter()
            get(f"http://127.0.0.1:{port}/plain")
            base.append(time.perf_counter() - t)
        rtt = statistics.median(base)
        interval = 1.0 / args.rate
        deviations, late_max = [], 0.0
        for round_ in range(args.rounds):
            times, statuses = [None] * args.burst, [None] * args.burst
            go = threading.Event()

            def one(i):
                go.wait()
                statuses[i] = get(f"http://127.0.0.1:{port}/shaped/x", timeout=args.burst * interval + 10)
                times[i] = time.perf_counter()

            threads = [threading.Thread(target=one, args=(i,)) for i in range(args.burst)]
            for th in threads:
                th.start()
            time.sleep(0.2)
            started = time.perf_counter()
            go.set()
            for th in threads:
                th.join()
            left = sorted(t - started - rtt for t, s in zip(times, statuses) if s == 200)
            refused = sum(1 for s in statuses if s != 200)
            dev = [(left[i] - i * interval) * 1000 for i in range(len(left))]
            deviations += dev
            late_max = max(late_max, max(dev))
            print(f"  round {round_ + 1}: {len(left)} left, {refused} refused, last left at {left[-1]:.3f} s "
                  f"(ideal {(len(left) - 1) * interval:.3f} s)", file=sys.stderr)
            time.sleep(args.burst * interval + 1)
        print(f"Leaky bucket {args.rate}/s (one every {interval * 1000:.0f} ms), bursts of {args.burst} sent at once, "
              f"{args.rounds} rounds; Envoy --concurrency 2; unshaped round trip {rtt * 1000:.2f} ms (median of 50).\n")
        print("| schedule | requests | abs. deviation p50 | p90 | p99 | max | signed mean |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for name, values in (("from the burst's release: i / rate", deviations),):
            a = [abs(d) for d in values]
            print(f"| {name} | {len(values)} | {percentile(a, 50):.2f} ms | {percentile(a, 90):.2f} ms | "
                  f"{percentile(a, 99):.2f} ms | {max(a):.2f} ms | {statistics.mean(values):+.2f} ms |")
    finally:
        envoy.stop()


if __name__ == "__main__":
    main()
