#!/usr/bin/env bash
# Installs the wasm-bindgen command-line tool at exactly VERSION into ROOT/bin (not globally): the
# project's release tarball when the machine can fetch it (seconds), else `cargo install --locked`
# (a few minutes, once; with its own Cargo.lock). Does nothing when ROOT/bin/wasm-bindgen already is that version.
# Usage: scripts/install-wasm-bindgen.sh VERSION ROOT
set -euo pipefail

version=${1:?usage: $0 VERSION ROOT}
root=${2:?usage: $0 VERSION ROOT}
bin="$root/bin/wasm-bindgen"

installed() { [ -x "$bin" ] && [ "$("$bin" --version 2>/dev/null)" = "wasm-bindgen $version" ]; }
installed && exit 0

case "$(uname -s)-$(uname -m)" in
  Linux-x86_64) target=x86_64-unknown-linux-musl ;;
  Linux-aarch64) target=aarch64-unknown-linux-gnu ;;
  Darwin-x86_64) target=x86_64-apple-darwin ;;
  Darwin-arm64) target=aarch64-apple-darwin ;;
  *) target= ;;
esac

if [ -n "$target" ] && command -v curl >/dev/null; then
  name="wasm-bindgen-$version-$target"
  url="https://github.com/wasm-bindgen/wasm-bindgen/releases/download/$version/$name.tar.gz"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  echo "fetching $url"
  if curl -fsSL --connect-timeout 10 --max-time 120 -o "$tmp/$name.tar.gz" "$url" &&
     tar -xzf "$tmp/$name.tar.gz" -C "$tmp" "$name/wasm-bindgen"; then
    mkdir -p "$root/bin"
    install -m 0755 "$tmp/$name/wasm-bindgen" "$bin"
    installed && { echo "installed $("$bin" --version) in $root/bin"; exit 0; }
    echo "the release tarball did not give wasm-bindgen $version" >&2
  else
    echo "no release tarball ($url): building it instead" >&2
  fi
fi

# With its own lockfile; if a crate it pins is no longer in the registry (yanked), with what resolves today.
cargo install wasm-bindgen-cli --version "=$version" --locked --root "$root" --bin wasm-bindgen ||
  cargo install wasm-bindgen-cli --version "=$version" --root "$root" --bin wasm-bindgen
installed || { echo "$bin is not wasm-bindgen $version" >&2; exit 1; }
