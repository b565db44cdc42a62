#!/usr/bin/env bash
# The packs that reach the GPU machine in parts (`.gpu/stack.tar.xz.part-*` from scripts/gpu_stack.py,
# `.gpu/vllm.tar.xz.part-*` from scripts/gpu_vllm_carry.py; each with `.gpu/NAME.sha256`), one or two parts a call:
#
#   scripts/gpu_parts.sh                   # on the GPU machine, in each call that carries parts: copy the carried
#                                          # parts and digest lists into $PARTS_DIR (outside the working tree, so
#                                          # they stay on the warm machine between calls) and say, per pack, which
#                                          # parts are there (digest checked) and which are still to carry
#   scripts/gpu_parts.sh unpack NAME DEST  # check every part of NAME against NAME.sha256, join, unpack into DEST
#
# PARTS_DIR defaults to /tmp/rlstages-parts. Parts are looked for there, then in the checkout's .gpu/.
# Exit status: 0; `unpack` exits 2 (one line on stderr) when a part is missing or damaged or the pack does not unpack.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PARTS_DIR="${PARTS_DIR:-/tmp/rlstages-parts}"
GPU_DIR="${GPU_DIR:-$ROOT/.gpu}"

find_file() {  # the path of file $1 in $PARTS_DIR, else in .gpu/, else nothing
  local dir
  for dir in "$PARTS_DIR" "$GPU_DIR"; do
    [[ -f "$dir/$1" ]] && { echo "$dir/$1"; return 0; }
  done
  return 1
}

check() {  # per part of pack $1: "ok", "missing" or "damaged"; returns 1 unless every part is ok
  local list digest part path bad=0
  list="$(find_file "$1.sha256")" || { echo "$1: no $1.sha256 carried yet"; return 1; }
  while read -r digest part; do
    if ! path="$(find_file "$part")"; then
      echo "$1: $part missing"; bad=1
    elif [[ "$(sha256sum "$path" | cut -d' ' -f1)" != "$digest" ]]; then
      echo "$1: $part damaged ($path)"; bad=1
    else
      echo "$1: $part ok"
    fi
  done < "$list"
  return $bad
}

if [[ "${1:-}" == unpack ]]; then
  name="${2:?usage: gpu_parts.sh unpack NAME DEST}" dest="${3:?usage: gpu_parts.sh unpack NAME DEST}"
  if ! report="$(check "$name")"; then
    echo "gpu_parts: $name is not whole: $(grep -v ' ok$' <<< "$report" | tr '\n' ';')" >&2
    exit 2
  fi
  mapfile -t parts < <(while read -r _ part; do find_file "$part"; done < "$(find_file "$name.sha256")")
  mkdir -p "$dest" && cat "${parts[@]}" | xz -d -T0 | tar -x -C "$dest" \
    || { echo "gpu_parts: $name did not unpack into $dest" >&2; exit 2; }
  echo "gpu_parts: $name unpacked into $dest (${#parts[@]} parts)"
  exit 0
fi

mkdir -p "$PARTS_DIR"
shopt -s nullglob
for file in "$GPU_DIR"/*.tar.xz.part-* "$GPU_DIR"/*.sha256; do
  cp "$file" "$PARTS_DIR/" && echo "gpu_parts: kept $(basename "$file") ($(du -h "$file" | cut -f1))"
done
for list in "$PARTS_DIR"/*.sha256; do
  check "$(basename "$list" .sha256)"
done
exit 0
