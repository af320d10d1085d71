"""Where online training's two sides run on a GPU worker: the engine's GPUs and its share of the memory of GPUs it
shares with the trainer, the trainer's GPUs, and the preflight that both fit (one sentence naming the field to change
when they do not). On a machine without GPUs there is nothing to place: vLLM's CPU build and the trainer share the
cores."""
from __future__ import annotations

from dataclasses import dataclass

from draftline.config import PipelineConfig
from draftline.errors import ConfigError

GIB = 1024 ** 3
# vLLM's own default share of each GPU (--gpu-memory-utilization).
VLLM_DEFAULT_FRACTION = 0.9
# What a process's CUDA context, allocator slack and NCCL buffers take beside its tensors, about.
CONTEXT_BYTES = 1.5 * GIB
# The engine's share must hold its weights with this much of it left for KV cache and activations.
ENGINE_WEIGHTS_SHARE = 0.85


@dataclass(frozen=True)
class Placement:
    """GPU indices (as the worker sees them) of each side, those they share, and the engine's share there."""

    engine: list[int]
    trainer: list[int]
    shared: list[int]
    engine_fraction: float


def engine_fraction(config: PipelineConfig) -> float:
    """The engine's share of each of its GPUs: train.online.engine_memory_fraction, else the server's own flag."""
    if config.train.online.engine_memory_fraction is not None:
        return config.train.online.engine_memory_fraction
    args = list(config.extract.vllm.extra_args)
    for i, a in enumerate(args):
        if a == "--gpu-memory-utilization" and i + 1 < len(args):
            return float(args[i + 1])
        if a.startswith("--gpu-memory-utilization="):
            return float(a.split("=", 1)[1])
    return VLLM_DEFAULT_FRACTION


def place(config: PipelineConfig, visible: int) -> Placement:
    """Each side's GPUs among the `visible` ones: the configured lists, else the engine on every GPU and the trainer
    on the first train.processes."""
    from draftline.engines.parallel import devices_needed

    online, processes = config.train.online, config.train.processes
    engine = list(online.engine_devices) if online.engine_devices is not None else list(range(visible))
    trainer = list(online.trainer_devices) if online.trainer_devices is not None else list(range(visible))
    for field, ids in (("engine_devices", engine), ("trainer_devices", trainer)):
        bad = [i for i in ids if not 0 <= i < visible]
        if bad or len(set(ids)) != len(ids):
            raise ConfigError(f"train.online.{field}={ids} must name distinct GPUs among the {visible} this worker "
                              f"sees (0..{visible - 1})")
    needed = devices_needed(config.extract.vllm)
    if needed > len(engine):
        raise ConfigError(f"the engine needs {needed} GPUs (extract.vllm's parallel sizes) but "
                          f"train.online.engine_devices gives it {len(engine)}; give it more or lower its parallel sizes")
    if processes > len(trainer):
        raise ConfigError(f"train.processes={processes} but train.online.trainer_devices gives the trainer "
                          f"{len(trainer)} GPU(s); lower train.processes or give the trainer more")
    engine, trainer = engine[:needed], trainer[:processes]
    shared = sorted(set(engine) & set(trainer))
    return Placement(engine, trainer, shared, engine_fraction(config))


def trainer_bytes(config: PipelineConfig) -> int:
    """What one training process holds on its GPU, about: the drafter's trainable weights with their gradients and
    AdamW's two moments in float32, the frozen embedding (float32) and the target's lm_head (bf16), one step's
    activations through every TTT step, a chunk of target logits, and the CUDA context."""
    import torch

    from draftline.aux_ids import AuxLayerIds
    from draftline.drafter.target_sizing import drafter_for_target
    from draftline.target import num_layers, read_target_config

    text = read_target_config(config.target.path)
    text = text.get("text_config", text)
    aux = AuxLayerIds.for_target(config.extract.aux_layer_ids, num_layers(config.target.path)).as_list()
    with torch.device("meta"):
        model = drafter_for_target(text, config.drafter, aux)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    hidden, vocab = int(text["hidden_size"]), int(text["vocab_size"])
    width = model.config.hidden_size
    inter = getattr(model.config, "intermediate_size", 4 * width)
    t = config.train
    tokens = -(-t.tokens_per_batch // t.processes)
    activations = tokens * t.ttt_steps * (12 * width + 3 * inter) * 4
    logits = min(t.logits_chunk_tokens, tokens) * vocab * 12  # bf16 logits, float32 log-softmax and its gradient
    return int(16 * trainable + 4 * frozen + 2 * vocab * hidden + activations + logits + CONTEXT_BYTES)


def check_placement(config: PipelineConfig, visible: int | None = None, gpu_bytes: int | None = None) -> str | None:
    """Refuse a placement that cannot fit, before either side loads anything; returns what was checked (None on a
    machine without GPUs)."""
    if visible is None:
        import torch

        visible = torch.cuda.device_count()
        gpu_bytes = gpu_bytes or (torch.cuda.get_device_properties(0).total_memory if visible else None)
    if not visible:
        return None
    placement = place(config, visible)
    if gpu_bytes is None:
        return None
    from draftline.engines.launch import checkpoint_size

    fraction = placement.engine_fraction
    weights = checkpoint_size(config.target.path) / max(1, len(placement.engine))
    if weights > ENGINE_WEIGHTS_SHARE * fraction * gpu_bytes:
        raise ConfigError(f"the engine's share of each GPU ({fraction:.2f} of {gpu_bytes / GIB:.0f} GiB) cannot hold "
                          f"its {weights / GIB:.1f} GiB of weights per GPU with room for its cache; raise "
                          "train.online.engine_memory_fraction or give the engine more GPUs (train.online.engine_devices)")
    need = trainer_bytes(config)
    said = (f"engine on GPUs {placement.engine} ({fraction:.2f} of each), trainer on GPUs {placement.trainer} "
            f"(about {need / GIB:.1f} GiB each)")
    if not placement.shared:
        if need > gpu_bytes:
            raise ConfigError(f"training needs about {need / GIB:.1f} GiB per process, more than a GPU's "
                              f"{gpu_bytes / GIB:.0f} GiB; lower train.tokens_per_batch or raise train.processes")
        return said
    left = (1.0 - fraction) * gpu_bytes
    if need > left:
        most = max(0.0, 1.0 - need / gpu_bytes)
        raise ConfigError(f"on the GPUs both sides share ({placement.shared}) the engine takes {fraction:.2f} of "
                          f"{gpu_bytes / GIB:.0f} GiB and leaves the trainer {left / GIB:.1f} GiB, but training needs "
                          f"about {need / GIB:.1f} GiB; set train.online.engine_memory_fraction to at most "
                          f"{most:.2f}, or give each side GPUs of its own (train.online.engine_devices, "
                          "trainer_devices)")
    return said
