"""Redis and the counter service for the benchmarks: started on free loopback ports, stopped when done.

Used by bench/service.py and bench/latency.py. Standard library only. Every process started here gets
PR_SET_PDEATHSIG, so it never outlives the benchmark; its pid also goes to a pid file in the run directory
(`make clean-run` stops what a killed run left behind).
"""

import os
import select
import socket
import subprocess
import sys
import time
import urllib.request

from bench import die_with_parent, free_ports

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
TOKEN = "bench-token"


def cpu_seconds(pid):
    """User + system CPU seconds of a running process (all its threads), from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Process:
    """A child process with a log file and a pid file, stopped by stop()."""

    def __init__(self, args, workdir, name, stdout=None):
        self.name = name
        self.log_path = os.path.join(workdir, f"{name}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(args, stdout=stdout if stdout is not None else self.log, stderr=self.log,
                                     preexec_fn=die_with_parent)
        self.pidfile = os.path.join(workdir, f"{name}.pid")
        with open(self.pidfile, "w") as f:
            f.write(str(self.proc.pid))

    def cpu(self):
        return cpu_seconds(self.proc.pid)

    def check_alive(self):
        if self.proc.poll() is not None:
            self.stop()
            sys.exit(f"bench: {self.name} exited with {self.proc.returncode}; see {self.log_path}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        if os.path.exists(self.pidfile):
            os.remove(self.pidfile)


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


class Redis(Process):
    """redis-server on a free loopback port, no persistence."""

    def __init__(self, binary, workdir):
        (self.port,) = free_ports(1)
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--daemonize", "no", "--dir", workdir]
        super().__init__(args, workdir, "redis")
        deadline = time.time() + 10
        while time.time() < deadline:
            self.check_alive()
            try:
                if self.command("PING") == "PONG":
                    return
            except (OSError, RuntimeError):
                pass
            time.sleep(0.05)
        self.stop()
        sys.exit(f"bench: redis-server not ready within 10 s; see {self.log_path}")

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


class Service(Process):
    """sluice-counter-service on a free loopback port, against `redis`, with the bench token."""

    def __init__(self, binary, redis, workdir, extra=()):
        args = [binary, "--bind", "127.0.0.1:0", "--redis-url", f"redis://127.0.0.1:{redis.port}", *extra]
        # The token through the environment: flags show in the process list.
        env = dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "warn"), SLUICE_TOKEN=TOKEN)
        self.log_path = os.path.join(workdir, "service.log")
        self.log = open(self.log_path, "w")
        self.name = "service"
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=self.log, env=env,
                                     preexec_fn=die_with_parent)
        self.pidfile = os.path.join(workdir, "service.pid")
        with open(self.pidfile, "w") as f:
            f.write(str(self.proc.pid))
        # stdout: "sluice-counter-service listening on 127.0.0.1:PORT"
        ready, _, _ = select.select([self.proc.stdout], [], [], 10)
        line = self.proc.stdout.readline().decode() if ready else ""
        if "listening on" not in line:
            self.stop()
            sys.exit(f"bench: the counter service did not start ({line.strip()!r}); see {self.log_path}")
        self.port = int(line.rsplit(":", 1)[1])
        deadline = time.time() + 10
        while time.time() < deadline:
            self.check_alive()
            try:
                with NO_PROXY.open(f"http://127.0.0.1:{self.port}/readyz", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        sys.exit(f"bench: the counter service not ready within 10 s; see {self.log_path}")

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

    def stop(self):
        super().stop()
        if self.proc.stdout:
            self.proc.stdout.close()


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
