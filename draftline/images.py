"""Image content parts: where each one's bytes are (a local file, an s3:// object, base64 or an http(s) URL), whether
they open as an image, and the part as vLLM's chat API takes it (the same for traces, extraction and evaluation).

A record's image part is an OpenAI part, {"type": "image_url", "image_url": {"url": ...}}, or {"type": "image",
"image": ...}; the value is a data URL ("data:image/png;base64,..."), plain base64, an http(s) URL, an s3:// object,
or a path (absolute, or relative to the prompts file's folder). Local files, S3 objects and base64 reach the engine
inline as data URLs, so a server on another machine needs no access to them; an http(s) URL is sent as it is, and is
checked to answer before any server starts.
"""
from __future__ import annotations

import base64
import binascii
import io
import json
import mimetypes
from pathlib import Path

from draftline.conversations import BadRecord, Origin

IMAGE_TYPES = ("image_url", "image")


def is_image(part: dict) -> bool:
    return part.get("type") in IMAGE_TYPES


def image_parts(messages: list[dict]) -> list[tuple[int, int, dict]]:
    """(message index, part index, part) of every image part, in order."""
    return [(i, j, p) for i, m in enumerate(messages) if isinstance(m.get("content"), list)
            for j, p in enumerate(m["content"]) if is_image(p)]


def count_images(record: dict) -> int:
    return len(image_parts(record.get("messages") or []))


def part_source(part: dict) -> str | None:
    """The string an image part names its image by, or None when it names none."""
    value = part.get("image_url") if part.get("type") == "image_url" else part.get("image", part.get("url"))
    if isinstance(value, dict):
        value = value.get("url")
    return value if isinstance(value, str) and value else None


def target_takes_images(target_dir: str | Path) -> bool:
    """Whether the target has a vision tower (its config.json carries a vision_config)."""
    config = Path(target_dir, "config.json")
    return config.is_file() and bool(json.loads(config.read_text()).get("vision_config"))


MEDIA_ID_KEYS = ("media_placeholder_token_id", "image_token_id", "image_token_index", "video_token_id",
                 "vision_start_token_id", "vision_end_token_id")


def media_token_ids(target_dir: str | Path) -> set[int]:
    """The ids of the target's media tokens (placeholders, and the markers around them), from its config.json."""
    config = Path(target_dir, "config.json")
    cfg = json.loads(config.read_text()) if config.is_file() else {}
    return {cfg[k] for k in MEDIA_ID_KEYS if isinstance(cfg.get(k), int)} if cfg.get("vision_config") else set()


def media_placeholder_id(target_dir: str | Path) -> int | None:
    """The id the engine expands into an image's features (media_placeholder_token_id, else image_token_id)."""
    config = Path(target_dir, "config.json")
    cfg = json.loads(config.read_text()) if config.is_file() else {}
    return next((cfg[k] for k in MEDIA_ID_KEYS[:3] if isinstance(cfg.get(k), int)), None)


def mask_media(input_ids: list[int], loss_mask: list[int], media_ids: set[int]) -> list[int]:
    """The loss mask with every media token out of the loss: the drafter never learns to predict an image."""
    return [0 if t in media_ids else m for t, m in zip(input_ids, loss_mask)] if media_ids else loss_mask


def _read(source: str, base: Path | None) -> tuple[bytes, str]:
    """The image's bytes and how to name where they came from; ValueError says what could not be read."""
    if source.startswith("data:"):
        header, _, payload = source.partition(",")
        if ";base64" not in header:
            raise ValueError("a data URL that is not base64")
        return base64.b64decode(payload, validate=True), "its data URL"
    if source.startswith("s3://"):
        from draftline.store import ObjectNotFound, open_store

        bucket, _, key = source[len("s3://"):].partition("/")
        try:
            return open_store(f"s3://{bucket}", check=False).get_objects(key).read_bytes(), source
        except ObjectNotFound:
            raise ValueError(f"no object at {source}") from None
    path = Path(source[len("file://"):] if source.startswith("file://") else source)
    if not path.is_absolute() and base is not None and (base / path).exists():
        path = base / path
    if path.is_file():
        return path.read_bytes(), str(path)
    if len(source) > 256 or "/" not in source and "." not in source:  # too long for a name: base64 without a header
        try:
            return base64.b64decode(source, validate=True), "its base64"
        except (binascii.Error, ValueError):
            pass
    raise ValueError(f"no such file {path}")


