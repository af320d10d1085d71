#!/usr/bin/env bash
# unpack-site.sh PARTS_DIR DEST
# Verifies the parts written by pack-site.sh against their SHA256SUMS, joins the parts it lists and unpacks the site
# into DEST (its packages then come first with PYTHONPATH=DEST). Needs only coreutils, tar and xz. DEST appears only
# once the whole site is unpacked, so a folder that exists is a complete site.
set -euo pipefail
parts=$1 dest=$2
(cd "$parts" && sha256sum --quiet -c SHA256SUMS) || { echo "unpack-site: a part in $parts is missing or damaged; copy it again" >&2; exit 1; }
rm -rf "$dest.partial"
mkdir -p "$dest.partial"
awk '{print $2}' "$parts/SHA256SUMS" | sort | sed "s|^|$parts/|" | xargs cat | xz -dc | tar -C "$dest.partial" --strip-components=1 -xf -
mv "$dest.partial" "$dest"
echo "unpacked $(du -sh "$dest" | cut -f1) into $dest; use: export PYTHONPATH=$dest"
