#!/usr/bin/env bash
# schedule_gpu.sh STASH OUT [ENGINE ...]
# The per-load speculation schedule on one GPU machine that reaches no package index. Trains an EAGLE-3 drafter on
# demo-llama inflated to 1.04B parameters (benchmarks/decode.py --save; TARGET_SHAPE=8b for 6.88B) and computes the
# reference decoder's acceptance on the eval prompts; then, for each ENGINE in turn (default: vllm sglang), once
# STASH/ENGINE holds every part its SHA256SUMS lists (infra/offline/pack-site.sh's output: parts may still be arriving
# while the drafter trains), runs the engine's sweep of k and the schedule derived and verified from it
# (eval_offline.sh, then eval_gpu.py --sweep-k) into OUT/ENGINE/eval-ENGINE.json.
# benchmarks/schedule_summary.py then writes benchmarks/results/schedule-<hw>.json from those files.
# PYDANTIC_SITE: a folder with pydantic for the training step (the engines' sites bring their own).
# SWEEP_K (default "0 1 3"), CONCURRENCY ("1 8 32 64"), PROMPTS (64), TOKENS (128), REPEATS (2): what is measured.
# ENGINE_DEADLINE_S (default 1500): the most one engine's evaluation may take.
# VLLM_EXTRA_ARGS (shell words): added to every vLLM server of the sweep and the schedule, e.g. --enforce-eager.
set -uo pipefail
stash=$1 out=$2
shift 2
[ "$#" -gt 0 ] && engines=("$@") || engines=(vllm sglang)
root=$(cd "$(dirname "$0")/.." && pwd)
saved=$out/saved
mkdir -p "$out"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
prompts=${PROMPTS:-64} tokens=${TOKENS:-128}

if [ ! -f "$saved/drafter/vllm/config.json" ]; then
  PYTHONPATH=${PYDANTIC_SITE:-}:$root python3 "$root/benchmarks/decode.py" --save "$saved" --no-measure \
    --target-shape "${TARGET_SHAPE:-1b}" --out "$out/decode.json" || exit 1
fi
PYTHONPATH=${PYDANTIC_SITE:-} python3 "$root/benchmarks/eval_gpu.py" "$saved" --reference-only --max-prompts "$prompts" \
  --max-new-tokens "$tokens" || exit 1

parts_arrived() {  # parts_arrived DIR: every part SHA256SUMS names is there and whole
  [ -f "$1/SHA256SUMS" ] && (cd "$1" && sha256sum --quiet -c SHA256SUMS >/dev/null 2>&1)
}

for engine in "${engines[@]}"; do
  until parts_arrived "$stash/$engine"; do sleep 5; done
  case $engine in
    # shellcheck disable=SC2206  # the extra arguments are words on purpose
    vllm) server_args=(--gpu-memory-utilization 0.5 ${VLLM_EXTRA_ARGS:-}) ;;
    # The minimal SGLang site: no grammar backend, no FlashInfer sampling, Triton attention (infra/offline/SGLANG.md).
    sglang) server_args=(--mem-fraction-static 0.5 --grammar-backend none --sampling-backend pytorch
                         --attention-backend triton --cuda-graph-max-bs-decode 64) ;;
  esac
  mkdir -p "$out/$engine"
  EVAL_DEADLINE_S=${ENGINE_DEADLINE_S:-1500} \
  EVAL_ARGS="--sweep-k ${SWEEP_K:-0 1 3} --concurrency ${CONCURRENCY:-1 8 32 64} --max-prompts $prompts \
--max-new-tokens $tokens --repeats ${REPEATS:-2}" \
    bash "$root/benchmarks/eval_offline.sh" "$engine" "$stash/$engine" "$saved" "$out/$engine" "${server_args[@]}"
  echo "schedule_gpu: $engine finished with exit $?"
done
