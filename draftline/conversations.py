"""One reader for prompts and conversations from files, datasets and S3: raw prompts, OpenAI messages or ShareGPT.

Sources: a JSON-lines file, a JSON file holding a list, a parquet file, or a folder a `datasets.Dataset` was saved
to with `save_to_disk`; each a local path or an s3:// location (downloaded once into the cache). Each record is one
of {"id", "prompt": str}, {"id", "messages": [OpenAI messages]} or {"id", "conversations": [ShareGPT turns]}, with
an optional "system" string for the two chat shapes. Records come back in one normal form, {"id", "prompt"} or
{"id", "messages"}, whose messages have the roles system, user, assistant and tool, a string or a list of content
parts, and the assistant's `reasoning_content` where the data has it; a bad record is named by its file, its line
(JSON lines) or record number (counting from 0), and its field.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from draftline.errors import ConfigError

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
SHAPES = ("prompt", "messages", "conversations")
# Message keys a chat template or an engine's chat API reads besides role, content and reasoning; a dataset's other
# bookkeeping (weights, timestamps) is left out.
EXTRA_MESSAGE_KEYS = ("name", "tool_calls", "tool_call_id")
SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet"}
FORMATS_HINT = "a .jsonl, .json or .parquet file, or a folder a dataset was saved to with datasets' save_to_disk"


class BadRecord(ConfigError):
    """One record that cannot be used: where it is (file and line or record), which field, and what is wrong."""

    def __init__(self, where: str, field: str | None, problem: str):
        self.where, self.field, self.problem = where, field, problem
        super().__init__(f"{where}, {field}: {problem}" if field else f"{where}: {problem}")

    def as_dict(self) -> dict:
        return {"where": self.where, "field": self.field, "problem": self.problem}


@dataclass(frozen=True)
class Origin:
    """Where a record came from: "file, line 3", its conversation's key, and how many system turns the reader put
    before the file's own turns (a top-level "system"), so that a message index names the file's own field."""

    where: str
    key: str = "prompt"
    added: int = 0

    def field(self, index: int | None = None) -> str:
        if index is None or self.key == "prompt":
            return self.key
        return "system" if index < self.added else f"{self.key}[{index - self.added}]"

    def bad(self, index: int | None, problem: str) -> BadRecord:
        return BadRecord(self.where, self.field(index), problem)


class PromptSet(list):
    """The records read, in order (a list of {"id", "prompt"} or {"id", "messages"}), with each one's origin by id,
    the bad records skipped, and how many records were read in all."""

    def __init__(self, records: list[dict], source: str, origins: dict[str, Origin], skipped: list[BadRecord],
                 read: int):
        super().__init__(records)
        self.source, self.origins, self.skipped, self.read = source, origins, skipped, read

    def origin(self, record_id: str) -> Origin:
        return self.origins.get(record_id) or Origin(f"{self.source}, id {record_id!r}")


def read_prompt_set(source: str | Path, field: str = "traces.prompts", *, turns: str = "last",
                    responses: str = "regenerate", on_bad_record: str = "fail", limit: int | None = None
                    ) -> PromptSet:
    """Every record of `source` (the config field that names it: `field`) in normal form.

    turns "last": the target answers each conversation's last turn, which must not be the assistant's; "all": every
    assistant turn is answered in order. responses "dataset": the dataset's own answers are trained on, so every
    record needs an assistant turn. on_bad_record "fail" raises BadRecord at the first bad record; "skip" leaves it
    out and lists it in `skipped`. limit: stop after this many good records.
    """
    source = str(source)
    path = local_copy(source, field)
    records, origins, skipped, read = [], {}, [], 0
    for index, (where, obj) in enumerate(_raw_records(path, source, field)):
        read += 1
        try:
            record, origin = parse_record(obj, where, index)
            check_record(record, origin, field, turns, responses)
            if record["id"] in origins:
                raise BadRecord(where, "id", f"{record['id']!r} is also the id of {origins[record['id']].where}; "
                                "ids must be unique")
        except BadRecord as bad:
            if on_bad_record != "skip":
                raise
            skipped.append(bad)
            continue
        records.append(record)
        origins[record["id"]] = origin
        if limit and len(records) >= limit:
            break
    if not records and not skipped:
        raise ConfigError(f"{source}: holds no records; add some like {{\"id\": \"p1\", \"prompt\": \"Hello\"}} "
                          f"(set {field} to {FORMATS_HINT})")
    if not records:
        raise ConfigError(f"{source}: every one of its {read} records is bad (the first: {skipped[0]}); fix them")
    return PromptSet(records, source, origins, skipped, read)


# ---------------------------------------------------------------------------------------------- sources


def local_copy(source: str, field: str = "traces.prompts") -> Path:
    """The local file or folder of `source`: the path itself, or the s3:// object(s) downloaded into the cache."""
    if source.startswith("s3://"):
        from draftline.store import ObjectNotFound, open_store

        bucket, _, key = source[len("s3://"):].rstrip("/").partition("/")
        if not key:
            raise ConfigError(f"{field}={source!r} names a whole bucket; name the file or folder in it")
        try:
            return open_store(f"s3://{bucket}", check=False).get_objects(key)
        except ObjectNotFound:
            raise ConfigError(f"{source}: no object there nor under it; set {field} to {FORMATS_HINT}") from None
    path = Path(source)
    if not path.exists():
        raise ConfigError(f"{path}: no such file or folder; set {field} to {FORMATS_HINT}")
    return path


