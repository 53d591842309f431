#!/usr/bin/env python3
"""sluice in nginx beside Envoy: the same wrk load, one run, each host with its native limiter and the floor.

Usage (from the repository root; `SLUICE_NGINX_MODULE=/path/to/ngx_wasmx_module.so make bench-nginx` builds what
is missing, then runs this):
    SLUICE_NGINX_MODULE=/path/to/ngx_wasmx_module.so .venv/bin/python bench/nginx.py
        [--rounds 3] [--duration 10] [--connections 32] [--threads 2] [--concurrency 2] [--only VARIANT,...]

Variants, each on the open path (1,000,000,000 requests a second: nothing is denied, the cost of asking) and the
deny path (100 a second, burst 100: almost every request denied), as in bench/bench.py:

- Envoy (bench.py's templates and configurations): `none` (no limiter), `native` (Envoy's `local_ratelimit`),
  `floor` (the cheapest Wasm filter giving sluice's answers, host/guests/floor), `sluice` (a local rule);
- nginx with ngx_wasm_module (nginx/bench.conf.tmpl; the same nginx, module and wasm block in every variant,
  only the edge location differs): `none`, `limit_req` (nginx's own, `limit_req_zone $binary_remote_addr` at the
  same rate, `burst` the same, `nodelay`, answering 429), `floor`, `sluice` (the same local rule, `"host":
  "nginx"`), `cached` (the rule `"consistency": "cached"`, synced every 100 ms with a counter service named by
  `service.address`; Redis and the service come from the stack binary, bench/stack.py, for the whole run).

nginx runs `worker_processes` = Envoy's `--concurrency`; behind each proxy a second server (listener) of the same
proxy answers 200 `ok`. Each round starts a fresh proxy per variant, in a rotating order, warms it up for 2 s,
then runs `wrk -t<threads> -c<connections> -d<duration>s --latency` on 127.0.0.1 (bench.measure). Prints markdown
tables: medians with each figure's range over the rounds, the ratios per host and path, every run. Raw wrk
outputs, configurations, nginx's error logs and results.json go to .run/bench-nginx/. Standard library only.
"""

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time

sys.dont_write_bytecode = True  # no __pycache__ in bench/
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402  (Envoy, its templates and configurations, wrk, measure)
from stack import ROOT, Stack, cpu_seconds, loadavg, tool_version  # noqa: E402

NGINX_DIR = os.path.join(ROOT, "nginx")
NGINX_TEMPLATE = "bench.conf.tmpl"
START_TIMEOUT_S = 120  # each worker compiles the filter with Cranelift: seconds each on a busy 2-core machine
LOADED = 'successfully loaded "sluice" module'  # ngx_wasm_module, once per worker
FAILED = 'failed initializing "sluice" filter'
LOG_LEVELS = ("[error]", "[crit]", "[alert]", "[emerg]")
PATHS = {"open": bench.OPEN_LIMIT, "deny": bench.DENY_LIMIT}


def nginx_single_quoted(value):
    """A value for an nginx single-quoted string: `\\` and `'` escaped with `\\` (tests/src/nginx.rs does the same)."""
    return value.replace("\\", "\\\\").replace("'", "\\'")


def proxy_wasm(config):
    return (
        "            proxy_wasm_request_headers_in_access on;\n"
        f"            proxy_wasm sluice '{nginx_single_quoted(config)}';"
    )


def nginx_sluice_config(limit, token=None, service_port=None):
    """bench.py's rule for nginx (`"host": "nginx"`), local; with a service, cached and synced with it by address."""
    config = json.loads(bench.sluice_config(limit))
    config["host"] = "nginx"
    if service_port is not None:
        config["rules"][0]["consistency"] = "cached"
        config["service"] = {"address": f"127.0.0.1:{service_port}", "token": token, "timeout_ms": 200,
                             "sync_interval_ms": 100}
    return json.dumps(config, separators=(",", ":"))


