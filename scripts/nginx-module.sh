#!/usr/bin/env bash
# Builds Kong's ngx_wasm_module as a dynamic module for Debian's nginx, with Wasmtime: the module the
# real-nginx suite and bench load (`make nginx`, docs/nginx.md).
#
#   1. the Wasmtime C API from crates.io (nginx/wasmtime-c-api: libwasmtime.a) and its headers;
#   2. nginx's source tree from Debian's nginx-dev, configured with the flags Debian's nginx was built with
#      (its conf_flags, which include --with-compat) and the module added as a dynamic module;
#   3. `make -f objs/Makefile modules`: only the module is compiled (nginx-dev's tree writes no top Makefile).
#
# The module's source is a checkout of its public repository, named by NGX_WASM_MODULE_SRC (default
# .deps/ngx_wasm_module), at the commit NGX_WASM_MODULE_COMMIT (both set by the Makefile). With no source there,
# the release tarball of that commit is unpacked there from NGX_WASM_MODULE_VENDOR (default ../shared/vendor,
# where the machines that build sluice keep what no registry serves): ngx_wasm_module-<commit>.tar.gz, its commit
# in its name. Everything is built under target/nginx/; the result is target/nginx/ngx_wasmx_module.so.
set -euo pipefail
cd "$(dirname "$0")/.."

src="${NGX_WASM_MODULE_SRC:-.deps/ngx_wasm_module}"
commit="${NGX_WASM_MODULE_COMMIT:?the pinned ngx_wasm_module commit (set by the Makefile)}"
ref="${NGX_WASM_MODULE_REF:-$commit}"
vendor="${NGX_WASM_MODULE_VENDOR:-../shared/vendor}"
out="$PWD/target/nginx"
cargo="${CARGO:-cargo}"
# An unpacked tarball says its commit in this file (it is no git checkout).
stamp=".sluice-commit"

how_to_get() {
  cat >&2 <<EOF
nginx: get ngx_wasm_module's source at the pinned release, e.g.:
  git clone https://github.com/Kong/ngx_wasm_module.git .deps/ngx_wasm_module
  git -C .deps/ngx_wasm_module checkout $ref
then: make nginx   (NGX_WASM_MODULE_SRC=DIR for a checkout elsewhere)
EOF
}

# No source yet: the vendored release tarball of the pinned commit, if the machine has it.
tarball="$vendor/ngx_wasm_module-$commit.tar.gz"
if [ ! -e "$src" ] && [ -f "$tarball" ]; then
  echo "nginx: unpacking $tarball (commit $commit, as its name says) into $(dirname "$src")/"
  mkdir -p "$(dirname "$src")"
  unpacked="$(mktemp -d "$(dirname "$src")/.unpack.XXXXXX")"
  tar -xzf "$tarball" -C "$unpacked"
  echo "$commit" >"$unpacked/ngx_wasm_module/$stamp"
  mv "$unpacked/ngx_wasm_module" "$src"
  rmdir "$unpacked"
elif [ ! -e "$src" ]; then
  for other in "$vendor"/ngx_wasm_module-*.tar.gz; do
    [ -f "$other" ] && echo "nginx: $other is not of the pinned commit $commit" >&2
  done
fi

if [ ! -f "$src/config" ] || [ ! -d "$src/src/wasm" ]; then
  echo "nginx: NGX_WASM_MODULE_SRC=$src is not ngx_wasm_module's source (no config, no src/wasm)" >&2
  how_to_get
  exit 2
fi
src="$(cd "$src" && pwd)"
if [ -f "$src/$stamp" ]; then
  unpacked="$(cat "$src/$stamp")"
  if [ "$unpacked" != "$commit" ]; then
    echo "nginx: $src was unpacked from a tarball of $unpacked, not the pinned $ref ($commit)" >&2
    echo "  rm -rf $src   (make nginx unpacks the pinned one again)" >&2
    exit 2
  fi
# A checkout of its own: not a directory of another repository (such as this one's .deps/).
elif [ "$(git -C "$src" rev-parse --show-toplevel 2>/dev/null)" = "$src" ]; then
  head="$(git -C "$src" rev-parse HEAD)"
  if [ "$head" != "$commit" ]; then
    echo "nginx: $src is at $head, not the pinned $ref ($commit)" >&2
    echo "  git -C $src checkout $ref   (or NGX_WASM_MODULE_COMMIT=$head to build another commit)" >&2
    exit 2
  fi
