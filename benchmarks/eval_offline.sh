#!/usr/bin/env bash
# eval_offline.sh ENGINE PARTS SAVED OUT [SERVER_ARG ...]
# One engine's EAGLE-3 evaluation (benchmarks/eval_gpu.py) on a GPU machine that reaches no package index.
# Unpacks the engine's offline site (the parts infra/offline/pack-site.sh wrote) into /tmp/ENGINE-site once
# (ENGINE_SITE names another folder), checks that the engine imports over the machine's own torch, runs
# eval_gpu.py on SAVED (benchmarks/decode.py --save), and leaves in OUT: eval-ENGINE.json, imports-ENGINE.txt
# and evidence-ENGINE.tar.gz (the EvalResult, the engine's raw answers, the server logs). SERVER_ARGs replace eval_gpu.py's default server arguments.
# Run `python3 benchmarks/eval_gpu.py SAVED --reference-only` first, without the site on PYTHONPATH: SGLang's site
# shadows the machine's transformers with its pinned 5.8.1, and the reference decoder should not run on that.
# SPECULATIVE_ARGS (shell words) go to the EAGLE-3 server only, e.g. SGLang's --disable-overlap-schedule.
# EVAL_ARGS (shell words) go to eval_gpu.py itself, e.g. "--sweep-k 0 1 3 --concurrency 1 8 32 64".
# With EVAL_FALLBACK_ARGS set, a failed evaluation is run once more with those arguments added (e.g. SGLang with
# CUDA graphs off), into eval-ENGINE-fallback.json, as long as EVAL_DEADLINE_S (default 560 s) leaves time.
set -uo pipefail
engine=$1 parts=$2 saved=$3 out=$4
shift 4
root=$(cd "$(dirname "$0")/.." && pwd)
site=${ENGINE_SITE:-/tmp/$engine-site}  # an unpacked site is reused: unpacking takes a while
deadline=$(( SECONDS + ${EVAL_DEADLINE_S:-560} ))
case $engine in
  vllm|sglang) ;;
  *) echo "eval_offline: ENGINE is vllm or sglang, not '$engine'" >&2; exit 2 ;;
esac
mkdir -p "$out"
if [ ! -d "$site" ]; then
  bash "$root/infra/offline/unpack-site.sh" "$parts" "$site" || exit 1
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
case $engine in
  sglang) probe="import sglang, sgl_kernel, flashinfer, transformers, sglang.launch_server
print('sglang', sglang.__version__, 'sgl_kernel', sgl_kernel.__version__, 'flashinfer', flashinfer.__version__,
      'transformers', transformers.__version__)" ;;
  vllm) probe="import vllm, transformers; print('vllm', vllm.__version__, 'transformers', transformers.__version__)" ;;
esac
timeout 240 python3 -c "$probe" > "$out/imports-$engine.txt" 2>&1
probe_status=$?
tail -n 40 "$out/imports-$engine.txt"
if [ "$probe_status" != 0 ]; then
  echo "eval_offline: $engine does not import over this machine's packages (exit $probe_status, see $out/imports-$engine.txt)" >&2
  exit 1
fi

run_eval() {  # run_eval OUT_JSON [SERVER_ARG ...]
  local json=$1
  shift
  local left=$(( deadline - SECONDS - 15 ))
  if [ "$left" -lt 60 ]; then
    echo "eval_offline: only ${left} s left before the deadline; not starting $json" >&2
    return 124
  fi
  # shellcheck disable=SC2086  # EVAL_ARGS are words on purpose
  timeout "$left" python3 "$root/benchmarks/eval_gpu.py" "$saved" --engine "$engine" --out "$json" ${EVAL_ARGS:-} \
    ${SPECULATIVE_ARGS:+"--speculative-args=$SPECULATIVE_ARGS"} ${1:+--extra-args "$@"}
}

run_eval "$out/eval-$engine.json" "$@"
status=$?
if [ "$status" != 0 ] && [ -n "${EVAL_FALLBACK_ARGS:-}" ]; then
  echo "eval_offline: the evaluation failed (exit $status); once more with $EVAL_FALLBACK_ARGS" >&2
  # shellcheck disable=SC2086  # the fallback arguments are words on purpose
  run_eval "$out/eval-$engine-fallback.json" "$@" $EVAL_FALLBACK_ARGS
fi
tar -C "$saved" -czf "$out/evidence-$engine.tar.gz" "store/h200/eval/$engine" logs 2>/dev/null
exit "$status"
