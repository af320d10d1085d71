"""The demo corpus: the running interpreter's standard-library source, split by module into train and held-out parts."""
from __future__ import annotations

import ast
import hashlib
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Files larger than this are data tables (pydoc topics, unicode maps), not code worth learning from.
MAX_FILE_BYTES = 300_000
HELD_OUT_PERCENT = 12
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "lib-dynload"}


@dataclass(frozen=True)
class ModuleSource:
    """One standard-library module: dotted name, path relative to the stdlib root, and its text."""

    name: str
    relpath: str
    text: str

    @property
    def is_test(self) -> bool:
        parts = self.name.split(".")
        return parts[0] in {"test", "idlelib.idle_test"} or any(p in {"test", "tests", "idle_test"} for p in parts)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def module_name(relpath: str) -> str:
    parts = list(Path(relpath).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def is_held_out(name: str, percent: int = HELD_OUT_PERCENT) -> bool:
    """Deterministic split by module name, so the same module lands on the same side on every machine."""
    bucket = int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % 100
    return bucket < percent


def stdlib_modules(root: Path | None = None) -> list[ModuleSource]:
    """All UTF-8 .py files of the stdlib (test suites included: they are real code too), sorted by name."""
    root = Path(root) if root else stdlib_root()
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(p in _SKIP_DIRS or p.startswith("config-") for p in rel.parts[:-1]):
            continue
        data = path.read_bytes()
        if len(data) > MAX_FILE_BYTES:
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:  # a handful of test files in legacy encodings on purpose
            continue
        if not text.strip():
            continue
        out.append(ModuleSource(module_name(str(rel)), rel.as_posix(), text))
    return out


def split_modules(modules: list[ModuleSource]) -> tuple[list[ModuleSource], list[ModuleSource]]:
    train = [m for m in modules if not is_held_out(m.name)]
    held = [m for m in modules if is_held_out(m.name)]
    return train, held


@dataclass(frozen=True)
class DocumentedFunction:
    """A function with a docstring: `head` is its signature and docstring, `body` the code after them."""

    module: str
    qualname: str
    head: str
    body: str


def documented_functions(module: ModuleSource, min_body_lines: int = 2, max_body_lines: int = 40) -> list[DocumentedFunction]:
    """Functions and methods with a docstring and a body of a few lines, dedented to column 0 for the signature."""
    try:
        tree = ast.parse(module.text)
    except SyntaxError:  # e.g. test inputs that are deliberately invalid
        return []
    lines = module.text.splitlines(keepends=True)
    found = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                qual = f"{prefix}{child.name}"
                doc = ast.get_docstring(child, clean=False)
                if doc and len(child.body) > 1 and not child.decorator_list:
                    doc_node = child.body[0]
                    body_start, body_end = child.body[1].lineno - 1, child.end_lineno
                    n_body = body_end - body_start
                    if min_body_lines <= n_body <= max_body_lines:
                        indent = child.col_offset
                        head_lines = lines[child.lineno - 1: doc_node.end_lineno]
                        body_lines = lines[body_start:body_end]
                        if all(line[:indent].strip() == "" for line in head_lines + body_lines):
                            head = "".join(line[indent:] for line in head_lines)
                            body = "".join(line[indent:] for line in body_lines)
                            found.append(DocumentedFunction(module.name, qual, head, body))
                visit(child, qual + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(tree, "")
    return found


def corpus_fingerprint(modules: list[ModuleSource]) -> str:
    h = hashlib.sha256()
    for m in modules:
        h.update(m.name.encode() + b"\0" + hashlib.sha256(m.text.encode()).digest())
    return h.hexdigest()


def python_version() -> str:
    return ".".join(map(str, sys.version_info[:3]))
