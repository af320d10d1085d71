"""Aux-layer ids, the three target layers whose hidden states feed the drafter: their type, conventions and checks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from draftline.errors import ConfigError

# The one place that defines what an aux-layer id means.
#   vLLM id k   = the INPUT of decoder layer k   (= the output of layer k-1; k=0 is the embedding output)
#   SGLang id k = the OUTPUT of decoder layer k  (SGLang adds +1 internally to reach the same tensor)
# So the same physical tensor has sglang_id = vllm_id - 1. Everything in draftline stores vLLM ids.
# SGLang's DeepSeek-V2/V3 model (which Kimi-K2.5 delegates to) adds the +1 only when the first id is 1 and reads any
# other list as vLLM ids (0.5.14, models/deepseek_v2.py set_eagle3_layers_to_capture): the "sglang-deepseek" convention.
VLLM = "vllm"
SGLANG = "sglang"
SGLANG_DEEPSEEK = "sglang-deepseek"
CONVENTIONS = (VLLM, SGLANG, SGLANG_DEEPSEEK)
# Text-model types SGLang serves with its DeepSeek-V2 class (kimi_k2 is its alias for deepseek_v3).
SGLANG_DEEPSEEK_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")


class AuxLayerIdsError(ConfigError):
    """An export whose aux-layer ids the engine would read as other layers than the drafter was trained on."""


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """The ids every engine falls back to: inputs of layers 2, L//2 and L-3 (vLLM convention)."""
    return [2, num_layers // 2, num_layers - 3]


def vllm_to_sglang(ids: Iterable[int]) -> list[int]:
    """Same tensors, SGLang's convention ("output of layer k"): one less than vLLM's "input of layer k"."""
    return [int(i) - 1 for i in ids]


def sglang_to_vllm(ids: Iterable[int]) -> list[int]:
    """Same tensors, vLLM's convention ("input of layer k"): one more than SGLang's "output of layer k"."""
    return [int(i) + 1 for i in ids]


def sglang_convention(target_cfg: dict) -> str:
    """How SGLang reads aux ids for this target: "sglang-deepseek" for DeepSeek-V2/V3 text models (Kimi-K2.5's
    included), "sglang" (always +1) for the others."""
    text = target_cfg.get("text_config", target_cfg)
    return SGLANG_DEEPSEEK if text.get("model_type") in SGLANG_DEEPSEEK_MODEL_TYPES else SGLANG


def reader_convention(reader: str, target_cfg: dict) -> str:
    """The convention an engine ("vllm", "sglang") or export format ("speculators" too) reads aux ids in."""
    return sglang_convention(target_cfg) if reader == SGLANG else VLLM


def to_convention(vllm_ids: Iterable[int], convention: str) -> list[int]:
    """Express vLLM-convention ids in `convention` (one of CONVENTIONS)."""
    ids = [int(i) for i in vllm_ids]
    if convention == VLLM:
        return ids
    if convention == SGLANG:
        return vllm_to_sglang(ids)
    if convention == SGLANG_DEEPSEEK:
        # Lists SGLang's DeepSeek model reads with +1 (first id 1) work in every SGLang; others only in >= 0.5.14.
        if ids and ids[0] == 2:
            return vllm_to_sglang(ids)
        if ids and ids[0] == 1:
            raise ConfigError(f"aux-layer ids {ids} (vLLM convention) cannot be written for SGLang's DeepSeek-V3 "
                              "models, which read a first id of 1 as layer 2 and 0 as the embeddings; choose a first "
                              "aux layer other than 1 in extract.aux_layer_ids")
        return ids
    raise ConfigError(f"layer-id convention {convention!r} is unknown; use one of {list(CONVENTIONS)}")


def from_convention(ids: Iterable[int], convention: str) -> list[int]:
    """Turn ids written in `convention` into vLLM-convention ids."""
    ids = [int(i) for i in ids]
    if convention == VLLM:
        return ids
    if convention == SGLANG:
        return sglang_to_vllm(ids)
    if convention == SGLANG_DEEPSEEK:
        return sglang_to_vllm(ids) if ids and ids[0] == 1 else ids
    raise ConfigError(f"layer-id convention {convention!r} is unknown; use one of {list(CONVENTIONS)}")


def outside(ids: Iterable[int], num_layers: int, convention: str = VLLM) -> list[int]:
    """The ids, as `convention` writes them, that name no layer of a target with num_layers layers: vLLM's run from
    0 (the embeddings) to L-1; plain SGLang's start one below."""
    lo = -1 if convention == SGLANG else 0
    return [i for i in ids if not lo <= i < num_layers]


def same_layers(*id_lists: Iterable[int]) -> bool:
    """Whether the lists name the same layers; order does not count, since the engines sort the ids they read."""
    return len({tuple(sorted(ids)) for ids in id_lists}) <= 1


def config_aux_layer_ids(config: dict) -> list[int] | None:
    """The aux ids a drafter's config.json names where the engines look (eagle_config first, as SGLang reads them,
    then the top level, as vLLM's V2 runner and the speculators format have them), or None."""
    for holder in (config.get("eagle_config") or {}, config, (config.get("speculators_config") or {})):
        ids = holder.get("eagle_aux_hidden_state_layer_ids")
        if ids:
            return list(ids)
    return None


@dataclass(frozen=True)
class AuxLayerIds:
    """Three distinct target layers in vLLM's convention, the one draftline keeps them in (shards, training record,
    lineage, the drafter's Eagle3Config): other conventions exist only in the files an engine reads (`written`,
    `read`)."""

    ids: tuple[int, ...]

    def __post_init__(self):
        if len(self.ids) != 3 or len(set(self.ids)) != 3 or any(i < 0 for i in self.ids):
            raise ConfigError(f"aux-layer ids {list(self.ids)} must be three distinct non-negative layer ids, "
                              "e.g. [2, 4, 5]")

    @classmethod
    def of(cls, ids: Iterable[int]) -> "AuxLayerIds":
        """vLLM-convention ids, checked."""
        return cls(tuple(int(i) for i in ids))

    @classmethod
    def read(cls, ids: Iterable[int], convention: str) -> "AuxLayerIds":
        """Ids written in `convention` (an engine's config), as vLLM's."""
        return cls.of(from_convention(ids, convention))

    @classmethod
    def stored(cls, ids: Iterable[int] | None, convention: str, source: str, fix: str) -> "AuxLayerIds | None":
        """Ids a draftline file records with its convention (shard metadata, training record), None where it names
        none; a convention other than vLLM's is one sentence naming the file and `fix`."""
        if convention != VLLM:
            raise ConfigError(f"{source} records aux-layer ids in the {convention!r} convention, not vLLM's as "
                              f"draftline writes them; {fix}")
        return None if ids is None else cls.of(ids)

    @classmethod
    def for_target(cls, ids: Iterable[int] | None, num_layers: int,
                   field: str = "extract.aux_layer_ids") -> "AuxLayerIds":
        """The ids to capture from a target with num_layers layers (the defaults when None), ascending, or one
        sentence naming `field` and the fix."""
        if num_layers < 3:
            raise ConfigError(f"the target has {num_layers} decoder layers; EAGLE-3 needs three distinct aux layers, "
                              "so use a target with at least 3")
        fix = f"set {field} to three distinct layer-input ids between 0 and {num_layers - 1} (vLLM convention)"
        if ids is None:
            chosen = default_aux_layer_ids(num_layers)
            if len(set(chosen)) != 3 or outside(chosen, num_layers):
                raise ConfigError(f"the default aux layers {chosen} (inputs of 2, L//2, L-3) are not three distinct "
                                  f"layers of a {num_layers}-layer target; {fix}")
            return cls.of(sorted(chosen))
        chosen = [int(i) for i in ids]
        bad = outside(chosen, num_layers)
        if bad:
            raise ConfigError(f"{field}={chosen} has ids {bad} out of range for a target with {num_layers} layers; "
                              f"{fix}")
        if len(chosen) != 3 or len(set(chosen)) != 3:
            raise ConfigError(f"{field}={chosen} is not three distinct layers; {fix}")
        return cls.of(sorted(chosen))

    def as_list(self) -> list[int]:
        """The ids as draftline's files and the hooks take them."""
        return list(self.ids)

    def written(self, convention: str) -> list[int]:
        """The ids as an engine reading `convention` needs them."""
        return to_convention(self.ids, convention)

    def check_fits(self, num_layers: int) -> None:
        """Refuse ids that name no layer input of a target with num_layers layers."""
        bad = outside(self.ids, num_layers)
        if bad:
            raise ConfigError(
                f"aux layer ids {self.as_list()} (vLLM convention, input of layer k) contradict a target with "
                f"{num_layers} layers: {bad} outside 0..{num_layers - 1}; use ids below the layer count, "
                f"e.g. {default_aux_layer_ids(num_layers)}"
            )

    def shifted(self, shift: int) -> list[int]:
        """Every id moved by `shift`, as a convention mix-up moves them (a list: it may leave the target)."""
        return [i + shift for i in self.ids]
