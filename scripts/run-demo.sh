#!/usr/bin/env bash
# The demo behind `make run`: Envoy (4 workers) with sluice on 127.0.0.1:10000 in front of a demo upstream,
# admin on 127.0.0.1:9901. Stays in the foreground; Ctrl-C stops everything it started.
set -euo pipefail
cd "$(dirname "$0")/.."

ENVOY=${SLUICE_ENVOY:-.venv/bin/envoy}
RUN_DIR=.run/demo
mkdir -p "$RUN_DIR"
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

# --- Redis and the counter service (global quotas) join here, before Envoy: -------------------------------
# start them in the background, append their pids to `pids` and write "$RUN_DIR/<name>.pid" as below.

"$ENVOY" -c envoy/demo.yaml --concurrency 4 --disable-hot-restart --log-level info \
  >"$RUN_DIR/envoy.log" 2>&1 &
pids+=($!)
echo $! >"$RUN_DIR/envoy.pid"

for _ in $(seq 300); do
  [ "$(curl -s --max-time 1 http://127.0.0.1:9901/ready || true)" = LIVE ] && break
  if ! kill -0 "${pids[-1]}" 2>/dev/null; then
    echo "Envoy exited; its log ($RUN_DIR/envoy.log):" >&2
    tail -n 30 "$RUN_DIR/envoy.log" >&2
    exit 1
  fi
  sleep 0.1
done
[ "$(curl -s --max-time 1 http://127.0.0.1:9901/ready || true)" = LIVE ] || { echo "Envoy not ready after 30 s" >&2; exit 1; }

cat <<'TEXT'
sluice demo is up: Envoy with sluice on 127.0.0.1:10000, admin on 127.0.0.1:9901 (log: .run/demo/envoy.log)
Rule "demo": 5 requests per minute per client IP on /api/ (then one more every 12 s); /healthz is never limited.

  curl -i http://127.0.0.1:10000/api/hello     # 200, x-ratelimit-remaining: 4, ratelimit: "demo";r=4;t=12
  for i in 1 2 3 4 5; do curl -s -o /dev/null -w '%{http_code} ' http://127.0.0.1:10000/api/hello; done; echo
                                               # 200 200 200 200 429: the 6th request within the minute is denied
  curl -i http://127.0.0.1:10000/api/hello     # 429, retry-after: 12, {"error":"rate_limited","rule":"demo",...}
  curl -i http://127.0.0.1:10000/healthz       # 200, bypassed: no rate-limit headers
  curl -s http://127.0.0.1:9901/stats | grep wasmcustom.sluice   # allowed, denied, ... per rule

Ctrl-C stops the demo.
TEXT
wait "${pids[@]}"
