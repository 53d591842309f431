#!/usr/bin/env bash
# Installs cargo-nextest at exactly VERSION as ROOT/bin/cargo-nextest (not globally): a cargo-nextest of that
# version already on PATH is linked there, else the project's prebuilt release binary is fetched (seconds), else
# it is built with `cargo install --locked` (several minutes, once). Does nothing when it is already in place.
# Usage: scripts/install-nextest.sh VERSION ROOT
set -euo pipefail

version=${1:?usage: $0 VERSION ROOT}
root=${2:?usage: $0 VERSION ROOT}
bin="$root/bin/cargo-nextest"

is_version() { [ -x "$1" ] && "$1" nextest --version 2>/dev/null | head -1 | grep -qx "cargo-nextest $version.*"; }
is_version "$bin" && exit 0
mkdir -p "$root/bin"

if found=$(command -v cargo-nextest) && is_version "$found"; then
  ln -sf "$found" "$bin"
  echo "using $found (cargo-nextest $version)"
  exit 0
fi

case "$(uname -s)-$(uname -m)" in
  Linux-x86_64) target=x86_64-unknown-linux-gnu ;;
  Linux-aarch64) target=aarch64-unknown-linux-gnu ;;
  Darwin-*) target=universal-apple-darwin ;;
  *) target= ;;
esac

if [ -n "$target" ] && command -v curl >/dev/null; then
  url="https://github.com/nextest-rs/nextest/releases/download/cargo-nextest-$version/cargo-nextest-$version-$target.tar.gz"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  echo "fetching $url"
  if curl -fsSL --connect-timeout 10 --max-time 120 -o "$tmp/nextest.tar.gz" "$url" &&
     tar -xzf "$tmp/nextest.tar.gz" -C "$tmp" cargo-nextest; then
    install -m 0755 "$tmp/cargo-nextest" "$bin"
    is_version "$bin" && { echo "installed cargo-nextest $version in $root/bin"; exit 0; }
    echo "the release tarball did not give cargo-nextest $version" >&2
  else
    echo "no release tarball ($url): building it instead" >&2
  fi
fi

cargo install cargo-nextest --version "=$version" --locked --root "$root" --bin cargo-nextest
is_version "$bin" || { echo "$bin is not cargo-nextest $version" >&2; exit 1; }