def limit_req(rate):
    """nginx's limit_req at sluice's rule: per client address, `rate` a second, a burst of `rate` served at once,
    429 like sluice; each rejection logged at info, under the edge location's error_log level (notice), as sluice
    logs nothing per request (nginx's default, error, writes a line per denied request)."""
    zone = f"    limit_req_zone $binary_remote_addr zone=bench:1m rate={rate}r/s;"
    limiter = (f"            limit_req zone=bench burst={rate} nodelay;\n"
               "            limit_req_status 429;\n"
               "            limit_req_log_level info;")
    return zone, limiter


def variants():
    """(name, host, limiter, path): every variant, Envoy's first."""
    out = []
    for path in PATHS:
        out += [(f"envoy-{limiter}-{path}", "envoy", limiter, path) for limiter in ("native", "floor", "sluice")]
        out += [(f"nginx-{limiter}-{path}", "nginx", limiter, path)
                for limiter in ("limit_req", "floor", "sluice", "cached")]
    return [("envoy-none", "envoy", "none", None), ("nginx-none", "nginx", "none", None)] + out


class Nginx:
    """nginx/bench.conf.tmpl rendered into .run/bench-nginx/<name>/ and started there (`-p`), as the bench's own
    user; ready once every worker has loaded the filter and a worker answers. SIGTERM stops it (and the bench's
    death, PR_SET_PDEATHSIG: nginx's fast shutdown, which stops the workers too)."""

    has_counters = False  # ngx_wasm_module keeps the filter's metrics where stock nginx does not show them

    def __init__(self, binary, module, wasm, zone, limiter, workers, workdir, name):
        self.listen, upstream = bench.free_ports(2)
        self.prefix = os.path.join(workdir, name)
        os.makedirs(self.prefix)
        values = {
            "MODULE": module, "USER": "user root;" if os.geteuid() == 0 else "", "PREFIX": self.prefix,
            "WORKERS": str(workers), "WASM": wasm, "LISTEN_PORT": str(self.listen), "UPSTREAM_PORT": str(upstream),
            "ZONE": zone, "LIMITER": limiter,
        }
        config = os.path.join(self.prefix, "nginx.conf")
        with open(config, "w") as f:
            f.write(bench.render(NGINX_TEMPLATE, values, directory=NGINX_DIR))
        self.log_path = os.path.join(self.prefix, "error.log")
        self.log = open(os.path.join(self.prefix, "stderr.log"), "w")
        args = [binary, "-p", self.prefix, "-e", self.log_path, "-c", config]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
                                     preexec_fn=lambda: bench.die_with_parent(signal.SIGTERM))
        # nginx writes its own pid file (the template's `pid`), which `make clean-run` finds under .run/
        self.pidfile = os.path.join(self.prefix, "nginx.pid")
        deadline = time.time() + START_TIMEOUT_S
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                sys.exit(f"bench: nginx ({name}) exited with {self.proc.returncode}; see {self.log_path}")
            text = self.error_log()
            if FAILED in text:
                self.stop()
                sys.exit(f"bench: a worker of nginx ({name}) refused the filter; see {self.log_path}")
            if text.count(LOADED) >= workers and self.answers():
                return
            time.sleep(0.05)
        self.stop()
        sys.exit(f"bench: nginx ({name}) not ready within {START_TIMEOUT_S} s; see {self.log_path}")

    def answers(self):
        try:
            return bench.http_get(f"http://127.0.0.1:{self.listen}/nginx-ready") == (200, "ready\n")
        except OSError:
            return False

    def error_log(self):
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def errors(self):
        """The error log's lines at [error] or worse."""
        return [line for line in self.error_log().splitlines() if any(level in line for level in LOG_LEVELS)]

    def counters(self):
        return {}

    def cpu_seconds(self):
        """CPU time of the master and its workers so far (/proc/<pid>/stat of each)."""
        pids = [self.proc.pid]
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        if int(f.read().rsplit(")", 1)[1].split()[1]) == self.proc.pid:
                            pids.append(int(entry))
                except (OSError, IndexError, ValueError):
                    pass
        total = 0.0
        for pid in pids:
            try:
                total += cpu_seconds(pid)
            except OSError:
                pass
        return total

    def stop(self):
        bench.stop_process(self.proc, self.log, self.pidfile, grace_s=10)


