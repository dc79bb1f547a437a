#!/usr/bin/env bash
# Fills .redis-dev/ (ignored by git) with this machine's redis-server and the shared libraries it needs
# beyond glibc and libstdc++, so a device call can carry it (`carry: [".redis-dev"]`; about 12 MB) and
# start real Redis servers for the shared-KV-store GPU tests: there, put .redis-dev/bin on PATH and
# .redis-dev/lib on LD_LIBRARY_PATH (scripts/device-check.sh does with SERVE_TESTS=1).
set -euo pipefail
cd "$(dirname "$0")/.."
server=$(command -v redis-server) || { echo "no redis-server here: bash scripts/install-redis-server.sh" >&2; exit 1; }
rm -rf .redis-dev && mkdir -p .redis-dev/bin .redis-dev/lib
cp -L "$server" .redis-dev/bin/redis-server
ldd "$server" | awk '/=> \//{print $3}' | while read -r lib; do
  case "$(basename "$lib")" in libc.so*|libm.so*|libstdc++.so*|libgcc_s.so*|ld-linux*) ;; *) cp -L "$lib" .redis-dev/lib/ ;; esac
done
du -sh .redis-dev
