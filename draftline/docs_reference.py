"""The reference pages generated from the code (docs/reference/): written, or checked for staleness with --check."""
from __future__ import annotations

import argparse
import json
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Callable, Literal

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from draftline import cli_reference
from draftline import config as config_module
from draftline.config import PipelineConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
REGENERATE = "python -m draftline.docs_reference"
CONFIG_PAGE = "docs/reference/config.md"
CLI_PAGE = "docs/reference/cli.md"


# ---------------------------------------------------------------------------------------------- the config page

def config_sections(model: type[BaseModel] = PipelineConfig) -> list[tuple[str, type[BaseModel]]]:
    """(key path, model) of every YAML section, depth first in declaration order: "" is the top level, a list of
    sections is written `eval.engines[]`."""
    return [(path, section) for path, section, _ in _walk(model)]


def _walk(model: type[BaseModel], path: str = "", holder: FieldInfo | None = None):
    """(key path, model, the field that holds it or None at the top) of the section `model` and every one below."""
    yield path, model, holder
    for name, field in model.model_fields.items():
        nested, is_list = _section_model(field.annotation)
        if nested is not None:
            yield from _walk(nested, _join(path, name) + ("[]" if is_list else ""), field)


def config_models() -> list[type[BaseModel]]:
    """Every pydantic model of draftline.config, nested in the pipeline config or not."""
    found = {model for _, model in config_sections()}
    found |= {obj for obj in vars(config_module).values()
              if isinstance(obj, type) and issubclass(obj, BaseModel) and obj.__module__ == config_module.__name__}
    return sorted(found, key=lambda m: m.__name__)


def config_reference() -> str:
    """The config reference page: one table per YAML section (key path, type, default, description)."""
    lines = ["# Configuration reference", "",
             f"Generated from the pydantic models in `draftline/config.py` by `{REGENERATE}` (`--check` "
             "says whether it is current); edit the models' descriptions there, not this page.", "",
             "A pipeline config is one YAML file of these sections (`configs/demo.yaml` is one). Unknown keys are "
             "errors, and every bad value is named with its fix when the file is read. `null` is YAML's null. The "
             "same descriptions appear in the Prefect run form of every flow that takes a `config`."]
    sections = list(_walk(PipelineConfig))
    for path, model, holder in sections:
        intro = _first_paragraph(model.__doc__)
        if holder is not None and sum(m is model for _, m, _ in sections) > 1:
            intro = f"{holder.description} {intro}"  # one model under several keys: first what this key is for
        lines += ["", f"## `{path}`" if path else "## Top level", "", _markdown(intro), "",
                  "| Key | Type | Default | Description |", "| --- | --- | --- | --- |"]
        for name, field in model.model_fields.items():
            cells = [_code(_join(path, name)), _markdown(_type_text(field), in_table=True), _default_text(field),
                     _markdown(field.description or "", in_table=True)]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_config_reference(path: str | Path = REPO_ROOT / CONFIG_PAGE) -> Path:
    """Write the config reference page; returns its path."""
    return _write(Path(path), config_reference())


def _section_model(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The model a field holds (itself, or the items of a list of them, or X | None), and whether it is a list."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is list and args:
        inner, _ = _section_model(args[0])
        return inner, inner is not None
    if _is_union(origin):
        for arg in args:
            inner, is_list = _section_model(arg)
            if inner is not None:
                return inner, is_list
    return None, False


def _is_union(origin: Any) -> bool:
    return origin is typing.Union or origin is types.UnionType


_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}
_PLURALS = {"string": "strings", "integer": "integers", "number": "numbers", "boolean": "booleans"}


def _type_text(field: FieldInfo) -> str:
    """The field's type as a YAML writer reads it, with its bounds: `integer (>= 1) or null`."""
    return _annotation_text(field.annotation, _bounds(field))


