#!/usr/bin/env python3
"""An HTTP client that backs off as docs/clients.md asks, with Python's standard library only (urllib).

It does exactly what backoff.rs and backoff.mjs next to it do (their header comments say it at length): COUNT
requests to URL, one after the other; a 429 or 503 with Retry-After retried that many seconds after the answer, not
before; without it (and for 502, 504, connection errors) exponential backoff with full jitter; a non-idempotent
request retried on a 503 only when sluice's body says sluice answered it; retries out of a token-bucket budget
(BUDGET tokens, +0.1 per request, -1 per retry) and at most MAX_ATTEMPTS tries; with --pace, the next request held
T seconds (MAX_WAIT_S at most) after an answer saying none is left (RateLimit r=0;t=T, or X-RateLimit-*).

One line per try and per wait, times in ms since it started (a monotonic clock):
  attempt request=4 try=1 sent_ms=12 done_ms=14 status=429 retry_after=2 remaining=0 reset=4
  wait request=4 ms=2000 reason=retry-after

python3 examples/clients/backoff.py http://127.0.0.1:10000/api/x 8
"""

import argparse
import json
import random
import sys
import time
import urllib.error
import urllib.request

IDEMPOTENT = {"GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE"}
SLUICE_ERRORS = {"overloaded", "limiter_unavailable", "rate_limited"}
# No proxy from the environment: the client talks to the URL it is given.
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class Budget:
    """Retries spend a token, requests earn back 0.1: at most about 10% of requests are retries."""

    def __init__(self, tokens):
        self.tokens = self.max = float(tokens)

    def deposit(self):
        self.tokens = min(self.tokens + 0.1, self.max)

    def withdraw(self):
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


def number(value):
    """Whole seconds or a count, ASCII digits only ("-1", "1_0" and "²" are not numbers); else None."""
    value = (value or "").strip()
    return int(value) if value.isascii() and value.isdigit() else None


def draft_fields(value):
    """r and t of a RateLimit header ("rule";r=0;t=4); of several items, the one with the fewest left."""
    best = (None, None)
    for item in value.split(","):
        params = dict(p.strip().split("=", 1) for p in item.split(";")[1:] if "=" in p)
        r, t = number(params.get("r")), number(params.get("t"))
        if r is not None and (best[0] is None or r < best[0]):
            best = (r, t)
    return best


def send(url, method):
    """(status, headers, body); status 0 for a connection error."""
    request = urllib.request.Request(url, method=method, data=b"" if method in ("POST", "PUT", "PATCH") else None)
    try:
        with OPENER.open(request, timeout=10) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()
    except (urllib.error.URLError, OSError):
        return 0, {}, b""


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("url")
    p.add_argument("count", type=int)
    p.add_argument("--method", default="GET")
    p.add_argument("--max-attempts", type=int, default=5)
    p.add_argument("--budget", type=int, default=10)
    p.add_argument("--base-ms", type=int, default=100)
    p.add_argument("--cap-ms", type=int, default=10_000)
    p.add_argument("--max-wait-s", type=int, default=60)
    p.add_argument("--pace", action="store_true")
    o = p.parse_args()
    method = o.method.upper()
    start = time.monotonic()

    def ms(at):
        return int((at - start) * 1000)

    def show(value):
        return "-" if value is None else value

    budget = Budget(o.budget)
    hold_until = None
    ok = failed = attempts = retries = 0
    for request in range(1, o.count + 1):
        if hold_until is not None:
            now = time.monotonic()
            if hold_until > now:
                print(f"wait request={request} ms={ms(hold_until) - ms(now)} reason=quota", flush=True)
                sleep_until(hold_until)
            hold_until = None
        budget.deposit()
        attempt = 1
        while True:
            sent = time.monotonic()
            status, headers, body = send(o.url, method)
            done = time.monotonic()
            attempts += 1
            retry_after = number(headers.get("retry-after"))
            remaining, reset = draft_fields(headers.get("ratelimit") or "")
            if remaining is None:
                remaining = number(headers.get("x-ratelimit-remaining"))
                reset = number(headers.get("x-ratelimit-reset"))
                if reset is not None and reset > 1_000_000_000:  # a Unix time: x_ratelimit_reset "unix"
                    reset = max(0, reset - int(time.time()))
            print(f"attempt request={request} try={attempt} sent_ms={ms(sent)} done_ms={ms(done)} status={status} "
                  f"retry_after={show(retry_after)} remaining={show(remaining)} reset={show(reset)}", flush=True)
            if o.pace and remaining == 0 and reset is not None:
                hold_until = done + min(reset, o.max_wait_s)  # a server cannot make it sleep for ever

            def give_up(reason):
                print(f"give_up request={request} reason={reason}", flush=True)

            if 200 <= status < 400:
                ok += 1
                break
            reason = None
            if status not in (0, 429, 502, 503, 504):
                reason = "status"
            # A request that may have reached the upstream is not sent twice unless sending it twice is harmless.
            elif method not in IDEMPOTENT and status != 429 and not sluice_answered(body):
                reason = "not_idempotent"
            elif attempt >= o.max_attempts:
                reason = "attempts"
            elif retry_after is not None and retry_after > o.max_wait_s:
                reason = "retry_after_too_long"
            elif not budget.withdraw():
                reason = "budget"
            if reason:
                give_up(reason)
                failed += 1
                break
            if retry_after is not None:
                wait_ms, why = retry_after * 1000, "retry-after"
            else:
                wait_ms, why = random.randint(0, min(o.cap_ms, o.base_ms * 2 ** (attempt - 1))), "backoff"
            print(f"wait request={request} ms={wait_ms} reason={why}", flush=True)
            sleep_until(done + wait_ms / 1000)
            retries += 1
            attempt += 1
    print(f"summary ok={ok} failed={failed} attempts={attempts} retries={retries}", flush=True)


def sluice_answered(body):
    """Whether the body is sluice's own answer: then the request never reached the upstream."""
    try:
        return json.loads(body).get("error") in SLUICE_ERRORS
    except (ValueError, AttributeError):
        return False


def sleep_until(deadline):
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(left)


if __name__ == "__main__":
    sys.exit(main())