else
  echo "nginx: $src is neither a git checkout nor an unpacked tarball: its commit cannot be checked against $commit; building it anyway" >&2
fi

# nginx and its source tree (nginx-dev), the compiler and make; cmake for wasmtime-c-api-impl's build script.
scripts/apt-install.sh nginx gcc make cmake /usr/share/nginx/src/configure=nginx-dev

# 1. Wasmtime's C API.
echo "nginx: building the Wasmtime C API (nginx/wasmtime-c-api) ..."
manifest="nginx/wasmtime-c-api/Cargo.toml"
"$cargo" build --release --locked --manifest-path "$manifest" --target-dir "$out/wasmtime-c-api"
impl_dir="$("$cargo" metadata --format-version 1 --locked --manifest-path "$manifest" |
  python3 -c 'import json, os, sys
meta = json.load(sys.stdin)
print(next(os.path.dirname(p["manifest_path"]) for p in meta["packages"] if p["name"] == "wasmtime-c-api-impl"))')"
runtime="$out/wasmtime"
rm -rf "$runtime"
mkdir -p "$runtime/lib"
cp -R "$impl_dir/include" "$runtime/include"
cp "$out/wasmtime-c-api/release/libwasmtime.a" "$runtime/lib/"
# wasmtime/conf.h says which features the library has: the ones nginx/wasmtime-c-api/Cargo.toml enables.
features="WAT CACHE PARALLEL_COMPILATION WASI THREADS CRANELIFT"
conf_in="$runtime/include/wasmtime/conf.h.in"
conf="$runtime/include/wasmtime/conf.h"
cp "$conf_in" "$conf"
for feature in $features; do
  sed -i "s|^#cmakedefine WASMTIME_FEATURE_${feature}\$|#define WASMTIME_FEATURE_${feature}|" "$conf"
done
sed -i 's|^#cmakedefine \(WASMTIME_FEATURE_[A-Z0-9_]*\)$|/* #undef \1 */|' "$conf"
rm "$conf_in"
if grep -q cmakedefine "$conf"; then
  echo "nginx: $conf still has a #cmakedefine: conf.h.in changed shape" >&2
  exit 1
fi

# 2. nginx's source, configured as Debian built it, with the module.
echo "nginx: configuring nginx $(nginx -v 2>&1 | sed 's|.*/||') with ngx_wasm_module ..."
tree="$out/nginx-src"
rm -rf "$tree"
cp -R /usr/share/nginx/src "$tree"
cd "$tree"
# shellcheck disable=SC1091  # nginx-dev's file: NGX_CONF_FLAGS=( ... ), the flags of Debian's nginx build.
. ./conf_flags
NGX_WASM_RUNTIME=wasmtime \
  NGX_WASM_RUNTIME_INC="$runtime/include" \
  NGX_WASM_RUNTIME_LIB="$runtime/lib" \
  NGX_WASM_RUNTIME_LD_OPT="-L$runtime/lib -lwasmtime -ldl -lm -lpthread" \
  NGX_WASM_CARGO=0 \
  ./configure "${NGX_CONF_FLAGS[@]}" --add-dynamic-module="$src" >"$out/configure.log" 2>&1 || {
  tail -30 "$out/configure.log" >&2
  echo "nginx: configure failed; its log: $out/configure.log" >&2
  exit 1
}

# 3. The module alone.
echo "nginx: compiling the module ..."
make -j"$(nproc)" -f objs/Makefile modules >"$out/make.log" 2>&1 || {
  tail -30 "$out/make.log" >&2
  echo "nginx: make modules failed; its log: $out/make.log" >&2
  exit 1
}
cp objs/ngx_wasmx_module.so "$out/ngx_wasmx_module.so"
echo "nginx: built $out/ngx_wasmx_module.so"
echo "  make test-nginx   (or SLUICE_NGINX_MODULE=$out/ngx_wasmx_module.so for the tests and bench-nginx)"
