"""conversations.py: one reader for prompts and conversations, from JSON lines, JSON, parquet, saved datasets and S3."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftline.conversations import BadRecord, read_prompt_set, source_sha256
from draftline.errors import ConfigError

# Saved with datasets' save_to_disk, one split per group of records below and "raw" (tests/fixtures/datasets/README.md).
CHATS = Path(__file__).parent / "fixtures" / "datasets" / "chats"

SHAREGPT = [
    {"id": "c1", "conversations": [{"from": "system", "value": "Be terse."}, {"from": "human", "value": "Hi"},
                                   {"from": "gpt", "value": "Hello."}, {"from": "human", "value": "Bye"}]},
    {"id": "c2", "system": "Answer in code.", "conversations": [{"from": "human", "value": "def f(x):"}]},
]
OPENAI = [
    {"id": 7, "messages": [{"role": "user", "content": [{"type": "text", "text": "Look"},
                                                        {"type": "text", "text": "closely"}]}]},
    {"id": "m2", "messages": [{"role": "user", "content": "Why?"},
                              {"role": "assistant", "content": "Because.", "reasoning_content": "It is so."},
                              {"role": "user", "content": "Sure?"}]},
]
EXPECTED = {
    "c1": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
           {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}],
    "c2": [{"role": "system", "content": "Answer in code."}, {"role": "user", "content": "def f(x):"}],
    "7": [{"role": "user", "content": [{"type": "text", "text": "Look"}, {"type": "text", "text": "closely"}]}],
    "m2": [{"role": "user", "content": "Why?"},
           {"role": "assistant", "content": "Because.", "reasoning_content": "It is so."},
           {"role": "user", "content": "Sure?"}],
}


def _write(tmp_path, kind: str, rows: list[dict], name: str = "data"):
    if kind == "jsonl":
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "json":
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(rows, indent=2))
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / f"{name}.parquet"
        columns = dict.fromkeys(k for r in rows for k in r)  # from_pylist would take the first row's keys alone
        pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in columns} for r in rows]), path)
    else:
        path = CHATS / name
    return path


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "dataset"])
def test_every_format_and_shape_reads_to_the_same_normal_form(tmp_path, kind):
    """ShareGPT (roles mapped, a top-level system prompt put first) and OpenAI messages (content parts, reasoning)
    in each format; a table's columns fill absent keys with nulls, which the reader drops again."""
    read = {}
    # A table's column holds one type: the two OpenAI records (an integer id, content parts) go in files of their own.
    for name, rows in (("sharegpt", SHAREGPT), ("parts", OPENAI[:1]), ("reasoning", OPENAI[1:])):
        prompts = read_prompt_set(_write(tmp_path, kind, rows, name))
        read.update({p["id"]: p["messages"] for p in prompts})
    assert read == EXPECTED
    raw = read_prompt_set(_write(tmp_path, kind, [{"id": "r1", "prompt": "def g():"}, {"prompt": "x = 1"}], "raw"))
    assert list(raw) == [{"id": "r1", "prompt": "def g():"}, {"id": "1", "prompt": "x = 1"}]  # no id: its number
    where = "line 2" if kind == "jsonl" else "record 1"
    assert raw.origin("1").where.endswith(where)


@pytest.mark.parametrize("line, field, problem", [
    ('{"id": "a", "prompt": "x"', None, "not valid JSON"),
    ('{"id": "", "prompt": "x"}', "id", "must be a non-empty string or an integer"),
    ('{"id": "a", "prompt": "x", "messages": [{"role": "user", "content": "x"}]}', None,
     'it has prompt and messages'),
    ('{"id": "a", "text": "x"}', None, 'needs exactly one of "prompt"'),
    ('{"id": "a", "messages": []}', "messages", "an empty conversation"),
    ('{"id": "a", "conversations": [{"from": "system", "value": "s"}]}', "conversations", "an empty conversation"),
    ('{"id": "a", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}]}',
     "messages[1]", "ends on an assistant turn"),
    ('{"id": "a", "messages": [{"role": "robot", "content": "x"}]}', "messages[0].role", "'robot' is not a role"),
    ('{"id": "a", "conversations": [{"from": "bot", "value": "x"}]}', "conversations[0].from",
     "'bot' is not a ShareGPT role; use human, gpt or system"),
    ('{"id": "a", "system": "s", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "x"}]}',
     "conversations[1]", "ends on an assistant turn"),
    ('{"id": "a", "messages": [{"role": "user"}]}', "messages[0].content", "is missing"),
    ('{"id": "a", "messages": [{"role": "user", "content": [{"text": "x"}]}]}', "messages[0].content[0]",
     'must be an object with a "type"'),
    ('{"id": "ok", "prompt": "again"}', "id", "'ok' is also the id of"),
])
def test_a_bad_record_is_named_by_file_line_and_field(tmp_path, line, field, problem):
    p = tmp_path / "prompts.jsonl"
    p.write_text('{"id": "ok", "prompt": "fine"}\n\n' + line + "\n")
    with pytest.raises(BadRecord) as err:
        read_prompt_set(p)
    assert err.value.where == f"{p}, line 3" and err.value.field == field and problem in err.value.problem
    assert str(err.value).startswith(f"{p}, line 3") and "\n" not in str(err.value)


