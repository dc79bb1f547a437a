#!/usr/bin/env bash
# Installs one Debian package for tests that need it, never failing the run: where it cannot (no
# apt-get, no root or sudo, no network) it says why and goes on, and those tests skip with the reason.
#   usage: bash scripts/apt-install.sh PACKAGE WHAT_SKIPS
set -u
package=$1 skips=$2
if ! command -v apt-get >/dev/null 2>&1; then
  echo "$package: not installed and no apt-get here; $skips will skip" >&2
  exit 1
fi
as_root=()
if [ "$(id -u)" -ne 0 ]; then
  if ! command -v sudo >/dev/null 2>&1; then
    echo "$package: not installed, not root and no sudo; $skips will skip" >&2
    exit 1
  fi
  as_root=(sudo -n)  # never prompts: a password-protected sudo fails, and is reported
fi
log="$(mktemp)"
install() {
  "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$package" >>"$log" 2>&1
}
# the package lists are usually there: update them only when the install cannot find the package
if install || { "${as_root[@]}" apt-get update -q >>"$log" 2>&1 && install; }; then
  echo "$package: installed"
  status=0
else
  echo "$package: apt-get could not install it ($skips will skip); its last lines:" >&2
  tail -n 5 "$log" >&2
  status=1
fi
rm -f "$log"
exit "$status"
