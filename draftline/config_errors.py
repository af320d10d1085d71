"""One sentence per pydantic validation error of a config: the field, the value and the fix."""
from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel


def describe_error(err: dict[str, Any], model: type[BaseModel], source: str) -> str:
    loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
    kind = err["type"]
    if kind == "extra_forbidden":
        parent = model_at(model, err["loc"][:-1])
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


def model_at(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
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
