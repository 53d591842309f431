#!/usr/bin/env bash
# `make test` (CI) after `make deps`: everything in the order that keeps two cores busy, each tier timed.
#   1. clippy and rustfmt (`make lint`) start at once, niced to the lowest priority and in a target dir of their own (target/lint: no wait
#      on the build lock), so they take the CPU the compiles and the tests leave, mostly while tests wait on Envoy;
#   2. the Wasm artifacts (`make build-wasm`, release) beside the test compile (`make test-build`, the test profile,
#      which also builds the counter service the suites start);
#   3. the tests (`make test-only`, cargo-nextest), then the oldest Envoy's smoke (`make test-envoy-oldest-smoke`),
#      then the real-nginx suite (`make test-nginx`: it runs when SLUICE_NGINX_MODULE names a built ngx_wasm_module
#      or `make nginx` built one, and says in a box that it did not run otherwise). When a checkout of
#      ngx_wasm_module is present (NGX_WASM_MODULE_SRC, default .deps/ngx_wasm_module) and no module is named,
#      `make nginx` builds it beside the rest (the Wasmtime C API's first build adds minutes).
# Background jobs write their output to .run/ci/*.log, printed when they are waited for. Fails if any tier fails.
set -uo pipefail
cd "$(dirname "$0")/.."
make=${MAKE:-make}
logs=.run/ci
mkdir -p "$logs"
start=$(date +%s)
failed=()
times=()

now() { echo $(($(date +%s) - start)); }
# tier NAME COMMAND...: runs it in the foreground and records how long it took.
tier() {
  local name=$1 began
  shift
  began=$(now)
  echo "ci: $name starts at ${began} s"
  "$@" || failed+=("$name")
  times+=("$name: $(($(now) - began)) s (from ${began} s)")
}
# background NAME COMMAND...: starts it with its output in .run/ci/NAME.log; `finish NAME` waits and prints it.
declare -A pids began_at
background() {
  local name=$1
  shift
  began_at[$name]=$(now)
  echo "ci: $name starts at ${began_at[$name]} s (in the background, output in $logs/$name.log)"
  { "$@"; status=$?; now >"$logs/$name.ended"; exit "$status"; } >"$logs/$name.log" 2>&1 &
  pids[$name]=$!
}
finish() {
  local name=$1 status=0
  wait "${pids[$name]}" || status=$?
  echo "ci: ---- $name (exit $status) ----"
  cat "$logs/$name.log"
  echo "ci: ---- end of $name ----"
  [ "$status" = 0 ] || failed+=("$name")
  times+=("$name: $(($(cat "$logs/$name.ended") - ${began_at[$name]})) s (from ${began_at[$name]} s, in the background)")
}

background lint env CARGO_TARGET_DIR=target/lint nice -n 19 "$make" --no-print-directory lint
nginx_src="${NGX_WASM_MODULE_SRC:-.deps/ngx_wasm_module}"
build_nginx=no
if [ -z "${SLUICE_NGINX_MODULE:-}" ] && [ -f "$nginx_src/config" ]; then
  build_nginx=yes
  background nginx nice -n 5 "$make" --no-print-directory nginx
fi
background build-wasm "$make" --no-print-directory build-wasm
tier test-build "$make" --no-print-directory test-build
finish build-wasm
if [ ${#failed[@]} = 0 ]; then
  tier test-only "$make" --no-print-directory test-only
  tier test-envoy-oldest-smoke "$make" --no-print-directory test-envoy-oldest-smoke
  # Real nginx with ngx_wasm_module, when SLUICE_NGINX_MODULE names a built module or `make nginx` built one;
  # else a boxed warning.
  [ "$build_nginx" = no ] || { finish nginx; build_nginx=finished; }
  tier test-nginx "$make" --no-print-directory test-nginx
fi
[ "$build_nginx" != yes ] || finish nginx
finish lint

echo "ci: tiers"
printf '  %s\n' "${times[@]}"
echo "ci: total $(now) s"
[ -f "${SLUICE_NGINX_MODULE:-target/nginx/ngx_wasmx_module.so}" ] ||
  echo "ci: WARNING: the real-nginx suite did NOT run: no built ngx_wasm_module (make nginx, SLUICE_NGINX_MODULE; docs/nginx.md)"
if [ ${#failed[@]} != 0 ]; then
  echo "ci: FAILED: ${failed[*]}" >&2
  exit 1
fi
