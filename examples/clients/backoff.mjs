#!/usr/bin/env node
// An HTTP client that backs off as docs/clients.md asks, with Node's standard library only (node:http, node:https).
//
// It does exactly what backoff.rs and backoff.py next to it do (backoff.rs's header comment says it at length):
// COUNT requests to URL, one after the other; a 429 or 503 with Retry-After retried that many seconds after the
// answer, not before; without it (and for 502, 504, connection errors) exponential backoff with full jitter; a
// non-idempotent request retried on a 503 only when sluice's body says sluice answered it; retries out of a
// token-bucket budget (BUDGET tokens, +0.1 per request, -1 per retry) and at most MAX_ATTEMPTS tries; with --pace,
// the next request held T seconds (MAX_WAIT_S at most) after an answer saying none is left (RateLimit r=0;t=T, or
// X-RateLimit-*).
//
// One line per try and per wait, times in ms since it started (a monotonic clock):
//   attempt request=4 try=1 sent_ms=12 done_ms=14 status=429 retry_after=2 remaining=0 reset=4
//   wait request=4 ms=2000 reason=retry-after
//
// node examples/clients/backoff.mjs http://127.0.0.1:10000/api/x 8

import http from "node:http";
import https from "node:https";
import { performance } from "node:perf_hooks";

const IDEMPOTENT = new Set(["GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE"]);
const SLUICE_ERRORS = new Set(["overloaded", "limiter_unavailable", "rate_limited"]);
const USAGE =
  "usage: backoff.mjs URL COUNT [--method M] [--max-attempts N] [--budget N] [--base-ms N] [--cap-ms N] " +
  "[--max-wait-s N] [--pace]";

function options(argv) {
  const o = { method: "GET", maxAttempts: 5, budget: 10, baseMs: 100, capMs: 10000, maxWaitS: 60, pace: false };
  const names = {
    "--max-attempts": "maxAttempts", "--budget": "budget", "--base-ms": "baseMs", "--cap-ms": "capMs",
    "--max-wait-s": "maxWaitS",
  };
  const positional = [];
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i];
    if (arg === "--pace") o.pace = true;
    else if (arg === "--method") o.method = String(argv[++i]).toUpperCase();
    else if (arg in names) {
      const value = Number(argv[++i]);
      if (!Number.isInteger(value) || value < 0) throw new Error(`${arg}: not a number`);
      o[names[arg]] = value;
    } else if (arg.startsWith("--")) throw new Error(`unknown option ${arg}`);
    else positional.push(arg);
  }
  if (positional.length !== 2) throw new Error("URL and COUNT are required");
  o.url = positional[0];
  o.count = Number(positional[1]);
  if (!Number.isInteger(o.count)) throw new Error("COUNT: not a number");
  return o;
}

const number = (value) => (value !== undefined && /^\s*\d+\s*$/.test(value) ? Number(value) : null);

// r and t of a RateLimit header ("rule";r=0;t=4); of several items, the one with the fewest left.
function draftFields(value) {
  let best = [null, null];
  for (const item of (value || "").split(",")) {
    const params = Object.fromEntries(
      item.split(";").slice(1).map((p) => p.trim().split("=", 2)).filter((p) => p.length === 2),
    );
    const r = number(params.r), t = number(params.t);
    if (r !== null && (best[0] === null || r < best[0])) best = [r, t];
  }
  return best;
}

// { status, headers, body }; status 0 for a connection error.
function send(url, method) {
  return new Promise((resolve) => {
    const client = url.startsWith("https:") ? https : http;
    const request = client.request(url, { method, timeout: 10000, agent: false }, (response) => {
      const chunks = [];
      response.on("data", (chunk) => chunks.push(chunk));
      response.on("end", () =>
        resolve({ status: response.statusCode, headers: response.headers, body: Buffer.concat(chunks).toString() }),
      );
      response.on("error", () => resolve({ status: 0, headers: {}, body: "" }));
    });
    request.on("timeout", () => request.destroy(new Error("timeout")));
    request.on("error", () => resolve({ status: 0, headers: {}, body: "" }));
    request.end();
  });
}

