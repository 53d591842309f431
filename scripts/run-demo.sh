#!/usr/bin/env bash
# The demo behind `make run`: Redis on 127.0.0.1:6390, the counter service on 127.0.0.1:8081, and Envoy (4 workers)
# with sluice on 127.0.0.1:10000 in front of a demo upstream, admin on 127.0.0.1:9901. Stays in the foreground;
# Ctrl-C stops everything it started. scripts/run-second-proxy.sh adds a second Envoy that shares the limits.
set -euo pipefail
cd "$(dirname "$0")/.."

ENVOY=${SLUICE_ENVOY:-.venv/bin/envoy}
SERVICE=${SLUICE_COUNTER_SERVICE:-target/release/sluice-counter-service}
REDIS_SERVER=${SLUICE_REDIS_SERVER:-redis-server}
REDIS_PORT=6390
SERVICE_ADDR=127.0.0.1:8081
TOKEN=demo-token
RUN_DIR=.run/demo
mkdir -p "$RUN_DIR/redis"
scripts/stop-pids.sh "$RUN_DIR"   # a previous demo killed hard

pids=()
cleanup() {
  trap - INT TERM EXIT
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -f "$RUN_DIR"/*.pid
  echo "demo stopped"
}
trap cleanup INT TERM EXIT

# start NAME CMD...: runs CMD in the background, logging to $RUN_DIR/NAME.log, and records its pid.
start() {
  local name=$1
  shift
  "$@" >"$RUN_DIR/$name.log" 2>&1 &
  pids+=($!)
  echo $! >"$RUN_DIR/$name.pid"
}

# wait_for NAME URL EXPECTED: polls URL (30 s at most) until its body is EXPECTED; gives up if anything started
# so far exited, with its log.
wait_for() {
  local name=$1 url=$2 expected=$3
  for _ in $(seq 300); do
    [ "$(curl -s --max-time 1 "$url" || true)" = "$expected" ] && return 0
    for pidfile in "$RUN_DIR"/*.pid; do
      if ! kill -0 "$(cat "$pidfile")" 2>/dev/null; then
        local dead
        dead=$(basename "$pidfile" .pid)
        echo "$dead exited; its log ($RUN_DIR/$dead.log):" >&2
        tail -n 30 "$RUN_DIR/$dead.log" >&2
        exit 1
      fi
    done
    sleep 0.1
  done
  echo "$name not ready after 30 s; its log: $RUN_DIR/$name.log" >&2
  exit 1
}

# Redis: the counter service's store. Nothing persisted; its working dir is .run/demo/redis. The service's
# /readyz (below) answers 200 once Redis answers PING.
start redis "$REDIS_SERVER" --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no \
  --dir "$RUN_DIR/redis"

# The counter service: global quotas for the "shared" rule.
printf %s "$TOKEN" >"$RUN_DIR/token"   # a file, not a flag: flags show in the process list
start service "$SERVICE" --bind "$SERVICE_ADDR" --redis-url "redis://127.0.0.1:$REDIS_PORT" --token-file "$RUN_DIR/token"
wait_for service "http://$SERVICE_ADDR/readyz" '{"status":"ready"}'

start envoy "$ENVOY" -c envoy/demo.yaml --concurrency 4 --disable-hot-restart --log-level info
wait_for envoy http://127.0.0.1:9901/ready LIVE

cat <<'TEXT'
sluice demo is up (logs in .run/demo/):
  Envoy with sluice   127.0.0.1:10000, admin 127.0.0.1:9901
  counter service     127.0.0.1:8081 (token demo-token), Redis on 127.0.0.1:6390
Rule "demo"   (local):  5 requests per minute per client IP on /api/ (then one more every 12 s).
Rule "shared" (cached): 10 requests per minute on /shared/ for everyone, shared by every proxy through the
                        counter service. /healthz is never limited.

  curl -i http://127.0.0.1:10000/api/hello     # 200, x-ratelimit-remaining: 4, ratelimit: "demo";r=4;t=12
  for i in 1 2 3 4 5; do curl -s -o /dev/null -w '%{http_code} ' http://127.0.0.1:10000/api/hello; done; echo
                                               # 200 200 200 200 429: the 6th request within the minute is denied
  curl -i http://127.0.0.1:10000/api/hello     # 429, retry-after: 12, {"error":"rate_limited","rule":"demo",...}
  curl -i http://127.0.0.1:10000/healthz       # 200, bypassed: no rate-limit headers

  for i in $(seq 12); do curl -s -o /dev/null -w '%{http_code} ' http://127.0.0.1:10000/shared/x; sleep 0.2; done; echo
                                               # 10 × 200, then 429 429: the shared 10 per minute is spent
  curl -s http://127.0.0.1:8081/metrics | grep -E '^sluice_(syncs|granted_tokens)_total'
                                               # the service's view: syncs and tokens granted to proxies
  scripts/run-second-proxy.sh                  # (another terminal) a second Envoy on :10100, same rules and service
  for i in $(seq 10); do for p in 10000 10100; do curl -s -o /dev/null -w '%{http_code} ' http://127.0.0.1:$p/shared/x; done; done; echo
                                               # (a minute later, once the budget refilled) 10 × 200 in all, from both
  curl -s http://127.0.0.1:9901/stats | grep wasmcustom.sluice   # allowed, denied per rule; sync.ok, breaker.open

Ctrl-C stops the demo.
TEXT
wait "${pids[@]}"
