#!/usr/bin/env python3
"""sluice vs Envoy's native local_ratelimit vs no limiter: the same wrk load against the same Envoy, in one run.

Also the floor (host/guests/floor, `sluice_floor.wasm`): the cheapest Wasm filter that gives sluice's answers,
nothing on the open path and sluice's 429 (same headers, same body) on the deny path, in the same Envoy config
as sluice. sluice / floor is what sluice's work costs beyond being a Wasm filter at all.

Usage (from the repository root, after `make deps build`; `make bench` does both):
    .venv/bin/python bench/bench.py [--rounds 3] [--duration 10] [--connections 32] [--threads 2]
                                    [--concurrency 2] [--only floor-deny,sluice-deny,native-deny]

Each round starts a fresh Envoy per variant (in a rotating order, so no variant always runs first), warms it
up for 2 s, then runs `wrk -t<threads> -c<connections> -d<duration>s --latency` against its edge listener on
127.0.0.1. Prints a markdown table of the medians over the rounds; raw wrk outputs, Envoy logs and
results.json go to .run/bench/. Standard library only.
"""

import argparse
import ctypes
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENVOY_DIR = os.path.join(ROOT, "envoy")
SLUICE_HEADERS = "legacy"
for i, arg in enumerate(sys.argv):  # read before VARIANTS renders sluice's configuration
    if arg == "--sluice-headers" and i + 1 < len(sys.argv):
        SLUICE_HEADERS = sys.argv[i + 1]
OPEN_LIMIT = 1_000_000_000  # per second: nothing is ever denied, so what is measured is the overhead
DENY_LIMIT = 100  # per second: almost every request of the load is denied


def sluice_config(requests_per_second, algorithm=None):
    limit = {"requests": requests_per_second, "per": "second", "burst": requests_per_second}
    if algorithm:
        limit["algorithm"] = algorithm
        if algorithm.endswith("_window"):
            # A window holds fewer requests than half its microseconds, and has no burst.
            limit = {"requests": min(requests_per_second, 400_000), "per": "second", "algorithm": algorithm}
        if algorithm == "sliding_log":
            # One timestamp per request: at most 1,000 (and 64 MiB a rule: 8,192 keys of 1,000).
            limit = {"requests": min(requests_per_second, 1_000), "per": "second", "algorithm": algorithm}
    rule = {
        "name": "bench",
        "match": {"path_prefix": "/api/"},
        "key": ["client_ip"],
        "limits": [limit],
        "mode": "enforce",
    }
    # legacy X-RateLimit-* headers: what the native filter sends with enable_x_ratelimit_headers
    return json.dumps({"headers": SLUICE_HEADERS, "rules": [rule]}, separators=(",", ":"))


