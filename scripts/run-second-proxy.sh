#!/usr/bin/env bash
# A second proxy for the demo (`make run` must be running): Envoy (2 workers) with the demo's configuration on
# 127.0.0.1:10100 (upstream :10101, admin :9911), syncing with the same counter service, so the "shared" rule's
# 10 requests per minute are shared by both proxies. Stays in the foreground; Ctrl-C stops it.
set -euo pipefail
cd "$(dirname "$0")/.."

ENVOY=${SLUICE_ENVOY:-.venv/bin/envoy}
RUN_DIR=.run/demo
mkdir -p "$RUN_DIR"
curl -s --max-time 1 http://127.0.0.1:8081/healthz >/dev/null || {
  echo "the counter service is not answering on 127.0.0.1:8081: start the demo first (make run)" >&2
  exit 1
}

# The demo's configuration with every port moved by 100 (10000 -> 10100, 10001 -> 10101, 9901 -> 9911); the
# counter service's port (8081) stays.
sed -e 's/port_value: 10000 }/port_value: 10100 }/' -e 's/port_value: 10001 }/port_value: 10101 }/' \
  -e 's/port_value: 9901 }/port_value: 9911 }/' envoy/demo.yaml >"$RUN_DIR/envoy-2.yaml"

"$ENVOY" -c "$RUN_DIR/envoy-2.yaml" --concurrency 2 --disable-hot-restart --log-level info \
  >"$RUN_DIR/envoy-2.log" 2>&1 &
pid=$!
echo $pid >"$RUN_DIR/envoy-2.pid"
cleanup() {
  trap - INT TERM EXIT
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  rm -f "$RUN_DIR/envoy-2.pid"
  echo "second proxy stopped"
}
trap cleanup INT TERM EXIT

for _ in $(seq 300); do
  [ "$(curl -s --max-time 1 http://127.0.0.1:9911/ready || true)" = LIVE ] && break
  kill -0 $pid 2>/dev/null || { echo "Envoy exited; its log ($RUN_DIR/envoy-2.log):" >&2; tail -n 30 "$RUN_DIR/envoy-2.log" >&2; exit 1; }
  sleep 0.1
done
[ "$(curl -s --max-time 1 http://127.0.0.1:9911/ready || true)" = LIVE ] || { echo "Envoy not ready after 30 s" >&2; exit 1; }

cat <<'TEXT'
second proxy is up: Envoy with sluice on 127.0.0.1:10100, admin 127.0.0.1:9911 (log: .run/demo/envoy-2.log)
The "shared" rule's 10 per minute is one budget for both proxies:

  for i in $(seq 10); do for p in 10000 10100; do curl -s -o /dev/null -w '%{http_code} ' http://127.0.0.1:$p/shared/x; done; done; echo
                      # 10 × 200 in all (once the minute's budget is whole), then 429 from both proxies
  curl -s http://127.0.0.1:9911/stats | grep -E 'wasmcustom.sluice.(rule.shared|sync.ok)'

Ctrl-C stops this proxy (the demo goes on).
TEXT
wait $pid
