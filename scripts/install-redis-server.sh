#!/usr/bin/env bash
# Debian's redis-server for the shared-KV-store tests (issue 30), installed only when absent. It
# never fails the run: where it cannot install (no apt-get, no root or sudo, no network) it says
# why and goes on, and those tests then skip with the reason.
set -u

if command -v redis-server >/dev/null 2>&1; then
  echo "redis-server: $(command -v redis-server) (already installed)"
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "redis-server: not installed and no apt-get here; the shared-KV-store tests will skip" >&2
  exit 0
fi
as_root=()
if [ "$(id -u)" -ne 0 ]; then
  if ! command -v sudo >/dev/null 2>&1; then
    echo "redis-server: not installed, not root and no sudo; the shared-KV-store tests will skip" >&2
    exit 0
  fi
  as_root=(sudo -n)  # never prompts: a password-protected sudo fails, and is reported
fi
log="$(mktemp)"
install() {
  "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends redis-server >>"$log" 2>&1
}
# the package lists are usually there: update them only when the install cannot find the package
if install || { "${as_root[@]}" apt-get update -q >>"$log" 2>&1 && install; }; then
  echo "redis-server: installed $(command -v redis-server || echo '(but not on PATH)')"
else
  echo "redis-server: apt-get could not install it (the shared-KV-store tests will skip); its last lines:" >&2
  tail -n 5 "$log" >&2
fi
rm -f "$log"
exit 0
