#!/usr/bin/env bash
# Debian's redis-server for the shared-KV-store tests (issue 30), installed only when absent. It
# never fails the run: where it cannot install it says why, and those tests then skip with the reason.
set -u
cd "$(dirname "$0")/.."
if command -v redis-server >/dev/null 2>&1; then
  echo "redis-server: $(command -v redis-server) (already installed)"
  exit 0
fi
bash scripts/apt-install.sh redis-server "the Redis store tests" && echo "redis-server: $(command -v redis-server || echo '(not on PATH)')"
exit 0