def native_bucket(requests_per_second):
    # Envoy refills in steps (fill_interval >= 50 ms); sluice refills continuously. A tenth of the rate every
    # 100 ms keeps the two close.
    return {
        "MAX_TOKENS": str(requests_per_second),
        "TOKENS_PER_FILL": str(max(1, requests_per_second // 10)),
        "FILL_INTERVAL": "0.1s",
    }


VARIANTS = [
    # name, limiter, template, placeholders, admitted/denied counters
    ("none", "none", "no-limiter.yaml.tmpl", {}, None),
    ("native-open", "native", "native-local-ratelimit.yaml.tmpl", native_bucket(OPEN_LIMIT), "native"),
    ("floor-open", "floor", "sluice.yaml.tmpl", {"PLUGIN_CONFIG": "open"}, None),
    ("sluice-open", "sluice", "sluice.yaml.tmpl", {"PLUGIN_CONFIG": sluice_config(OPEN_LIMIT)}, "sluice"),
    ("native-deny", "native", "native-local-ratelimit.yaml.tmpl", native_bucket(DENY_LIMIT), "native"),
    ("floor-deny", "floor", "sluice.yaml.tmpl", {"PLUGIN_CONFIG": "deny"}, None),
    ("sluice-deny", "sluice", "sluice.yaml.tmpl", {"PLUGIN_CONFIG": sluice_config(DENY_LIMIT)}, "sluice"),
]
# The floor's configuration is a plain string: "open" (Continue, nothing else) or "deny" (sluice's 429 for the
# rule above on every /api/ path, with the legacy headers whatever --sluice-headers says); the limiter "floor" runs
# --floor-wasm instead of --wasm.
# The other algorithms on the same paths (--only picks them; `make bench` runs them all).
ALGORITHMS = {"gcra": "gcra", "fixed": "fixed_window", "sliding": "sliding_window"}
for short, algorithm in ALGORITHMS.items():
    VARIANTS += [
        (f"sluice-open-{short}", "sluice", "sluice.yaml.tmpl",
         {"PLUGIN_CONFIG": sluice_config(OPEN_LIMIT, algorithm)}, "sluice"),
        (f"sluice-deny-{short}", "sluice", "sluice.yaml.tmpl",
         {"PLUGIN_CONFIG": sluice_config(DENY_LIMIT, algorithm)}, "sluice"),
    ]
# A sliding log cannot be open (it keeps a timestamp per request, at most 1,000): its deny path, a log
# of 100 timestamps per key (every request reads its set of 8 records, 7 KB).
VARIANTS.append(("sluice-deny-log", "sluice", "sluice.yaml.tmpl",
                 {"PLUGIN_CONFIG": sluice_config(DENY_LIMIT, "sliding_log")}, "sluice"))
# The floor with sluice's host calls and nothing else (host/guests/floor's `+` options): what of sluice's cost
# beyond the floor is host calls and what is wasm work. Run only when --only names them.
FLOOR_CALLS = {
    "floor-open-calls": "open+calls",
    "floor-open-reads": "open+clock+path+source",
    "floor-open-clock": "open+clock",
    "floor-open-path": "open+path",
    "floor-open-source": "open+source",
    "floor-open-shared": "open+shared",
    "floor-open-metric": "open+metric",
    "floor-open-headers": "open+headers",
    "floor-deny-calls": "deny+calls",
}
EXTRA = [(name, "floor", "sluice.yaml.tmpl", {"PLUGIN_CONFIG": config}, None) for name, config in FLOOR_CALLS.items()]
COUNTERS = {
    "native": (
        "http_local_rate_limiter.http_local_rate_limit.ok",
        "http_local_rate_limiter.http_local_rate_limit.rate_limited",
    ),
    "sluice": ("wasmcustom.sluice.rule.bench.allowed", "wasmcustom.sluice.rule.bench.denied"),
}

NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def render(template, values, directory=ENVOY_DIR):
    """A template of `directory` with its {{PLACEHOLDERS}} filled (PLUGIN_CONFIG escaped for a YAML single-quoted
    string); a placeholder left without a value is an error."""
    with open(os.path.join(directory, template)) as f:
        text = f.read()
    for key, value in values.items():
        if key == "PLUGIN_CONFIG":
            value = value.replace("'", "''")
        text = text.replace("{{%s}}" % key, value)
    left = re.search(r"\{\{[A-Z_]+\}\}", text)
    if left:
        sys.exit(f"bench: placeholder {left.group(0)} of {template} has no value")
    return text


def die_with_parent(sig=signal.SIGKILL):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, sig)  # PR_SET_PDEATHSIG


def http_get(url, timeout=1.0):
    with NO_PROXY.open(url, timeout=timeout) as r:
        return r.status, r.read().decode()


class Envoy:
    has_counters = True  # its admin's /stats

    def __init__(self, envoy, wasm, template, values, concurrency, workdir, name):
        listen, admin, upstream = free_ports(3)
        self.listen, self.admin = listen, admin
        values = dict(values, LISTEN_PORT=str(listen), ADMIN_PORT=str(admin), UPSTREAM_PORT=str(upstream), WASM=wasm)
        config = os.path.join(workdir, f"{name}.yaml")
        with open(config, "w") as f:
            f.write(render(template, values))
        self.log_path = os.path.join(workdir, f"{name}.envoy.log")
        self.log = open(self.log_path, "w")
        args = [envoy, "-c", config, "--concurrency", str(concurrency), "--disable-hot-restart", "--log-level", "warn"]
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        self.pidfile = os.path.join(workdir, "envoy.pid")
        with open(self.pidfile, "w") as f:
            f.write(str(self.proc.pid))
        deadline = time.time() + 30
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                sys.exit(f"bench: Envoy ({name}) exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if http_get(f"http://127.0.0.1:{admin}/ready") == (200, "LIVE\n"):
                    return
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        sys.exit(f"bench: Envoy ({name}) not ready within 30 s; see {self.log_path}")

    def counters(self):
        _, text = http_get(f"http://127.0.0.1:{self.admin}/stats", timeout=5)
        out = {}
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if value.isdigit():
                out[name] = int(value)
        return out

    def cpu_seconds(self):
        """CPU time Envoy's process used so far, every thread, user and system (/proc/<pid>/stat)."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self):
        stop_process(self.proc, self.log, self.pidfile, grace_s=10)


def stop_process(proc, log, pidfile, grace_s):
    """Ends a process started with a log file and a pid file: SIGTERM, SIGKILL after `grace_s`."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log.close()
    if os.path.exists(pidfile):
        os.remove(pidfile)


UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def parse_wrk(text):
    def latency(pct):
        m = re.search(r"^\s+%s%%\s+([\d.]+)(us|ms|s)\s*$" % pct, text, re.M)
        return float(m.group(1)) * UNITS[m.group(2)]

    requests = int(re.search(r"(\d+) requests in", text).group(1))
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    errors = re.search(r"Socket errors: (.*)", text)
    return {
        "rps": float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1)),
        "p50_ms": latency(50),
        "p99_ms": latency(99),
        "requests": requests,
        "non2xx": int(non2xx.group(1)) if non2xx else 0,
        "socket_errors": errors.group(1).strip() if errors else "",
    }


