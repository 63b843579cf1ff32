#!/usr/bin/env bash
# A / B of a change in one device call: the code as it is, then with an overlay of changed files copied over it.
#
#   here:       tools/overlay_ab.sh --prepare BRANCH [DIR]   (DIR default .ab: BRANCH's version of every file that
#               differs between HEAD and BRANCH, at its repository path under DIR; .ab is git-ignored: name it in
#               the device tool's `carry`, e.g. [".whl", ".ab"])
#   on the GPU: tools/overlay_ab.sh PART [DIR]               (`tools/issue16_targets.sh PART` as the tree is, its
#               results moved to $OUT/PART-before, then DIR copied over the tree and PART again into $OUT/PART)
#
# The device tool returns at most two folder levels under $OUT, so both runs keep `issue16_targets.sh`'s own depth
# ($OUT/PART-before/<sub>/..., $OUT/PART/<sub>/...). Files the branch deletes are not removed by the overlay. The tree
# is put back afterwards (the overlaid files restored, the added ones removed), so calls for several parts can follow
# one another in one command.
set -u -o pipefail
if [ "${1:-}" = --prepare ]; then
  branch=${2:?--prepare BRANCH [DIR]}
  dir=${3:-.ab}
  rm -rf "$dir"
  git diff --name-only --diff-filter=AM HEAD "$branch" | while read -r f; do
    mkdir -p "$dir/$(dirname "$f")"
    git show "$branch:$f" > "$dir/$f" || exit 1
  done
  echo "overlay of $branch in $dir:"
  (cd "$dir" && find . -type f | sort)
  exit 0
fi
part=${1:?PART [DIR] (a part of tools/issue16_targets.sh) or --prepare BRANCH [DIR]}
dir=${2:-.ab}
[ -d "$dir" ] || { echo "overlay folder $dir not found (tools/overlay_ab.sh --prepare BRANCH first)" >&2; exit 2; }
here=$(dirname "$0")
bash "$here/issue16_targets.sh" "$part" > /dev/null 2>&1
before=$?
rm -rf "$OUT/$part-before" && mv "$OUT/$part" "$OUT/$part-before"
backup=$(mktemp -d)
(cd "$dir" && find . -type f) | while read -r f; do  # the tree's own files, restored after: parts can follow
  if [ -e "$f" ]; then mkdir -p "$backup/$(dirname "$f")" && cp -p "$f" "$backup/$f"; else echo "$f" >> "$backup.new"; fi
done
cp -r "$dir"/. .
bash "$here/issue16_targets.sh" "$part" > /dev/null 2>&1
after=$?
cp -r "$backup"/. . && rm -rf "$backup"
[ -f "$backup.new" ] && xargs rm -f < "$backup.new" && rm -f "$backup.new"
# the device tool returns at most 8 files: the plots of the side before and the GPU names (printed here) go
cat "$OUT/$part/gpu.txt" 2>/dev/null
find "$OUT/$part-before" -name '*.png' -delete
rm -f "$OUT/$part-before/gpu.txt" "$OUT/$part/gpu.txt"
for side in "$part-before" "$part"; do
  echo "== $side"
  tail -n 12 "$OUT/$side/log.txt"
done
echo "exit status before / after: $before / $after"
[ "$before" = 0 ] && [ "$after" = 0 ]
