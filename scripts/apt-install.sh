#!/usr/bin/env bash
# Installs the Debian packages whose command is missing, as root. A word is a command that is also its package's
# name, or COMMAND=PACKAGE when they differ (chromedriver=chromium-driver), or /PATH=PACKAGE for a package with no
# command (/usr/share/nginx/src/configure=nginx-dev: installed when that file is missing).
# Usage: scripts/apt-install.sh redis-server wrk chromedriver=chromium-driver
set -euo pipefail

missing=()
for pkg in "$@"; do
  case "$pkg" in
    python3-venv) missing+=("$pkg") ;;  # a module, not a command: asked for only when `python3 -m venv` failed
    /*=*) [ -e "${pkg%%=*}" ] || missing+=("${pkg#*=}") ;;
    *=*) command -v "${pkg%%=*}" >/dev/null 2>&1 || missing+=("${pkg#*=}") ;;
    *) command -v "$pkg" >/dev/null 2>&1 || missing+=("$pkg") ;;
  esac
done
[ ${#missing[@]} -eq 0 ] && exit 0

sudo=()
[ "$(id -u)" -eq 0 ] || sudo=(sudo)
export DEBIAN_FRONTEND=noninteractive
echo "installing ${missing[*]} with apt-get"
# Without recommended packages: of the packages installed here only Chromium has any (printing, a desktop's
# daemons, Mesa drivers), and a headless browser needs none of them.
"${sudo[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}" ||
  { "${sudo[@]}" apt-get update -q && "${sudo[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"; }
