"""How an engine server spreads over GPUs: its parallel sizes, and whether a tensor-parallel size splits the heads."""
from __future__ import annotations

from draftline.config import ServerSettings


def flag_value(args: list[str], *names: str) -> int:
    """The integer value of the first of `names` in a server's extra_args (--flag N or --flag=N); 1 when absent."""
    for i, a in enumerate(args):
        for n in names:
            if a == n and i + 1 < len(args):
                return int(args[i + 1])
            if a.startswith(n + "="):
                return int(a.split("=", 1)[1])
    return 1


# Data-parallel size flags of vLLM and SGLang.
DATA_PARALLEL = ("--data-parallel-size", "-dp", "--dp-size", "--dp")


def devices_needed(settings: ServerSettings) -> int:
    """GPUs one server takes: tensor x pipeline x data parallel sizes (the last two from extra_args, in vLLM's or
    SGLang's spelling); SGLang's --enable-dp-attention runs its data-parallel attention inside the tensor-parallel
    GPUs."""
    extra = list(settings.extra_args)
    data = 1 if "--enable-dp-attention" in extra else flag_value(extra, *DATA_PARALLEL)
    return settings.tensor_parallel_size * flag_value(extra, "--pipeline-parallel-size", "-pp", "--pp-size") * data


def tensor_parallel_problem(model_config: dict, tp: int, field: str, what: str = "the target",
                            label: str | None = None) -> str | None:
    """Why the engines cannot split this model over `tp` GPUs, or None: each rank takes a whole number of query heads,
    and of key/value heads (or one replica of a key/value head per tp / heads ranks); MLA keeps one latent, so only its
    query heads count. `field` names where tp came from (e.g. traces.vllm.tensor_parallel_size); `label`, when
    given, says it instead of "field tp"."""
    text = model_config["text_config"] if isinstance(model_config.get("text_config"), dict) else model_config
    heads = int(text.get("num_attention_heads") or 0)
    if tp <= 1 or not heads:
        return None
    kv = heads if text.get("kv_lora_rank") else int(text.get("num_key_value_heads") or heads)

    def splits(n: int) -> bool:
        return heads % n == 0 and (kv % n == 0 or n % kv == 0)

    if splits(tp):
        return None
    fits = [n for n in range(1, 65) if splits(n)][:8]
    layout = f"{heads} attention heads" + (f" and {kv} key/value heads" if kv != heads else "")
    return (f"{label or f'{field} {tp}'} cannot split {what}'s {layout} over {tp} GPUs (vLLM and SGLang give each "
            f"rank whole heads); use one of {', '.join(map(str, fits))}")


def server_heads_problem(model_config: dict, settings: ServerSettings, field: str,
                         what: str = "the target") -> str | None:
    """tensor_parallel_problem for one server's settings (`field` names its tensor_parallel_size): over its
    tensor-parallel size, or over tp / dp where SGLang's --enable-dp-attention runs attention data-parallel (then the
    sizes offered are tp / dp)."""
    extra, tp = list(settings.extra_args), settings.tensor_parallel_size
    if "--enable-dp-attention" not in extra:
        return tensor_parallel_problem(model_config, tp, field, what)
    dp = flag_value(extra, *DATA_PARALLEL)
    return tensor_parallel_problem(model_config, max(1, tp // dp), field, what, label=(
        f"{field} {tp} with --enable-dp-attention and data parallel size {dp} (tp / dp)"))


def tensor_parallel_split(model_config: dict, gpus: int) -> tuple[int, int]:
    """(tensor, data) parallel sizes for a worker of `gpus` GPUs: the most of them that split the heads, copies for
    the rest."""
    tp = max(n for n in range(1, gpus + 1)
             if gpus % n == 0 and tensor_parallel_problem(model_config, n, "tp") is None)
    return tp, gpus // tp