def _annotation_text(annotation: Any, bounds: str = "") -> str:
    nested, is_list = _section_model(annotation)
    if nested is not None and not _is_union(typing.get_origin(annotation)):
        return "list of sections" if is_list else "section"
    if annotation in _SCALARS:
        name = _SCALARS[annotation]
        return f"{name} ({bounds})" if bounds and annotation in (int, float) else name
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return ("one of " if len(args) > 1 else "") + ", ".join(f"`{a}`" for a in args)
    if origin is list:
        item = _annotation_text(args[0]).removeprefix("one of ")
        return f"list of {_PLURALS.get(item, item)}"
    if origin is dict:
        return f"mapping of {_annotation_text(args[0])} to {_annotation_text(args[1])}"
    if _is_union(origin):
        return " or ".join(_annotation_text(a, bounds) for a in args)
    return getattr(annotation, "__name__", str(annotation))


def _bounds(field: FieldInfo) -> str:
    signs = {annotated_types.Ge: ("≥", "ge"), annotated_types.Gt: (">", "gt"), annotated_types.Le: ("≤", "le"),
             annotated_types.Lt: ("<", "lt")}
    parts = []
    for meta in field.metadata:
        for kind, (sign, attr) in signs.items():
            if isinstance(meta, kind):
                parts.append(f"{sign} {getattr(meta, attr)}")
    return ", ".join(parts)


def _default_text(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.default
    if isinstance(value, BaseModel):
        changed = value.model_dump(mode="json", exclude_defaults=True)
        return _code(json.dumps(changed)) if changed else "its keys' defaults"
    if isinstance(value, list) and any(isinstance(v, BaseModel) for v in value):
        value = [v.model_dump(mode="json", exclude_defaults=True) if isinstance(v, BaseModel) else v for v in value]
    return _code(value if isinstance(value, str) else json.dumps(value))


def _first_paragraph(doc: str | None) -> str:
    return " ".join((doc or "").strip().split("\n\n")[0].split())


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


# A `<` that would open an HTML tag (`<run>`), a `*` that could start emphasis.
_MARKUP = re.compile(r"<(?=[A-Za-z/!?])|\*")


def _code(text: str) -> str:
    """A code span in a table cell (where `|` ends the cell even inside one)."""
    return "`" + text.replace("|", "\\|") + "`"


def _markdown(text: str, in_table: bool = False) -> str:
    """Plain text as markdown shows it verbatim; in a table cell `|` would end the cell."""
    text = _MARKUP.sub(lambda m: "&lt;" if m.group() == "<" else "\\*", text)
    return text.replace("|", "\\|") if in_table else text


# ---------------------------------------------------------------------------------------------- every page

# Each generated page (its path under the repository root) and the function that renders it.
PAGES: dict[str, Callable[[], str]] = {
    CONFIG_PAGE: config_reference,
    CLI_PAGE: cli_reference.render,
}


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def write_pages(root: str | Path = REPO_ROOT) -> list[Path]:
    """Write every generated page under `root`; returns their paths."""
    return [_write(Path(root) / page, render()) for page, render in PAGES.items()]


def stale_pages(root: str | Path = REPO_ROOT) -> list[str]:
    """The generated pages under `root` that differ from what the code renders now (or are missing)."""
    stale = []
    for page, render in PAGES.items():
        path = Path(root) / page
        if not path.is_file() or path.read_text(encoding="utf-8") != render():
            stale.append(page)
    return stale


def main(argv: list[str] | None = None) -> int:
    """Write the reference pages, or with --check exit 1 when one is stale."""
    parser = argparse.ArgumentParser(prog="python -m draftline.docs_reference", description=main.__doc__)
    parser.add_argument("--check", action="store_true", help="only compare the pages with the code; exit 1 if stale")
    parser.add_argument("--root", default=str(REPO_ROOT), help="the repository root the pages live under")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_pages(args.root)
        for page in stale:
            print(f"{page} is stale: it differs from what the code generates; regenerate it with: {REGENERATE}",
                  file=sys.stderr)
        return 1 if stale else 0
    for path in write_pages(args.root):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
