#!/usr/bin/env bash
# Installs the Debian packages whose command is missing (the package name is the command's name), as root.
# Usage: scripts/apt-install.sh redis-server wrk
set -euo pipefail

missing=()
for pkg in "$@"; do
  case "$pkg" in
    python3-venv) missing+=("$pkg") ;;  # a module, not a command: asked for only when `python3 -m venv` failed
    *) command -v "$pkg" >/dev/null 2>&1 || missing+=("$pkg") ;;
  esac
done
[ ${#missing[@]} -eq 0 ] && exit 0

sudo=()
[ "$(id -u)" -eq 0 ] || sudo=(sudo)
export DEBIAN_FRONTEND=noninteractive
echo "installing ${missing[*]} with apt-get"
"${sudo[@]}" apt-get install -y -q "${missing[@]}" ||
  { "${sudo[@]}" apt-get update -q && "${sudo[@]}" apt-get install -y -q "${missing[@]}"; }
