#!/usr/bin/env bash
# unpack-site.sh PARTS_DIR DEST
# Verifies the parts written by pack-site.sh against their SHA256SUMS, joins them and unpacks the site into DEST
# (its packages then come first with PYTHONPATH=DEST). Needs only coreutils, tar and xz.
set -euo pipefail
parts=$1 dest=$2
(cd "$parts" && sha256sum --quiet -c SHA256SUMS) || { echo "unpack-site: a part in $parts is missing or damaged; copy it again" >&2; exit 1; }
mkdir -p "$dest"
cat "$parts"/part?? | xz -dc | tar -C "$dest" --strip-components=1 -xf -
echo "unpacked $(du -sh "$dest" | cut -f1) into $dest; use: export PYTHONPATH=$dest"
