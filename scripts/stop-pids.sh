#!/usr/bin/env bash
# Stops the processes recorded in <dir>/**/*.pid by the demo and the benchmark, and removes the pid files.
# Usage: scripts/stop-pids.sh .run
set -euo pipefail

dir=${1:-.run}
[ -d "$dir" ] || exit 0
find "$dir" -name '*.pid' -type f | while read -r pidfile; do
  pid=$(cat "$pidfile")
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    echo "stopping $(basename "$pidfile" .pid) (pid $pid)"
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$pidfile"
done