def wrk(url, threads, connections, seconds, out_path=None):
    args = ["wrk", f"-t{threads}", f"-c{connections}", f"-d{seconds}s", "--latency", url]
    text = subprocess.run(args, check=True, capture_output=True, text=True, timeout=seconds + 60).stdout
    if out_path:
        with open(out_path, "w") as f:
            f.write(" ".join(args) + "\n" + text)
    return text


def measure(proxy, threads, connections, duration, out_path):
    """One measured run against a started proxy (an Envoy, or bench/nginx.py's nginx): 2 s of warm-up, then wrk
    on its edge at /api/bench. Returns wrk's figures with the proxy's CPU time per request, and its counters
    before and after (proxy.counters(), {} where the host has none to read)."""
    url = f"http://127.0.0.1:{proxy.listen}/api/bench"
    wrk(url, threads, connections, 2)  # warm-up
    # sluice hands its request counters to Envoy's stats on its tick (1 s): read them after one
    if proxy.has_counters:
        time.sleep(1.2)
    before = proxy.counters()
    cpu = proxy.cpu_seconds()
    result = parse_wrk(wrk(url, threads, connections, duration, out_path))
    # The proxy's CPU time per request: unlike requests/s, it barely moves when other work shares the machine
    # (it covers the edge with the filter and the upstream behind it, a second listener of the same proxy).
    result["cpu_us"] = (proxy.cpu_seconds() - cpu) * 1e6 / max(result["requests"], 1)
    if proxy.has_counters:
        time.sleep(1.2)
    return result, before, proxy.counters()


def machine(envoy):
    model = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    envoy_version = subprocess.run([envoy, "--version"], capture_output=True, text=True).stdout.strip()
    wrk_version = subprocess.run(["wrk", "-v"], capture_output=True, text=True).stdout.splitlines()[0]
    return {"nproc": os.cpu_count(), "cpu": model, "envoy": envoy_version.split("version:")[-1].strip(), "wrk": wrk_version}


