#!/usr/bin/env bash
# Installs the Debian packages swapopt builds and tests with, only those missing.
set -euo pipefail
packages=(meson ninja-build pkg-config libeigen3-dev doctest-dev nlohmann-json3-dev zlib1g-dev libgloo-dev libhiredis-dev redis-server)
missing=()
for p in "${packages[@]}" "$@"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "installing: ${missing[*]}"
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