def test_skip_leaves_bad_records_out_and_lists_them(tmp_path):
    p = tmp_path / "prompts.jsonl"
    p.write_text('{"id": "a", "prompt": "x"}\nnot json\n{"id": "b", "messages": []}\n{"id": "c", "prompt": "y"}\n')
    prompts = read_prompt_set(p, on_bad_record="skip")
    assert [r["id"] for r in prompts] == ["a", "c"] and prompts.read == 4
    assert [(s.where, s.field) for s in prompts.skipped] == [(f"{p}, line 2", None), (f"{p}, line 3", "messages")]
    with pytest.raises(ConfigError, match="every one of its 1 records is bad"):
        read_prompt_set(_write(tmp_path, "jsonl", [{"id": "x", "messages": []}], "bad"), on_bad_record="skip")


def test_turns_and_responses_decide_what_a_conversation_must_hold(tmp_path):
    p = _write(tmp_path, "jsonl", [{"id": "a", "conversations": [{"from": "human", "value": "q"},
                                                                   {"from": "gpt", "value": "x"}]},
                                   {"id": "b", "prompt": "raw"}])
    with pytest.raises(BadRecord, match="set traces.turns: all"):
        read_prompt_set(p)
    assert len(read_prompt_set(p, turns="all")) == 2
    with pytest.raises(BadRecord, match="a raw prompt has no answer") as err:
        read_prompt_set(p, turns="all", responses="dataset")
    assert err.value.where == f"{p}, line 2" and err.value.field == "prompt"
    with pytest.raises(BadRecord, match="eval.prompts|end it on a user turn$"):
        read_prompt_set(p, field="eval.prompts")


def test_files_folders_and_extensions_that_are_not_data_are_named(tmp_path):
    with pytest.raises(ConfigError, match="no such file or folder; set eval.prompts to a .jsonl"):
        read_prompt_set(tmp_path / "nope.jsonl", field="eval.prompts")
    (tmp_path / "prompts.txt").write_text('{"id": "a", "prompt": "x"}\n')
    with pytest.raises(ConfigError, match=r"\.txt extension, which says nothing of its format"):
        read_prompt_set(tmp_path / "prompts.txt")
    (tmp_path / "lines.json").write_text('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"}\n')
    with pytest.raises(ConfigError, match="name it .jsonl"):
        read_prompt_set(tmp_path / "lines.json")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ConfigError, match="holds no records"):
        read_prompt_set(tmp_path / "empty.jsonl")
    with pytest.raises(ConfigError, match=r"several splits \(sharegpt, parts, reasoning, raw\); name one of them, "
                       r"e\.g\. .*/chats/sharegpt"):
        read_prompt_set(CHATS)
    (tmp_path / "folder").mkdir()
    with pytest.raises(ConfigError, match="not one a dataset was saved to"):
        read_prompt_set(tmp_path / "folder")
    assert len(source_sha256(CHATS / "raw")) == 64


def test_limit_stops_after_that_many_good_records(tmp_path):
    p = _write(tmp_path, "jsonl", [{"prompt": f"p{i}"} for i in range(5)] + [{"bad": 1}])
    assert [r["id"] for r in read_prompt_set(p, limit=3)] == ["0", "1", "2"]


@pytest.mark.s3
def test_a_file_and_a_dataset_on_s3_read_like_local_ones(tmp_path, s3_uri):
    from draftline.store import open_store

    store = open_store(s3_uri)
    local = _write(tmp_path, "jsonl", SHAREGPT)
    store.put_file("data/sharegpt.jsonl", local)
    for f in (CHATS / "reasoning").iterdir():
        store.put_file(f"data/openai/{f.name}", f)
    remote = read_prompt_set(f"{s3_uri}/data/sharegpt.jsonl")
    assert {p["id"]: p["messages"] for p in remote} == {k: EXPECTED[k] for k in ("c1", "c2")}
    assert remote.origin("c2").where == f"{s3_uri}/data/sharegpt.jsonl, line 2"
    assert [p["messages"] for p in read_prompt_set(f"{s3_uri}/data/openai")] == [EXPECTED["m2"]]
    assert source_sha256(f"{s3_uri}/data/sharegpt.jsonl") == source_sha256(local)
    with pytest.raises(ConfigError, match="missing.jsonl: no object there nor under it; set traces.prompts to"):
        read_prompt_set(f"{s3_uri}/data/missing.jsonl")