def main():
    workdir = os.path.join(ROOT, ".run", "bench")
    os.makedirs(workdir, exist_ok=True)
    for name in os.listdir(workdir):
        os.remove(os.path.join(workdir, name))
    info = machine(ARGS.envoy)
    print(f"bench: {ARGS.rounds} round(s) x {len(VARIANTS)} variants, wrk -t{ARGS.threads} -c{ARGS.connections} "
          f"-d{ARGS.duration}s, Envoy --concurrency {ARGS.concurrency}; {info['nproc']} CPUs, {info['cpu']}",
          file=sys.stderr)
    runs = []
    for r in range(ARGS.rounds):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[: r % len(VARIANTS)]
        for name, limiter, template, values, counters in order:
            tag = f"r{r + 1}-{name}"
            wasm = {"floor": ARGS.floor_wasm, "baseline": ARGS.baseline_wasm}.get(limiter, ARGS.wasm)
            envoy = Envoy(ARGS.envoy, wasm, template, values, ARGS.concurrency, workdir, tag)
            try:
                result, before, after = measure(envoy, ARGS.threads, ARGS.connections, ARGS.duration,
                                                os.path.join(workdir, f"{tag}.wrk.txt"))
            finally:
                envoy.stop()
            result.update(round=r + 1, variant=name, limiter=limiter)
            if counters:
                ok, limited = COUNTERS[counters]
                result["admitted"] = after.get(ok, 0) - before.get(ok, 0)
                result["denied"] = after.get(limited, 0) - before.get(limited, 0)
            runs.append(result)
            print(f"  round {r + 1} {name:12} {result['rps']:>10.0f} req/s  p50 {result['p50_ms']:.3f} ms  "
                  f"p99 {result['p99_ms']:.3f} ms  CPU {result['cpu_us']:.1f} us/req  non-2xx {result['non2xx']}",
                  file=sys.stderr)
    with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump({"machine": info, "args": vars(ARGS), "runs": runs}, f, indent=2)
    print(table(runs, info))


