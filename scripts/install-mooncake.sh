#!/usr/bin/env bash
# Mooncake Store for the shared-KV-store tests (issue 30): Debian's libibverbs1 (its client library
# needs it even over TCP) and mooncake-transfer-engine-non-cuda (the client library, mooncake_master
# and mooncake_client; a 46 MB wheel for CPython 3.11) into the Python it is run with ($PYTHON,
# default `python`: the activated environment). It never fails the run: where it cannot install,
# it says why, and the Mooncake tests skip with the reason.
set -u
cd "$(dirname "$0")/.."
MOONCAKE="mooncake-transfer-engine-non-cuda==0.3.13.post1"
python="${PYTHON:-python}"
if ! /sbin/ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then
  bash scripts/apt-install.sh libibverbs1 "the Mooncake store tests" || exit 0
fi
if "$python" -c "import mooncake.store" 2>/dev/null; then
  echo "mooncake: already installed in $("$python" -c 'import sys; print(sys.prefix)')"
elif "$python" -m pip install -q "$MOONCAKE"; then
  "$python" -c "import mooncake.store" && echo "mooncake: installed $MOONCAKE" \
    || echo "mooncake: $MOONCAKE installed but does not import; the Mooncake store tests will skip" >&2
else
  echo "mooncake: pip could not install $MOONCAKE; the Mooncake store tests will skip" >&2
fi
exit 0
