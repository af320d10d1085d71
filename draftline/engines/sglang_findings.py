"""What SGLang's own log and server settings say about an evaluation's speed, as sentences for the report."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: draftline.eval_result never imports this module
    from draftline.eval_result import EvalResult


def sglang_prefill_graph_finding(r: EvalResult) -> list[str]:
    """When SGLang's own log shows the EAGLE-3 server prefilling without the CUDA graphs its baseline used, and the
    setting that gave it back those graphs on an H200."""
    base, spec = r.server_log_facts.get("baseline", {}), r.server_log_facts.get("eagle3", {})
    if not base.get("prefill_batches") or not spec.get("prefill_batches"):
        return []
    b_graphs, s_graphs = base["prefill_batches_with_cuda_graph"], spec["prefill_batches_with_cuda_graph"]
    if s_graphs / spec["prefill_batches"] >= b_graphs / base["prefill_batches"]:
        return []
    off_line = spec.get("prefill_cuda_graph_off_log_line")
    said = f' (its log: "{off_line}")' if off_line else ""
    ttft = ""
    if r.points:
        p = min(r.points, key=lambda q: q.concurrency)
        if p.baseline.ttft_mean_s and p.speculative.ttft_mean_s:
            ttft = (f" Time to first token at concurrency {p.concurrency} in this run: "
                    f"{p.baseline.ttft_mean_s * 1e3:.1f} ms for the baseline, {p.speculative.ttft_mean_s * 1e3:.1f} ms "
                    "with EAGLE-3.")
    return [f"SGLang ran {s_graphs} of the EAGLE-3 server's {spec['prefill_batches']} prefill batches as CUDA graphs "
            f"against {b_graphs} of the baseline's {base['prefill_batches']}{said}: eager prefills can raise the time "
            f"to first token.{ttft} {sglang_prefill_graph_remedy(r)}"]


# Target architectures SGLang 0.5.14 serves with multi-head latent attention (srt/configs/model_config.py; the
# main ones): its breakable prefill backend does not serve them.
SGLANG_MLA_ARCHITECTURES = frozenset({
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "KimiK25ForConditionalGeneration",
    "KimiVLForConditionalGeneration", "KimiLinearForCausalLM", "MiniCPM3ForCausalLM", "Glm4MoeLiteForCausalLM",
    "GlmMoeDsaForCausalLM", "LongcatFlashForCausalLM", "MistralLarge3ForCausalLM", "SarvamMLAForCausalLM",
})
SGLANG_BREAKABLE_PREFILL = ["--cuda-graph-backend-prefill", "breakable"]


def _gives_breakable_prefill(args: list[str]) -> bool:
    return "--cuda-graph-backend-prefill=breakable" in args or any(
        args[i:i + 2] == SGLANG_BREAKABLE_PREFILL for i in range(len(args) - 1))


def sglang_prefill_graph_remedy(r: EvalResult) -> str:
    """SGLang 0.5.14 keeps an EAGLE-3 target's prefill graph only on its breakable backend, which does not serve MLA."""
    flag = " ".join(SGLANG_BREAKABLE_PREFILL)
    if _gives_breakable_prefill(r.speculative_server_args) or _gives_breakable_prefill(r.server_args):
        return (f"The EAGLE-3 server was given `{flag}` and still prefilled without graphs: SGLang's log says why "
                "(its lines on the prefill CUDA graph at startup).")
    if r.target_architecture in SGLANG_MLA_ARCHITECTURES:
        return (f"SGLang 0.5.14 keeps an EAGLE-3 target's prefill graph only on its `breakable` backend, which it marks "
                f"incompatible with MLA attention, and {r.target_architecture} uses MLA: expect eager prefills with "
                "EAGLE-3 on this target (SGLang skips that check when the backend is given explicitly, so do not give "
                f"`{flag}` here).")
    return (f"SGLang 0.5.14 keeps an EAGLE-3 target's prefill graph only on its `breakable` backend: give `{flag}` to "
            "the EAGLE-3 server (speculative_extra_args). On an H200 with a 6.88B Llama-shaped target, every EAGLE-3 "
            "prefill then ran as a graph and EAGLE-3's time to first token at concurrency 1 fell from 53.7 to 27.1 ms; "
            "the speedup was 1.49x at concurrency 1 and 1.17x at 8, against 1.40x and 0.89x without it (another "
            "drafter trained the same way; benchmarks/RESULTS.md).")


SGLANG_NO_OVERLAP = "--disable-overlap-schedule"
# What H200 runs measured (infra/offline/SGLANG.md, "The overlap scheduler and EAGLE-3"): the baseline is always
# faster under SGLang's overlap scheduler, while which setting speeds EAGLE-3 turns with the target's size.
SGLANG_OVERLAP_SEEN = ("On an H200 (time per output token), SGLang's baseline ran faster under its overlap scheduler "
                       "with both targets measured (1.7x with a 1.04B target, 1.4x with a 6.88B one), while EAGLE-3 "
                       "ran 1.15x faster without it with the 1.04B target and 1.44x faster with it with the 6.88B one "
                       "(benchmarks/RESULTS.md)")


def sglang_overlap_finding(r: EvalResult) -> list[str]:
    """What the H200 runs showed about SGLang's overlap scheduler, and the setting this run did not try."""
    if SGLANG_NO_OVERLAP in r.server_args:
        return [f"Both SGLang servers ran with {SGLANG_NO_OVERLAP}, so the baseline lost its overlap scheduler too. "
                f"{SGLANG_OVERLAP_SEEN}: these speedups are against a slowed baseline; keep the baseline on SGLang's "
                f"default and give the flag, if at all, to the EAGLE-3 server only (speculative_extra_args)."]
    if SGLANG_NO_OVERLAP in r.speculative_server_args:
        return [f"SGLang ran EAGLE-3 with {SGLANG_NO_OVERLAP} and the baseline under its overlap scheduler. "
                f"{SGLANG_OVERLAP_SEEN}: for a target of several billion parameters (6.88B measured), measure "
                "EAGLE-3 under the overlap scheduler too (drop the flag from speculative_extra_args)."]
    return [f"SGLang ran EAGLE-3 under its overlap scheduler (its default). {SGLANG_OVERLAP_SEEN}: for a target of "
            f"about 1B parameters (1.04B measured), measure EAGLE-3 with {SGLANG_NO_OVERLAP} too, on the EAGLE-3 "
            "server only (speculative_extra_args)."]