def table(runs, info):
    med = {}
    for name, *_ in VARIANTS:
        mine = [r for r in runs if r["variant"] == name]
        med[name] = {k: statistics.median(r[k] for r in mine) for k in ("rps", "p50_ms", "p99_ms", "cpu_us")}
        med[name]["denied_share"] = statistics.median(r["non2xx"] / r["requests"] for r in mine)
    base = med["none"]["rps"] if "none" in med else None
    lines = [
        f"wrk -t{ARGS.threads} -c{ARGS.connections} -d{ARGS.duration}s --latency, Envoy {info['envoy']} "
        f"--concurrency {ARGS.concurrency}, {ARGS.rounds} round(s), medians; {info['nproc']} CPUs ({info['cpu']})",
        "",
        "| variant | limit | requests/s | p50 ms | p99 ms | Envoy CPU us / request | denied | vs none | sluice / native "
        "| vs token bucket |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, limiter, *_ in VARIANTS:
        m = med[name]  # VARIANTS is already cut down by --only
        path = "open" if "-open" in name else "deny" if "-deny" in name else None
        open_limit = 400_000 if name.endswith(("-fixed", "-sliding")) else OPEN_LIMIT
        limit = "-" if path is None or limiter == "floor" else f"{open_limit if path == 'open' else DENY_LIMIT}/s"
        ratio = "-"
        native_name = f"native-{path}"
        if limiter in ("sluice", "baseline") and native_name in med:
            native = med[native_name]
            ratio = f"{m['rps'] / native['rps']:.2f} (p99 {m['p99_ms'] / native['p99_ms']:.2f})"
        vs_bucket = "-"
        bucket_name = f"sluice-{path}"
        if limiter == "sluice" and name != bucket_name and bucket_name in med:
            bucket = med[bucket_name]
            vs_bucket = f"{m['rps'] / bucket['rps']:.2f} (p99 {m['p99_ms'] / bucket['p99_ms']:.2f})"
        vs_none = f"{m['rps'] / base:.2f}" if base else "-"
        lines.append(
            f"| {name} | {limit} | {m['rps']:.0f} | {m['p50_ms']:.3f} | {m['p99_ms']:.3f} | {m['cpu_us']:.1f} | "
            f"{m['denied_share']:.1%} | {vs_none} | {ratio} | {vs_bucket} |"
        )
    lines += floor_table(med)
    lines += [
        "",
        "Each run (admitted and denied from the limiter's own counters over the measured run, warm-up excluded):",
        "",
        "| round | variant | requests/s | p50 ms | p99 ms | CPU us / request | requests | non-2xx | admitted | denied |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in runs:
        lines.append(
            f"| {r['round']} | {r['variant']} | {r['rps']:.0f} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | "
            f"{r['cpu_us']:.1f} | {r['requests']} | {r['non2xx']} | {r.get('admitted', '-')} | {r.get('denied', '-')} |"
        )
    return "\n".join(lines)


def floor_table(med):
    """sluice / floor and sluice / native per path, for the paths with a floor variant measured."""
    paths = [p for p in ("open", "deny") if f"floor-{p}" in med]
    if not paths:
        return []

    def ratio(a, b):
        if a not in med or b not in med:
            return "-"
        return f"{med[a]['rps'] / med[b]['rps']:.2f} (p99 {med[a]['p99_ms'] / med[b]['p99_ms']:.2f})"

    lines = [
        "",
        "The floor (a Wasm filter that does nothing on the open path and answers sluice's 429 on the deny path):",
        "",
        "| path | sluice / floor | sluice / native | floor / native |",
        "| --- | ---: | ---: | ---: |",
    ]
    for p in paths:
        sluice, floor, native = f"sluice-{p}", f"floor-{p}", f"native-{p}"
        lines.append(f"| {p} | {ratio(sluice, floor)} | {ratio(sluice, native)} | {ratio(floor, native)} |")
    for p in paths:
        if f"floor-{p}-calls" in med:
            lines.append(f"| {p}, the floor with sluice's host calls | {ratio(f'sluice-{p}', f'floor-{p}-calls')} | - | "
                         f"{ratio(f'floor-{p}-calls', f'native-{p}')} |")
    for p in paths:
        if f"baseline-{p}" in med:
            lines.append(f"| {p}, baseline build | {ratio(f'baseline-{p}', f'floor-{p}')} | "
                         f"{ratio(f'baseline-{p}', f'native-{p}')} | - |")
    return lines


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=int, default=10, help="seconds of each measured wrk run")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=2, help="Envoy worker threads")
    parser.add_argument("--envoy", default=os.environ.get("SLUICE_ENVOY", os.path.join(ROOT, ".venv/bin/envoy")))
    parser.add_argument("--wasm", default=os.environ.get(
        "SLUICE_WASM", os.path.join(ROOT, "target/wasm32-wasip1/release/sluice_filter.wasm")))
    parser.add_argument("--floor-wasm", default=os.environ.get(
        "SLUICE_FLOOR_WASM", os.path.join(ROOT, "target/wasm32-wasip1/release/sluice_floor.wasm")),
        help="the floor filter, for floor-open and floor-deny (built by make build)")
    parser.add_argument("--sluice-headers", default="legacy", choices=["none", "legacy", "draft", "both"],
                        help="sluice's header style (default legacy, like the native filter's X-RateLimit-*)")
    parser.add_argument("--only", help="comma-separated variants to run (default: all but the floor-*-calls/reads/shared/metric/headers "
                             "variants, the floor with some of sluice's host calls, which run only when named)")
    parser.add_argument("--baseline-wasm",
                        help="another build of sluice (an earlier commit's), run as baseline-open and baseline-deny "
                             "in the same rounds: a change's before and after side by side")
    ARGS = parser.parse_args()
    if ARGS.baseline_wasm:
        VARIANTS += [(name.replace("sluice-", "baseline-"), "baseline", template, values, counters)
                     for name, limiter, template, values, counters in VARIANTS
                     if name in ("sluice-open", "sluice-deny")]
    if ARGS.only:
        keep = set(ARGS.only.split(","))
        VARIANTS = [v for v in VARIANTS + EXTRA if v[0] in keep]
    main()
