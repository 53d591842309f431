"""Redis and the counter service for the benchmarks, through the stack binary (`sluice-stack`, built from the test
fixtures by `make build-stack`): it starts both on free loopback ports and prints one JSON line with their ports
and pids; closing its stdin stops everything it started. Nothing else here starts a process.

Used by bench/service.py and bench/latency.py. Standard library only. What stays here is what the benchmarks
read while the stack runs: Redis commands (a minimal RESP2 client: FLUSHALL, SCRIPT LOAD, INFO commandstats), the
service's /metrics, the CPU time of a process (/proc/<pid>/stat), and the machine's description.
"""

import json
import os
import select
import socket
import subprocess
import sys
import urllib.request

from bench import die_with_parent

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
STACK = os.environ.get("SLUICE_STACK", os.path.join(ROOT, "target/debug/sluice-stack"))
START_TIMEOUT_S = 60


def cpu_seconds(pid):
    """User + system CPU seconds of a running process (all its threads), from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def resp_command(sock, *args):
    """Sends one Redis command and returns the reply (a minimal RESP2 client, enough for the benchmarks)."""
    out = b"*%d\r\n" % len(args)
    for a in args:
        a = a if isinstance(a, bytes) else str(a).encode()
        out += b"$%d\r\n%s\r\n" % (len(a), a)
    sock.sendall(out)
    reader = sock.makefile("rb")
    try:
        return _read_reply(reader)
    finally:
        reader.close()


def _read_reply(reader):
    line = reader.readline()
    if not line:
        raise OSError("redis closed the connection")
    kind, rest = line[:1], line[1:-2]
    if kind == b"+":
        return rest.decode()
    if kind == b"-":
        raise RuntimeError(rest.decode())
    if kind == b":":
        return int(rest)
    if kind == b"$":
        n = int(rest)
        if n < 0:
            return None
        data = reader.read(n + 2)[:-2]
        return data.decode()
    if kind == b"*":
        n = int(rest)
        return None if n < 0 else [_read_reply(reader) for _ in range(n)]
    raise RuntimeError(f"unexpected redis reply {line!r}")


class Redis:
    """The stack's redis-server: its port and pid, from the stack's JSON line."""

    def __init__(self, info):
        self.port, self.pid = info["port"], info["pid"]

    def cpu(self):
        return cpu_seconds(self.pid)

    def command(self, *args):
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as sock:
            return resp_command(sock, *args)

    def commandstats(self):
        """{command: (calls, usec)}, from INFO commandstats (usec: time Redis spent executing them)."""
        out = {}
        for line in self.command("INFO", "commandstats").splitlines():
            if line.startswith("cmdstat_"):
                name, _, fields = line[len("cmdstat_"):].partition(":")
                stats = dict(f.split("=") for f in fields.split(","))
                out[name] = (int(stats["calls"]), int(stats["usec"]))
        return out


class Service:
    """The stack's counter service: its port and pid, from the stack's JSON line."""

    def __init__(self, info):
        self.port, self.pid = info["port"], info["pid"]

    def cpu(self):
        return cpu_seconds(self.pid)

    def metrics(self):
        """The service's own counters (name with labels -> value), from GET /metrics."""
        with NO_PROXY.open(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                try:
                    out[name] = float(value)
                except ValueError:
                    pass
        return out


class Stack:
    """`sluice-stack --proxies 0 --free-ports`: Redis and the counter service, stopped by stop() (or when this
    process dies: the stack's stdin closes, and it gets PR_SET_PDEATHSIG). `.redis`, `.service`, `.token`."""

    def __init__(self, workdir, redis_server, service_binary, service_args=()):
        if not os.access(STACK, os.X_OK):
            sys.exit(f"bench: {STACK} is missing: run `make build-stack`")
        args = [STACK, "--proxies", "0", "--free-ports", "--run-dir", workdir, "--", *service_args]
        env = dict(os.environ, SLUICE_REDIS_SERVER=redis_server, SLUICE_SERVICE_BIN=service_binary,
                   RUST_LOG=os.environ.get("RUST_LOG", "warn"))
        env.pop("SLUICE_TOKEN", None)  # a fresh token, read back from the token file
        self.log_path = os.path.join(workdir, "sluice-stack.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=env,
                                     preexec_fn=die_with_parent)
        ready, _, _ = select.select([self.proc.stdout], [], [], START_TIMEOUT_S)
        line = self.proc.stdout.readline().decode() if ready else ""
        try:
            info = json.loads(line)
        except ValueError:
            self.stop()
            sys.exit(f"bench: the stack did not start ({line.strip()!r}); see {self.log_path}")
        self.redis = Redis(info["redis"])
        self.service = Service(info["service"])
        with open(info["token_file"]) as f:
            self.token = f.read()

    def check_alive(self):
        """Exits if the stack stopped (it stops when Redis or the service exits)."""
        if self.proc.poll() is not None:
            self.stop()
            sys.exit(f"bench: the stack exited with {self.proc.returncode}; see {self.log_path}")

    def stop(self):
        """Closes the stack's stdin, so it stops what it started; waits (bounded) for it to exit."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream and not stream.closed:
                stream.close()
        self.log.close()


def machine():
    model = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as f:
        mem_kb = int(f.readline().split()[1])
    return {"nproc": os.cpu_count(), "cpu": model, "mem_gib": round(mem_kb / 1024 / 1024)}


def loadavg():
    """The 1-minute load average: how busy the machine was, the benchmark included."""
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def tool_version(args):
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr).strip() else "unknown"
