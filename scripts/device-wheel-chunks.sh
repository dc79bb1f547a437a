#!/usr/bin/env bash
# Moves a wheel (or a tar of wheels) larger than one device call can carry (64 MiB) to the GPU
# machine in chunks.
#
# Here:   bash scripts/device-wheel-chunks.sh split WHEEL [CHUNK_MIB]
#           writes .whl-chunks/part-01 ... part-NN (ignored by git), each one chunk plus MANIFEST
#           (wheel name, sha256 of the whole wheel, number of parts); prints the carry path per call.
# There:  bash scripts/device-wheel-chunks.sh receive .whl-chunks/part-K [STORE]
#           one call per part, carrying that part only, on consecutive calls while the machine stays
#           warm (files under /tmp survive between calls for about 30 s of idle time); each call
#           moves its chunk to STORE (default /tmp/wheel-chunks); when every part is there, it joins
#           them, checks the sha256 against MANIFEST and prints "complete: PATH" (exit 0), or fails
#           naming what differs. A part already received is not taken twice.
# Then:   python3 -m pip install --no-index --no-deps --target /tmp/site PATH (in the same call).
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:?usage: device-wheel-chunks.sh split WHEEL [CHUNK_MIB] | receive PART_DIR [STORE]}

case "$mode" in
split)
  wheel=${2:?split needs the wheel path}
  mib=${3:-55}
  grep -qx '/.whl-chunks/' .git/info/exclude 2>/dev/null || echo '/.whl-chunks/' >> .git/info/exclude
  rm -rf .whl-chunks && mkdir -p .whl-chunks/tmp
  name=$(basename "$wheel")
  sum=$(sha256sum "$wheel" | cut -d' ' -f1)
  split -b "${mib}M" -d -a 2 "$wheel" .whl-chunks/tmp/chunk.
  count=$(ls .whl-chunks/tmp | wc -l)
  i=0
  for chunk in .whl-chunks/tmp/chunk.*; do
    i=$((i + 1))
    part=$(printf '.whl-chunks/part-%02d' "$i")
    mkdir -p "$part"
    mv "$chunk" "$part/$(printf 'chunk-%02d' "$i")"
    printf 'name=%s\nsha256=%s\nparts=%s\n' "$name" "$sum" "$count" > "$part/MANIFEST"
    echo "carry: $part ($(du -m "$part" | cut -f1) MiB)"
  done
  rmdir .whl-chunks/tmp
  ;;
receive)
  part=${2:?receive needs the part folder}
  store=${3:-/tmp/wheel-chunks}
  [ -f "$part/MANIFEST" ] || { echo "device-wheel-chunks: no MANIFEST in $part" >&2; exit 1; }
  name=$(sed -n 's/^name=//p' "$part/MANIFEST")
  sum=$(sed -n 's/^sha256=//p' "$part/MANIFEST")
  parts=$(sed -n 's/^parts=//p' "$part/MANIFEST")
  dest="$store/$sum"
  mkdir -p "$dest"
  for chunk in "$part"/chunk-*; do
    [ -f "$dest/$(basename "$chunk")" ] || cp "$chunk" "$dest/"
  done
  have=$(ls "$dest" | grep -c '^chunk-' || true)
  echo "device-wheel-chunks: $name: $have of $parts parts here"
  if [ "$have" -eq "$parts" ]; then
    cat "$dest"/chunk-* > "$dest/$name"
    got=$(sha256sum "$dest/$name" | cut -d' ' -f1)
    if [ "$got" != "$sum" ]; then
      echo "device-wheel-chunks: $name: sha256 $got, expected $sum" >&2
      rm -f "$dest/$name"
      exit 1
    fi
    echo "complete: $dest/$name"
  fi
  ;;
*)
  echo "device-wheel-chunks: unknown mode '$mode' (split or receive)" >&2
  exit 2
  ;;
esac