// Whether the body is sluice's own answer: then the request never reached the upstream.
function sluiceAnswered(body) {
  try {
    return SLUICE_ERRORS.has(JSON.parse(body).error);
  } catch {
    return false;
  }
}

// Node's timers may fire a little early: wait until the monotonic clock says so.
async function sleepUntil(deadline) {
  for (let left = deadline - performance.now(); left > 0; left = deadline - performance.now()) {
    await new Promise((resolve) => setTimeout(resolve, Math.ceil(left)));
  }
}

async function main() {
  let o;
  try {
    o = options(process.argv.slice(2));
  } catch (e) {
    console.error(`${e.message}\n${USAGE}`);
    process.exit(2);
  }
  const start = performance.now();
  const ms = (at) => Math.floor(at - start);
  const show = (value) => (value === null ? "-" : value);
  // Retries spend a token, requests earn back 0.1: at most about 10% of requests are retries.
  const budget = { tokens: o.budget };
  let holdUntil = null;
  let ok = 0, failed = 0, attempts = 0, retries = 0;
  for (let request = 1; request <= o.count; request++) {
    if (holdUntil !== null) {
      const now = performance.now();
      if (holdUntil > now) {
        console.log(`wait request=${request} ms=${ms(holdUntil) - ms(now)} reason=quota`);
        await sleepUntil(holdUntil);
      }
      holdUntil = null;
    }
    budget.tokens = Math.min(budget.tokens + 0.1, o.budget);
    for (let attempt = 1; ; attempt++) {
      const sent = performance.now();
      const answer = await send(o.url, o.method);
      const done = performance.now();
      attempts++;
      const retryAfter = number(answer.headers["retry-after"]);
      let [remaining, reset] = draftFields(answer.headers["ratelimit"]);
      if (remaining === null) {
        remaining = number(answer.headers["x-ratelimit-remaining"]);
        reset = number(answer.headers["x-ratelimit-reset"]);
        // A Unix time (x_ratelimit_reset "unix") becomes seconds from now.
        if (reset !== null && reset > 1e9) reset = Math.max(0, reset - Math.floor(Date.now() / 1000));
      }
      console.log(
        `attempt request=${request} try=${attempt} sent_ms=${ms(sent)} done_ms=${ms(done)} ` +
          `status=${answer.status} retry_after=${show(retryAfter)} remaining=${show(remaining)} reset=${show(reset)}`,
      );
      // A hint of any length is held at most maxWaitS: a server cannot make the client sleep for ever.
      if (o.pace && remaining === 0 && reset !== null) holdUntil = done + Math.min(reset, o.maxWaitS) * 1000;
      if (answer.status >= 200 && answer.status < 400) {
        ok++;
        break;
      }
      let reason = null;
      if (![0, 429, 502, 503, 504].includes(answer.status)) reason = "status";
      // A request that may have reached the upstream is not sent twice unless sending it twice is harmless.
      else if (!IDEMPOTENT.has(o.method) && answer.status !== 429 && !sluiceAnswered(answer.body))
        reason = "not_idempotent";
      else if (attempt >= o.maxAttempts) reason = "attempts";
      else if (retryAfter !== null && retryAfter > o.maxWaitS) reason = "retry_after_too_long";
      else if (budget.tokens < 1) reason = "budget";
      if (reason !== null) {
        console.log(`give_up request=${request} reason=${reason}`);
        failed++;
        break;
      }
      budget.tokens -= 1;
      let waitMs, why;
      if (retryAfter !== null) [waitMs, why] = [retryAfter * 1000, "retry-after"];
      else {
        const ceiling = Math.min(o.capMs, o.baseMs * 2 ** (attempt - 1));
        [waitMs, why] = [Math.floor(Math.random() * (ceiling + 1)), "backoff"];
      }
      console.log(`wait request=${request} ms=${waitMs} reason=${why}`);
      await sleepUntil(done + waitMs);
      retries++;
    }
  }
  console.log(`summary ok=${ok} failed=${failed} attempts=${attempts} retries=${retries}`);
}

await main();
