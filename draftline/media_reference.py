"""Images in the reference decoder: each image's features from the target's own vision tower, placed at the prompt's
media placeholders whenever the target embeds that prompt, as a serving engine places them.

The engine's image processor resizes and pads an image to whole 2 x 2 blocks of patches; the reference decoder takes
the images that need neither (sides a multiple of patch size x merge size, within the processor's patch limits), and
refuses the others in one sentence, so that both see the same pixels.
"""
from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import torch

from draftline.conversations import BadRecord, Origin
from draftline.images import engine_messages, image_parts, media_placeholder_id, part_source


def processor_config(target_dir: str | Path) -> dict:
    """The image processor's settings (preprocessor_config.json's media_proc_cfg, as Kimi-K2.5 ships them)."""
    path = Path(target_dir, "preprocessor_config.json")
    cfg = json.loads(path.read_text()) if path.is_file() else {}
    return cfg.get("media_proc_cfg", cfg)


def pixel_patches(data: bytes, proc: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel values [patches, 3, p, p], grid [1, 3] = (1, rows, columns)) of one image; ValueError when the
    processor would resize or pad it."""
    from PIL import Image

    p, merge = int(proc.get("patch_size", 14)), int(proc.get("merge_kernel_size", 2))
    with Image.open(io.BytesIO(data)) as image:
        rgb = image.convert("RGB")
    w, h = rgb.size
    rows, cols = h // p, w // p
    per_side = int(proc.get("patch_limit_on_one_side", 10 ** 9))
    if w % (p * merge) or h % (p * merge) or rows * cols > int(proc.get("in_patch_limit", 10 ** 9)) \
            or max(rows, cols) > per_side:
        raise ValueError(f"it is {w}x{h} pixels, which the target's processor resizes or pads; the reference decoder "
                         f"takes sides that are multiples of {p * merge} pixels with at most "
                         f"{proc.get('in_patch_limit')} patches of {p}")
    x = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8).reshape(h, w, 3).permute(2, 0, 1).float() / 255
    mean = torch.tensor(proc.get("image_mean", [0.5] * 3)).view(3, 1, 1)
    std = torch.tensor(proc.get("image_std", [0.5] * 3)).view(3, 1, 1)
    x = (x - mean) / std
    patches = x.reshape(3, rows, p, cols, p).permute(1, 3, 0, 2, 4).reshape(rows * cols, 3, p, p)
    return patches, torch.tensor([[1, rows, cols]])


def image_bytes(part: dict) -> bytes:
    """The bytes of an engine part's data URL."""
    return base64.b64decode(part_source(part).split(",", 1)[1])


def expand(ids: list[int], placeholder: int, counts: list[int]) -> list[int]:
    """The ids with the n-th placeholder repeated counts[n] times (what the engine's processor does)."""
    out, n = [], 0
    for t in ids:
        if t == placeholder and n < len(counts):
            out += [t] * counts[n]
            n += 1
        else:
            out.append(t)
    if n != len(counts):
        raise ValueError(f"the prompt holds {n} image placeholders for {len(counts)} images")
    return out


def prompt_media(target_dir: str | Path, record: dict, ids: list[int], origin: Origin, base: Path | None
                 ) -> tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]]:
    """(the prompt's ids with each image's placeholder expanded, each image's (pixel patches, grid) in order)."""
    proc, placeholder = processor_config(target_dir), media_placeholder_id(target_dir)
    merge = int(proc.get("merge_kernel_size", 2)) ** 2
    messages = engine_messages(record, origin, base)
    images = []
    for (i, j, _), (_, _, part) in zip(image_parts(record["messages"]), image_parts(messages)):
        try:
            images.append(pixel_patches(image_bytes(part), proc))
        except ValueError as exc:
            raise BadRecord(origin.where, f"{origin.field(i)}.content[{j}]", f"{exc}; resize it, or evaluate image "
                            "prompts on the engines alone (eval.reference.enabled: false)") from None
    return expand(ids, placeholder, [pixels.shape[0] // merge for pixels, _ in images]), images


class MediaFeed:
    """Hands the target its images whenever it runs a prompt's media placeholders: `rows` holds, for each row of the
    batch about to be decoded, its images' (pixel patches, grid) in order (an empty list for a row without images).
    The target's own forward then runs its vision tower and places the features, as it does for pixel_values."""

    def __init__(self, model, placeholder: int):
        self.model, self.placeholder = model, placeholder
        self.rows: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        self.all_rows: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # every prompt's: `rows` is a window
        self._handles: list = []

    def _pre_hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None or ids.shape[1] == 1 or kwargs.get("pixel_values") is not None:
            return None
        mask = ids == self.placeholder
        images = [image for b in range(ids.shape[0]) if bool(mask[b].any()) and b < len(self.rows)
                  for image in self.rows[b]]
        if not images:
            return None
        param = next(module.parameters())
        kwargs = dict(kwargs, pixel_values=torch.cat([p for p, _ in images]).to(param.device, param.dtype),
                      image_grid_thw=torch.cat([g for _, g in images]).to(param.device))
        return args, kwargs

    def attach(self, model=None) -> None:
        """Feed `model` (default: the one given at construction; another precision's copy shares the rows)."""
        self._handles.append((model or self.model).register_forward_pre_hook(self._pre_hook, with_kwargs=True))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
