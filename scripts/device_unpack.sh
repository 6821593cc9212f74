#!/usr/bin/env bash
# Device side of scripts/device_pack.sh, run from the project root at the start of a
# call: `bash scripts/device_unpack.sh` (plus the chunk number when the call carries
# one). Stores the chunk in /tmp/ship; when all have arrived, checks the stream's
# sha256, unpacks it into /tmp/ship/files, and links its files into the working tree.
set -euo pipefail
ship=${SHIP_DIR:-.ship}
store=${SHIP_STORE:-/tmp/ship}
mkdir -p "$store"
if [ $# -gt 0 ]; then
  read -r index chunks sum < "$ship/$1/manifest"
  cp "$ship/$1/piece" "$store/piece.$(printf %02d "$index")"
  echo "$chunks $sum" > "$store/manifest"
fi
[ -f "$store/manifest" ] || { echo "SHIP_EMPTY: no chunk has arrived on this machine" >&2; exit 3; }
read -r chunks sum < "$store/manifest"
if [ ! -d "$store/files" ]; then
  have=$(ls "$store" | grep -c '^piece\.' || true)
  if [ "$have" -lt "$chunks" ]; then echo "SHIP_PARTIAL: $have of $chunks chunks"; exit 0; fi
  [ "$(cat "$store"/piece.* | sha256sum | cut -d' ' -f1)" = "$sum" ] ||
    { echo "SHIP_CORRUPT: sha256 differs; pack and send again" >&2; exit 4; }
  mkdir -p "$store/files.partial"
  cat "$store"/piece.* | tar -C "$store/files.partial" -xf -
  rm -f "$store"/piece.*
  mv "$store/files.partial" "$store/files"
fi
cp -rsf "$store/files/." .
echo "SHIP_OK: $(cd "$store/files" && find . -type f | wc -l) files linked into the working tree"
