"""Reading pipeline configs: YAML files and overrides validated into the config models, every problem named in one
sentence with its field, value and fix."""
from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from draftline.config import _SECRET_KEY, PipelineConfig
from draftline.errors import ConfigError


def _describe_error(err: dict[str, Any], model: type[BaseModel], source: str) -> str:
    loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
    kind = err["type"]
    if kind == "extra_forbidden":
        parent = _model_at(model, err["loc"][:-1])
        allowed = sorted(parent.model_fields) if parent else []
        bad = str(err["loc"][-1])
        hint = difflib.get_close_matches(bad, allowed, n=1)
        fix = f"did you mean {hint[0]!r}?" if hint else f"allowed keys: {', '.join(allowed)}"
        return f"{source}: unknown key {loc!r}; {fix}"
    if kind == "missing":
        return f"{source}: {loc} is required but missing; add it"
    value = err.get("input")
    msg = err["msg"].removeprefix("Value error, ")
    if not err["loc"] or isinstance(value, dict):  # a whole section: its message names the fields, not its dump
        return f"{source}: {msg}"
    return f"{source}: {loc}={value!r} is invalid: {msg}"


def _model_at(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            return None
        ann = field.annotation
        # Unwrap list[X] / X | None to reach the section model.
        for arg in getattr(ann, "__args__", ()) or ():
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                ann = arg
        current = ann
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def parse_config(data: Any, model: type[BaseModel] = PipelineConfig, source: str = "config") -> BaseModel:
    """Validate a mapping; raise ConfigError with one sentence per problem, naming field, value and fix."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections, got {type(data).__name__}")
    _reject_secrets(data, source)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        lines = [_describe_error(e, model, source) for e in exc.errors()]
        raise ConfigError("\n".join(lines)) from None


def _reject_secrets(data: Any, source: str, path: str = "") -> None:
    if isinstance(data, dict):
        for key, value in data.items():
            where = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and _SECRET_KEY.search(key) and not isinstance(value, dict):
                raise ConfigError(
                    f"{source}: {where} looks like a secret; secrets never go in config files, "
                    "set them in the environment (e.g. AWS_SECRET_ACCESS_KEY) instead"
                )
            _reject_secrets(value, source, where)
    elif isinstance(data, list):
        for i, item in enumerate(data):
            _reject_secrets(item, source, f"{path}[{i}]")


def merge_overrides(base: dict, overrides: dict) -> dict:
    """`overrides` laid over `base`, section by section: a mapping merges into the mapping it replaces, key by key;
    anything else (a value, a list such as eval.engines, null) replaces what was there."""
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_overrides(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_config(path: str | os.PathLike, model: type[BaseModel] = PipelineConfig,
                overrides: dict | None = None) -> BaseModel:
    """Read a YAML file and validate it, with `overrides` merged into it first (merge_overrides); relative paths
    inside stay relative to the current directory. Every problem is named, one sentence each."""
    data = read_config_file(path)
    if not overrides or not isinstance(data, dict):
        return parse_config(data, model, str(path))
    if not isinstance(overrides, dict):
        raise ConfigError(f"the overrides for {path} must be a mapping of sections, such as "
                          f'{{"train": {{"max_steps": 20}}}}, got {type(overrides).__name__}')
    return parse_config(merge_overrides(data, overrides), model, f"{path} with overrides")


def read_config_file(path: str | os.PathLike) -> Any:
    """The YAML of a config file, parsed but not validated."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: no such config file; pass the path of a YAML file such as configs/demo.yaml")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{p}: not valid YAML{where}; fix the syntax there") from None
    return data
