#!/usr/bin/env bash
# Ship files larger than one device call allows (64 MiB with the working tree) over
# several calls. Here, from the project root:
#   bash scripts/device_pack.sh .gpu/c1 .gpu/c2 artifacts/smollm2.gguf.xz ...
# packs the paths into one tar stream cut into .ship/1 .. .ship/N, each small enough
# to travel beside the working tree. Call k carries [".ship/k", ".gpu/bin"] and runs
# `bash scripts/device_unpack.sh k` first; once every chunk has arrived, the paths
# appear in the device's working tree (as links into /tmp/ship/files) in that call and,
# by running device_unpack.sh again, in every later call. A call may carry one chunk.
# SHIP_DIR, SHIP_STORE, SHIP_LIMIT and SHIP_MARGIN move the folders, the limit and the
# margin (for tests).
set -euo pipefail
cd "$(dirname "$0")/.."
limit=${SHIP_LIMIT:-$((64 * 1024 * 1024))}
ship=${SHIP_DIR:-.ship}
tree=$( (git ls-files; git ls-files --others --exclude-standard) | sort -u |
  while read -r f; do [ -f "$f" ] && stat -c %s "$f"; done | awk '{s += $1} END {print s + 0}')
# .gpu/bin and a margin for the working tree's growth (results, code) while the pack is
# kept across sessions: 8 MiB (with 2 MiB a pack of 2026-12-07 no longer fitted beside
# the same tree a day of results later).
margin=${SHIP_MARGIN:-$((8 * 1024 * 1024))}
budget=$((limit - tree - margin))
[ "$budget" -gt $((limit / 8)) ] || { echo "working tree too large to ship beside" >&2; exit 1; }
rm -rf "$ship" && mkdir -p "$ship/stream"
tar -cf - "$@" | split -b "$budget" -d -a 2 - "$ship/stream/"
chunks=$(ls "$ship/stream" | wc -l)
sum=$(cat "$ship"/stream/* | sha256sum | cut -d' ' -f1)
i=1
for piece in "$ship"/stream/*; do
  mkdir -p "$ship/$i"
  mv "$piece" "$ship/$i/piece"
  echo "$i $chunks $sum" > "$ship/$i/manifest"
  i=$((i + 1))
done
rmdir "$ship/stream"
echo "$chunks chunks of at most $budget bytes: carry $ship/1 .. $ship/$chunks, one per call"
