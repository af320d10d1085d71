"""The demo's multi-turn conversations in ShareGPT form: training prompts asked three to a conversation, each answered
with its function's own body from the held-out standard library, some with a system prompt.

`python -m draftline.demo.sharegpt` writes assets/prompts/train_sharegpt.json from train_prompts.jsonl; the bodies
come from the running interpreter's standard library (the one the demo was built from, assets/README.md).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[2] / "assets"
QUESTIONS_PER_CONVERSATION = 3
CONVERSATIONS = 64
SYSTEM = "You complete Python functions from their signature and docstring."


def held_out_bodies() -> dict[str, str]:
    """{prompt id: the function's body} for the held-out functions the prompt sets were made from."""
    from draftline.demo import corpus
    from draftline.demo.prompts import candidate_functions, prompt_id

    _, held = corpus.split_modules(corpus.stdlib_modules())
    return {prompt_id(f): f.body for f in candidate_functions(held)}


def conversations(prompts: list[dict], bodies: dict[str, str], n: int = CONVERSATIONS,
                  per_conversation: int = QUESTIONS_PER_CONVERSATION) -> list[dict]:
    """ShareGPT records: `per_conversation` consecutive chat prompts each, the dataset's answers their bodies; every
    fourth conversation (from the second) opens with a system prompt, and every fourth (from the fourth) ends on its
    last question, which the target answers without a dataset answer."""
    out = []
    for c in range(n):
        group = prompts[c * per_conversation:(c + 1) * per_conversation]
        if len(group) < per_conversation:
            break
        turns = []
        for j, prompt in enumerate(group):
            if prompt["id"] not in bodies:
                raise SystemExit(f"{prompt['id']} is not a held-out function of this interpreter's standard library; "
                                 "build with the Python the demo was built with (assets/README.md)")
            turns.append({"from": "human", "value": prompt["messages"][-1]["content"]})
            if not (j == per_conversation - 1 and c % 4 == 3):
                turns.append({"from": "gpt", "value": bodies[prompt["id"]]})
        record = {"id": f"conversation-{c:03d}", "conversations": turns}
        if c % 4 == 1:
            record = {"id": record["id"], "system": SYSTEM, "conversations": turns}
        out.append(record)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=Path, default=ASSETS / "prompts" / "train_prompts.jsonl")
    parser.add_argument("--out", type=Path, default=ASSETS / "prompts" / "train_sharegpt.json")
    args = parser.parse_args(argv)
    prompts = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    records = conversations(prompts, held_out_bodies())
    # One conversation per line: a JSON list that diffs line by line.
    args.out.write_text("[\n" + ",\n".join(json.dumps(r, ensure_ascii=False) for r in records) + "\n]\n")
    print(f"{args.out}: {len(records)} conversations")


if __name__ == "__main__":
    main()