def start(tag, host, limiter, path, workdir, stack):
    limit = PATHS.get(path)
    if host == "envoy":
        if limiter == "none":
            return bench.Envoy(ARGS.envoy, ARGS.wasm, "no-limiter.yaml.tmpl", {}, ARGS.concurrency, workdir, tag)
        if limiter == "native":
            return bench.Envoy(ARGS.envoy, ARGS.wasm, "native-local-ratelimit.yaml.tmpl", bench.native_bucket(limit),
                               ARGS.concurrency, workdir, tag)
        config = path if limiter == "floor" else bench.sluice_config(limit)
        wasm = ARGS.floor_wasm if limiter == "floor" else ARGS.wasm
        return bench.Envoy(ARGS.envoy, wasm, "sluice.yaml.tmpl", {"PLUGIN_CONFIG": config}, ARGS.concurrency,
                           workdir, tag)
    zone, wasm = "", ARGS.wasm
    if limiter == "none":
        edge = ""
    elif limiter == "limit_req":
        zone, edge = limit_req(limit)
    elif limiter == "floor":
        wasm, edge = ARGS.floor_wasm, proxy_wasm(path)
    elif limiter == "sluice":
        edge = proxy_wasm(nginx_sluice_config(limit))
    else:
        edge = proxy_wasm(nginx_sluice_config(limit, stack.token, stack.service.port))
    return Nginx(ARGS.nginx, ARGS.module, wasm, zone, edge, ARGS.concurrency, workdir, tag)


def main():
    workdir = os.path.join(ROOT, ".run", "bench-nginx")
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    chosen = variants()
    if ARGS.only:
        keep = set(ARGS.only.split(","))
        unknown = keep - {v[0] for v in chosen}
        if unknown:
            sys.exit(f"bench: no variant {', '.join(sorted(unknown))}; the variants: {', '.join(v[0] for v in chosen)}")
        chosen = [v for v in chosen if v[0] in keep]
    info = bench.machine(ARGS.envoy)
    version = re.search(r"/(\d+\.\d+\.\d+)/", info["envoy"])
    info["envoy"] = version.group(1) if version else info["envoy"]
    info["nginx"] = tool_version([ARGS.nginx, "-v"]).split("/")[-1]
    info["load_before"] = loadavg()
    print(f"bench: {ARGS.rounds} round(s) x {len(chosen)} variants, wrk -t{ARGS.threads} -c{ARGS.connections} "
          f"-d{ARGS.duration}s, Envoy --concurrency {ARGS.concurrency}, nginx worker_processes {ARGS.concurrency}; "
          f"{info['nproc']} CPUs, {info['cpu']}, load average {info['load_before']}", file=sys.stderr)
    stack = None
    if any(limiter == "cached" for _, _, limiter, _ in chosen):
        stack = Stack(workdir, ARGS.redis_server, ARGS.service)
    runs = []
    try:
        for r in range(ARGS.rounds):
            order = chosen[r % len(chosen):] + chosen[: r % len(chosen)]
            for name, host, limiter, path in order:
                tag = f"r{r + 1}-{name}"
                if stack:
                    stack.check_alive()
                    syncs = stack.service.metrics().get("sluice_syncs_total", 0)
                proxy = start(tag, host, limiter, path, workdir, stack)
                try:
                    result, before, after = bench.measure(proxy, ARGS.threads, ARGS.connections, ARGS.duration,
                                                          os.path.join(workdir, f"{tag}.wrk.txt"))
                finally:
                    proxy.stop()
                result.update(round=r + 1, variant=name, host=host, limiter=limiter, path=path,
                              load=loadavg())
                if host == "nginx":
                    result["log_errors"] = proxy.errors()
                if host == "envoy" and limiter in bench.COUNTERS:
                    ok, limited = bench.COUNTERS[limiter]
                    result["admitted"] = after.get(ok, 0) - before.get(ok, 0)
                    result["denied"] = after.get(limited, 0) - before.get(limited, 0)
                if limiter == "cached":
                    # sync batches the service answered while this nginx ran: the rule was synced, not left alone
                    result["syncs"] = int(stack.service.metrics().get("sluice_syncs_total", 0) - syncs)
                runs.append(result)
                print(f"  round {r + 1} {name:22} {result['rps']:>9.0f} req/s  p99 {result['p99_ms']:.3f} ms  "
                      f"CPU {result['cpu_us']:.1f} us/req  non-2xx {result['non2xx']}  "
                      f"errors {result['socket_errors'] or '-'}  log errors {len(result.get('log_errors', []))}",
                      file=sys.stderr)
    finally:
        if stack:
            stack.stop()
    info["load_after"] = loadavg()
    with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump({"machine": info, "args": vars(ARGS), "runs": runs}, f, indent=2)
    print(table(runs, chosen, info))