def _reachable(url: str, timeout_s: float) -> str | None:
    """None when the URL answers with a body, else why not."""
    import httpx

    try:
        resp = httpx.get(url, timeout=timeout_s, follow_redirects=True)
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None if resp.status_code == 200 and resp.content else f"HTTP {resp.status_code}"


def engine_part(part: dict, origin: Origin, where: str, base: Path | None = None,
                max_pixels: int | None = None, url_timeout_s: float = 10.0) -> dict:
    """The part as vLLM's chat API takes it, {"type": "image_url", "image_url": {"url": ...}}, once its image is read
    and opens; BadRecord names the record, the part and the fix when it is unreadable, too large or unreachable.
    where: the part's field in the record, e.g. "messages[0].content[1]"."""
    from PIL import Image

    source = part_source(part)
    if source is None:
        raise BadRecord(origin.where, where, 'names no image; give {"type": "image_url", "image_url": {"url": ...}} '
                        'with a data URL, an http(s) URL, an s3:// object or a file path')
    if source.startswith(("http://", "https://")):
        why = _reachable(source, url_timeout_s)
        if why:
            raise BadRecord(origin.where, where, f"the image URL {source} cannot be reached from this worker ({why}); "
                            "make it reachable, or put the image in a file or in the store")
        return {"type": "image_url", "image_url": {"url": source}}
    try:
        data, named = _read(source, base)
    except (ValueError, OSError) as exc:
        raise BadRecord(origin.where, where, f"its image cannot be read ({exc}); point it at an image file, an s3:// "
                        "object or base64 data") from None
    limit = max_pixels or Image.MAX_IMAGE_PIXELS
    try:
        with Image.open(io.BytesIO(data)) as image:
            size, kind = image.size, (image.format or "png").lower()
            if size[0] * size[1] > limit:
                raise BadRecord(origin.where, where, f"{named} is {size[0]}x{size[1]} pixels, more than the {limit} "
                                "the image loader takes; scale it down")
            image.verify()
    except BadRecord:
        raise
    except Exception as exc:  # Pillow raises what the bytes trip (UnidentifiedImageError, SyntaxError, ...)
        raise BadRecord(origin.where, where, f"{named} is not an image Pillow can open ({type(exc).__name__}: "
                        f"{exc}); replace it with a PNG or JPEG") from None
    mime = mimetypes.types_map.get(f".{kind}", f"image/{kind}")
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{base64.b64encode(data).decode()}"}}


def engine_messages(record: dict, origin: Origin, base: Path | None = None, max_pixels: int | None = None
                    ) -> list[dict]:
    """The record's messages with every image part as the engine takes it (engine_part), text parts as they are."""
    messages = [dict(m) for m in record["messages"]]
    for i, j, part in image_parts(record["messages"]):
        content = list(messages[i]["content"])
        content[j] = engine_part(part, origin, f"{origin.field(i)}.content[{j}]", base, max_pixels)
        messages[i]["content"] = content
    return messages


def text_only_refusal(record: dict, origin: Origin, target_dir: str | Path) -> BadRecord | None:
    """The one-sentence refusal of an image part for a target without a vision tower, if the record has one."""
    found = image_parts(record.get("messages") or [])
    if not found:
        return None
    i, j, _ = found[0]
    return BadRecord(origin.where, f"{origin.field(i)}.content[{j}]", f"an image part, but the target {target_dir} "
                     "is text-only (its config.json has no vision_config); remove the image or use a multimodal target")


def prompts_base(source: str) -> Path | None:
    """The folder relative image paths in a prompts file are read from: the file's own folder (local files only)."""
    return None if source.startswith("s3://") else Path(source).resolve().parent