def source_name(source: str | Path) -> str:
    """The last part of a path or s3:// location: how a report names the prompt set."""
    return str(source).rstrip("/").rsplit("/", 1)[-1]


def source_sha256(source: str | Path, field: str = "eval.prompts") -> str:
    """sha256 of the file's bytes, or, for a dataset folder, of its files' names and hashes in order."""
    path = local_copy(str(source), field)
    if path.is_file():
        return _file_sha256(path)
    digest = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")):
        digest.update(f"{f.relative_to(path).as_posix()}\0{_file_sha256(f)}\n".encode())
    return digest.hexdigest()


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _raw_records(path: Path, source: str, field: str) -> Iterator[tuple[str, Any]]:
    """(where, the record's object, or a BadRecord when a line is not JSON) for each record of the source."""
    if path.is_dir():
        yield from _dataset_rows(path, source)
        return
    kind = SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise ConfigError(f"{source}: {path.suffix or 'no'} extension, which says nothing of its format; set {field} "
                          f"to {FORMATS_HINT}")
    if kind == "jsonl":
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{source}, line {n}"
                try:
                    yield where, json.loads(line)
                except json.JSONDecodeError as exc:
                    yield where, BadRecord(where, None, f"not valid JSON ({exc.msg} at column {exc.colno}); fix "
                                           "that line")
    elif kind == "json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            hint = "; a file of one object per line is JSON lines: name it .jsonl" if exc.msg == "Extra data" else ""
            raise ConfigError(f"{source}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})"
                              f"{hint}") from None
        if not isinstance(data, list):
            raise ConfigError(f"{source}: a JSON file of records must hold a list of them, not a "
                              f"{type(data).__name__}")
        for i, obj in enumerate(data):
            yield f"{source}, record {i}", obj
    else:
        import pyarrow.parquet as pq

        i = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                yield f"{source}, record {i}", row
                i += 1


def _dataset_rows(path: Path, source: str) -> Iterator[tuple[str, Any]]:
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits") or []
        raise ConfigError(f"{source}: a dataset of several splits ({', '.join(splits)}); name one of them, e.g. "
                          f"{source.rstrip('/')}/{splits[0] if splits else 'train'}")
    if not (path / "state.json").is_file():
        raise ConfigError(f"{source}: a folder, but not one a dataset was saved to (no state.json); name "
                          f"{FORMATS_HINT}")
    import pyarrow as pa

    # save_to_disk's layout: state.json lists the data files, each an Arrow IPC stream of the rows in order.
    i = 0
    for data_file in json.loads((path / "state.json").read_text()).get("_data_files") or []:
        with pa.memory_map(str(path / data_file["filename"])) as stream:
            for batch in pa.ipc.open_stream(stream):
                for row in batch.to_pylist():
                    yield f"{source}, record {i}", row
                    i += 1


# ---------------------------------------------------------------------------------------------- records


def parse_record(obj: Any, where: str, index: int) -> tuple[dict, Origin]:
    """One record in normal form, and its origin; BadRecord names the first thing wrong with it."""
    if isinstance(obj, BadRecord):
        raise obj
    if not isinstance(obj, dict):
        raise BadRecord(where, None, 'expected an object with "prompt", "messages" or "conversations"')
    rid = _record_id(obj.get("id"), where, index)
    shapes = [k for k in SHAPES if obj.get(k) is not None]
    if len(shapes) != 1:
        have = f'has {" and ".join(shapes)}' if shapes else "has none of them"
        raise BadRecord(where, None, f'needs exactly one of "prompt" (raw text), "messages" (OpenAI chat) or '
                        f'"conversations" (ShareGPT); it {have}')
    key, system = shapes[0], obj.get("system")
    if key == "prompt":
        if system is not None:
            raise BadRecord(where, "system", "a raw prompt is not templated, so it takes no system prompt; write the "
                            "record as messages")
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise BadRecord(where, "prompt", "must be a non-empty string")
        return {"id": rid, "prompt": obj["prompt"]}, Origin(where)
    origin = Origin(where, key)
    turns = obj[key]
    if not isinstance(turns, list):
        raise origin.bad(None, "must be a list of turns")
    messages = [_message(t, origin, i, key) for i, t in enumerate(turns)]
    if system is not None:
        if not isinstance(system, str):
            raise BadRecord(where, "system", "must be a string")
        if system and messages and messages[0]["role"] == "system":
            raise BadRecord(where, "system", f"{key} opens with a system turn too; keep one of the two")
        if system:
            messages.insert(0, {"role": "system", "content": system})
            origin = Origin(where, key, 1)
    if not any(m["role"] != "system" for m in messages):
        raise origin.bad(None, "an empty conversation: it has no user or assistant turn")
    return {"id": rid, "messages": messages}, origin