def spread(values, fmt):
    return f"{fmt.format(min(values))}–{fmt.format(max(values))}"


def table(runs, chosen, info):
    med, rng = {}, {}
    for name, *_ in chosen:
        mine = [r for r in runs if r["variant"] == name]
        med[name] = {k: statistics.median(r[k] for r in mine) for k in ("rps", "p99_ms", "cpu_us")}
        med[name]["denied_share"] = statistics.median(r["non2xx"] / max(r["requests"], 1) for r in mine)
        rng[name] = (spread([r["rps"] for r in mine], "{:,.0f}"), spread([r["p99_ms"] for r in mine], "{:.2f}"))

    def ratio(a, b):
        if a not in med or b not in med:
            return "-"
        return f"{med[a]['rps'] / med[b]['rps']:.2f} (p99 {med[a]['p99_ms'] / med[b]['p99_ms']:.2f})"

    lines = [
        f"wrk -t{ARGS.threads} -c{ARGS.connections} -d{ARGS.duration}s --latency; Envoy {info['envoy']} "
        f"--concurrency {ARGS.concurrency}; nginx {info['nginx']} worker_processes {ARGS.concurrency}; "
        f"{ARGS.rounds} round(s), medians (min–max over the rounds); {info['nproc']} CPUs ({info['cpu']}); "
        f"load average {info['load_before']} before, {info['load_after']} after",
        "",
        "| host | variant | path | requests/s | (rounds) | p99 ms | (rounds) | CPU µs / request | denied |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, host, limiter, path in chosen:
        m = med[name]
        lines.append(f"| {host} | {limiter} | {path or '-'} | {m['rps']:,.0f} | {rng[name][0]} | {m['p99_ms']:.2f} | "
                     f"{rng[name][1]} | {m['cpu_us']:.1f} | {m['denied_share']:.1%} |")
    lines += [
        "",
        "Ratios of medians, requests/s (p99 in parentheses); native is Envoy's `local_ratelimit`, nginx's `limit_req`:",
        "",
        "| host | path | sluice / floor | floor / none | sluice / native | floor / native | cached / sluice | "
        "cached / native |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for host, native in (("envoy", "native"), ("nginx", "limit_req")):
        for path in PATHS:
            n = f"{host}-{native}-{path}"
            s, fl, c = f"{host}-sluice-{path}", f"{host}-floor-{path}", f"{host}-cached-{path}"
            if not any(v in med for v in (n, s, fl, c)):
                continue
            lines.append(f"| {host} | {path} | {ratio(s, fl)} | {ratio(fl, f'{host}-none')} | {ratio(s, n)} | "
                         f"{ratio(fl, n)} | {ratio(c, s)} | {ratio(c, n)} |")
    same = [(name, f"envoy-{name[len('nginx-'):].replace('limit_req', 'native')}") for name, host, *_ in chosen
            if host == "nginx"]
    same = [(a, b) for a, b in same if b in med]
    if same:
        lines += ["", "nginx / Envoy, each variant beside its Envoy counterpart (limit_req beside local_ratelimit):",
                  "", "| variant | nginx / Envoy |", "| --- | ---: |"]
        lines += [f"| {a[len('nginx-'):]} | {ratio(a, b)} |" for a, b in same]
    lines += [
        "",
        "Each run (syncs: the service's answered sync batches while that nginx ran; log errors: nginx's error log "
        "lines at [error] or worse):",
        "",
        "| round | variant | requests/s | p99 ms | CPU µs / request | requests | non-2xx | socket errors | admitted | "
        "denied | syncs | log errors | load |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in runs:
        log_errors = len(r["log_errors"]) if "log_errors" in r else "-"
        lines.append(
            f"| {r['round']} | {r['variant']} | {r['rps']:.0f} | {r['p99_ms']:.3f} | {r['cpu_us']:.1f} | "
            f"{r['requests']} | {r['non2xx']} | {r['socket_errors'] or '-'} | {r.get('admitted', '-')} | "
            f"{r.get('denied', '-')} | {r.get('syncs', '-')} | {log_errors} | {r['load']} |")
    firsts = [(r["variant"], r["round"], r["log_errors"][0]) for r in runs if r.get("log_errors")]
    if firsts:
        lines += ["", "nginx's error log, the first line at [error] or worse of each run that had one:", ""]
        lines += [f"- r{rnd} {variant}: `{line}`" for variant, rnd, line in firsts]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=int, default=10, help="seconds of each measured wrk run")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=2, help="Envoy worker threads and nginx worker processes")
    parser.add_argument("--only", help="comma-separated variants to run (default: all; a wrong name lists them)")
    parser.add_argument("--module", default=os.environ.get("SLUICE_NGINX_MODULE"),
                        help="ngx_wasmx_module.so (default: $SLUICE_NGINX_MODULE)")
    parser.add_argument("--nginx", default=os.environ.get("SLUICE_NGINX") or shutil.which("nginx") or "/usr/sbin/nginx",
                        help="the nginx release the module was built against (default: $SLUICE_NGINX, nginx in PATH)")
    parser.add_argument("--envoy", default=os.environ.get("SLUICE_ENVOY", os.path.join(ROOT, ".venv/bin/envoy")))
    parser.add_argument("--wasm", default=os.environ.get(
        "SLUICE_WASM", os.path.join(ROOT, "target/wasm32-wasip1/release/sluice_filter.wasm")))
    parser.add_argument("--floor-wasm", default=os.environ.get(
        "SLUICE_FLOOR_WASM", os.path.join(ROOT, "target/wasm32-wasip1/release/sluice_floor.wasm")))
    parser.add_argument("--service", default=os.environ.get(
        "SLUICE_COUNTER_SERVICE", os.path.join(ROOT, "target/release/sluice-counter-service")))
    parser.add_argument("--redis-server", default=os.environ.get("SLUICE_REDIS_SERVER") or shutil.which("redis-server"))
    ARGS = parser.parse_args()
    if not ARGS.module or not os.path.isfile(ARGS.module):
        sys.exit(f"bench: no ngx_wasmx_module.so ({ARGS.module or 'SLUICE_NGINX_MODULE is not set'}): "
                 "see docs/nginx.md")
    for what in (ARGS.nginx, ARGS.envoy, ARGS.wasm, ARGS.floor_wasm):
        if not os.path.isfile(what):
            sys.exit(f"bench: {what} is missing: run `make deps build`")
    ARGS.module, ARGS.wasm, ARGS.floor_wasm = (os.path.abspath(p) for p in (ARGS.module, ARGS.wasm, ARGS.floor_wasm))
    main()
