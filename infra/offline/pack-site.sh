#!/usr/bin/env bash
# pack-site.sh LIST OUTDIR [PART_BYTES] [EXCLUDE ...]
# Builds an engine's Python packages for a GPU machine that reaches no package index (an air-gapped cluster, a cloud
# GPU machine without internet): downloads every pinned wheel in LIST (`name==version` a line, '#' comments) for
# CPython 3.12 on manylinux x86_64, installs them without dependencies into a staging folder (`pip --target`, so the
# machine's own torch and CUDA stay in charge), drops the paths named in EXCLUDE (relative to the site, e.g.
# vllm/vllm-rs), packs the folder as site.tar.xz (CUDA fatbins compress far better with xz than in wheels' zip) and
# splits it into OUTDIR/partNN of PART_BYTES (default 62000000) with a SHA256SUMS file.
# On the GPU machine: infra/offline/unpack-site.sh OUTDIR /opt/engine-site && export PYTHONPATH=/opt/engine-site
set -euo pipefail
list=$1 out=$2 part_bytes=${3:-62000000}
shift $(( $# < 3 ? $# : 3 ))
python=${PYTHON:-python3}
mkdir -p "$out/wheels"
platforms=()
for p in manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 \
         manylinux_2_26_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux_2_5_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
target=(--python-version 3.12 --implementation cp --only-binary=:all: "${platforms[@]}" --platform any)
grep -vE '^\s*(#|$)' "$list" | while read -r spec; do
  "$python" -m pip download -q --no-deps "${target[@]}" -d "$out/wheels" "$spec" 2> >(grep -v 'is ignored' >&2)
done
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
"$python" -m pip install -q --no-index --no-deps --no-compile --target "$stage/site" "${target[@]}" "$out"/wheels/*.whl \
  2> >(grep -v -e 'is ignored' -e "as the 'root' user" >&2)
rm -rf "$stage/site/bin"  # console scripts carry this machine's interpreter path; use `python3 -m ...` there
for path in "$@"; do rm -rf "${stage:?}/site/$path"; done
rm -f "$out"/part?? "$out/SHA256SUMS"
tar -C "$stage" -cf - site | xz -T0 -6 | split -b "$part_bytes" -d -a 2 - "$out/part"
(cd "$out" && sha256sum part?? > SHA256SUMS)
ls -l "$out"/part??