def _record_id(value: Any, where: str, index: int) -> str:
    if value is None:
        return str(index)  # the record's place in its source: stable while the source is
    if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
        raise BadRecord(where, "id", "must be a non-empty string or an integer (or left out: the record's number)")
    return str(value)


def _message(turn: Any, origin: Origin, i: int, key: str) -> dict:
    field = f"{key}[{i}]"
    if not isinstance(turn, dict):
        raise BadRecord(origin.where, field, "must be an object")
    if key == "conversations" and "from" in turn:
        role = SHAREGPT_ROLES.get(turn["from"]) if isinstance(turn["from"], str) else None
        if role is None:
            raise BadRecord(origin.where, f"{field}.from", f"{turn['from']!r} is not a ShareGPT role; use human, gpt "
                            "or system")
        if not isinstance(turn.get("value"), str):
            raise BadRecord(origin.where, f"{field}.value", "must be a string")
        return {"role": role, "content": turn["value"]}
    role = turn.get("role")
    if role is None and key == "conversations":
        raise BadRecord(origin.where, field, 'must be a ShareGPT turn ("from", "value") or an OpenAI message '
                        '("role", "content")')
    if role not in ROLES:
        raise BadRecord(origin.where, f"{field}.role", f"{role!r} is not a role; use system, user, assistant or "
                        "tool")
    message = {"role": role, "content": _content(turn, origin.where, field, role)}
    reasoning = turn.get("reasoning_content", turn.get("reasoning"))
    if reasoning is not None:
        if role != "assistant" or not isinstance(reasoning, str):
            raise BadRecord(origin.where, f"{field}.reasoning_content", "must be a string, on an assistant turn")
        message["reasoning_content"] = reasoning
    for extra in EXTRA_MESSAGE_KEYS:
        if turn.get(extra) is not None:
            message[extra] = _without_nulls(turn[extra])
    return message


def _content(turn: dict, where: str, field: str, role: str) -> str | list[dict] | None:
    content = turn.get("content")
    if isinstance(content, str):
        return content
    if content is None:
        if role == "assistant" and turn.get("tool_calls"):
            return None
        raise BadRecord(where, f"{field}.content", "is missing; give a string or a list of content parts")
    if not isinstance(content, list):
        raise BadRecord(where, f"{field}.content", "must be a string or a list of content parts")
    parts = []
    for j, part in enumerate(content):
        part = _without_nulls(part) if isinstance(part, dict) else part  # a table's columns fill absent keys with null
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise BadRecord(where, f"{field}.content[{j}]", 'must be an object with a "type", e.g. {"type": "text", '
                            '"text": "..."}')
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            raise BadRecord(where, f"{field}.content[{j}].text", "must be a string")
        parts.append(part)
    return parts


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def check_record(record: dict, origin: Origin, field: str, turns: str, responses: str) -> None:
    """What the stage needs of a record beyond its shape: an end to answer, or answers to train on."""
    messages = record.get("messages")
    if responses == "dataset":
        if messages is None:
            raise origin.bad(None, "a raw prompt has no answer, and traces.responses is dataset (train on the "
                             "dataset's answers); give conversations with assistant turns")
        if not any(m["role"] == "assistant" for m in messages):
            raise origin.bad(None, "has no assistant turn, and traces.responses is dataset (train on the dataset's "
                             "answers)")
        return
    if messages is not None and turns == "last" and messages[-1]["role"] == "assistant":
        also = ", or set traces.turns: all to answer every assistant turn again" if field.startswith("traces") else ""
        raise origin.bad(len(messages) - 1, f"the conversation ends on an assistant turn, but the target answers "
                         f"its last turn: end it on a user turn{also}")


def text_of(content: str | list[dict] | None) -> str:
    """A message's text: its string, or its text parts joined by newlines (as vLLM does for a template that reads
    strings only)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(p["text"] for p in content if p.get("type") == "text")


def non_text_part(messages: list[dict]) -> tuple[int, int, str] | None:
    """(message index, part index, type) of the first content part that is not text, if any."""
    for i, m in enumerate(messages):
        if isinstance(m.get("content"), list):
            for j, part in enumerate(m["content"]):
                if part.get("type") != "text":
                    return i, j, part["type"]
    return None
