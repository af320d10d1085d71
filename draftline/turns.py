"""A conversation's turns as the target's prompts and as traces: where its answers go, the prompt of each, and the
token sequence whose loss mask covers every answer and nothing else.

Each answer's prompt is the conversation so far rendered with the generation prompt, the earlier answers in it as
the target gave them (or as the dataset has them, with traces.responses: dataset). When every prompt begins with
the one before it and that one's answer, as the template writes them, the answers share one sequence: the first
prompt, then each answer and the template's text up to the next answer. A template that rewrites earlier turns
(one that drops past reasoning, say) gives one trace per answer instead, each with its own prompt.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from draftline.chat_template import ChatTemplate, encode_text
from draftline.conversations import BadRecord, Origin, text_of
from draftline.errors import ConfigError
from draftline.images import IMAGE_TYPES

# Why a record's image cannot be used when nothing says the target takes images.
TEXT_ONLY = ("this target has no vision tower (no vision_config in its config.json); remove the image or use a "
             "multimodal target")

# Generates answers: (prompt token ids, seeds, token budgets) -> the answers' token ids, one list per prompt.
Answerer = Callable[[list[list[int]], list[int], list[int]], list[list[int]]]
# Answers chat prompts with images through the engine's chat API: (messages, seeds, token budgets) -> (the prompt's
# token ids as the engine expanded its media placeholders, the answer's token ids), one pair per prompt.
ChatAnswerer = Callable[[list[list[dict]], list[int], list[int]], list[tuple[list[int], list[int]]]]


@dataclass
class Answer:
    ids: list[int]  # the answer's tokens, its stop token included when it stopped
    text: str  # those tokens as text, special tokens kept: how the template writes it into the next prompt
    content: str | None = None  # the message that replaces the dataset's turn in later prompts; None: keep the dataset's


@dataclass
class Dialogue:
    """One record on its way to traces: the message indices its answers take (len(messages): after the last turn),
    each answered turn's prompt text and tokens, the answers, and why it gave nothing, if it did not."""

    record: dict
    origin: Origin
    slots: list[int]
    texts: list[str | None] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)
    answers: list[Answer] = field(default_factory=list)
    dropped: str | None = None
    problem: BadRecord | None = None
    media: bool = False  # it holds images: its turns go to the engine's chat API, which places the media tokens
    engine_messages: list[dict] | None = None  # its messages with each image as the engine takes it

    @property
    def pending(self) -> bool:
        return self.dropped is None and len(self.answers) < len(self.slots)

    def stop_at(self, k: int) -> None:
        """Turn k leaves no room for an answer: the answers before it are all there is."""
        self.slots = self.slots[:k]
        if k == 0:
            self.dropped = "prompt_too_long"


def answer_slots(record: dict, turns: str, responses: str) -> list[int]:
    """Where the answers go: regenerate answers each assistant turn (turns: all) and the end of a conversation that
    does not end on one; dataset trains on the assistant turns themselves (the last only with turns: last)."""
    messages = record.get("messages")
    if messages is None:
        return [0]
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if responses == "dataset":
        return assistant if turns == "all" else assistant[-1:]
    if turns == "last":
        return [len(messages)]
    return assistant + ([len(messages)] if messages[-1]["role"] != "assistant" else [])


def plan(record: dict, origin: Origin, turns: str, responses: str, use_chat_template: bool,
         image_refusal: str | None = TEXT_ONLY) -> Dialogue:
    """A Dialogue for the record; BadRecord if it holds what traces cannot use: content other than text and images,
    or an image where `image_refusal` says why images cannot be used (None: they go to the engine's chat API)."""
    messages = record.get("messages")
    media = False
    if messages is not None:
        for i, m in enumerate(messages):
            for j, part in enumerate(m["content"] if isinstance(m.get("content"), list) else []):
                kind = part.get("type")
                if kind == "text":
                    continue
                if kind in IMAGE_TYPES and image_refusal is None:
                    media = True
                    continue
                why = image_refusal if kind in IMAGE_TYPES else (
                    "trace generation and the reference decoder read text and images alone; keep text parts only")
                what = "an image" if kind in IMAGE_TYPES else f"a {kind}"
                raise BadRecord(origin.where, f"{origin.field(i)}.content[{j}]", f"{what} part, but {why}")
    d = Dialogue(record, origin, answer_slots(record, turns if use_chat_template else "last", responses))
    d.media = media
    return d


def history(d: Dialogue, k: int) -> list[dict]:
    """The conversation before answer k, the earlier regenerated answers in place of the dataset's."""
    messages = d.engine_messages or d.record["messages"]
    out = list(messages[:d.slots[k]])
    for j in range(k):
        if d.answers[j].content is not None and d.slots[j] < len(messages):
            out[d.slots[j]] = {"role": "assistant", "content": d.answers[j].content}
    return out


def turn_prompt(d: Dialogue, k: int, tokenizer, template: ChatTemplate, use_chat_template: bool
                ) -> tuple[str | None, list[int]]:
    """(rendered text or None when untemplated, token ids) of answer k's prompt; BadRecord if the template fails."""
    record = d.record
    if "prompt" in record:
        return None, list(tokenizer(record["prompt"], add_special_tokens=True)["input_ids"])
    if not use_chat_template:
        text = "\n\n".join(text_of(m["content"]) for m in record["messages"])
        return None, list(tokenizer(text, add_special_tokens=True)["input_ids"])
    try:
        text = template.render(tokenizer, history(d, k), add_generation_prompt=True)
    except ConfigError:
        raise
    except Exception as exc:
        raise d.origin.bad(None, f"the chat template refused it ({type(exc).__name__}: {exc})") from None
    return text, encode_text(tokenizer, text)


def stop_texts(tokenizer, stop_ids: list[int]) -> list[str]:
    return [t for t in tokenizer.convert_ids_to_tokens(stop_ids) if t]


def generated_answer(tokenizer, ids: list[int], stop_ids: list[int]) -> Answer:
    stopped = bool(ids) and ids[-1] in stop_ids
    decode = lambda x: tokenizer.decode(x, skip_special_tokens=False, clean_up_tokenization_spaces=False)  # noqa: E731
    return Answer(ids, decode(ids), decode(ids[:-1] if stopped else ids))


def regenerate(dialogues: list[Dialogue], tokenizer, template: ChatTemplate, use_chat_template: bool,
               stop_ids: list[int], limit: int, max_new_tokens: int, seed_of: Callable[[str, int], int],
               answer: Answerer, skip_bad: bool, chat: ChatAnswerer | None = None) -> None:
    """Answer every dialogue's turns in order, a round per turn (all first answers, then all second ones, ...):
    each round's prompts are encoded before `answer` is asked, so a bad record stops the work before any server.
    Dialogues with images are answered by `chat`, and their prompts are the token ids the engine made of them."""
    while True:
        batch = []
        for d in dialogues:
            if not d.pending:
                continue
            k = len(d.answers)
            try:
                text, ids = turn_prompt(d, k, tokenizer, template, use_chat_template)
            except BadRecord as bad:
                if not skip_bad:
                    raise
                d.dropped, d.problem = "bad_record", bad
                continue
            if len(ids) >= limit:
                d.stop_at(k)
                continue
            batch.append((d, text, ids))
        if not batch:
            return
        budgets = [min(max_new_tokens, limit - len(ids)) for _, _, ids in batch]
        seeds = [seed_of(d.record["id"], len(d.answers)) for d, _, _ in batch]
        text_rows = [n for n, (d, _, _) in enumerate(batch) if not d.media]
        media_rows = [n for n, (d, _, _) in enumerate(batch) if d.media]
        results: dict[int, tuple[list[int], list[int]]] = {}
        outs = answer([batch[n][2] for n in text_rows], [seeds[n] for n in text_rows], [budgets[n] for n in text_rows])
        results.update({n: (batch[n][2], out) for n, out in zip(text_rows, outs)})
        if media_rows:
            if chat is None:
                raise ConfigError("records with images need an engine's chat API to answer them; set traces.backend: "
                                  "vllm")
            pairs = chat([history(batch[n][0], len(batch[n][0].answers)) for n in media_rows],
                         [seeds[n] for n in media_rows], [budgets[n] for n in media_rows])
            results.update(zip(media_rows, pairs))
        for n, ((d, text, _), budget) in enumerate(zip(batch, budgets)):
            ids, out = results[n]
            d.texts.append(text)
            d.prompts.append(list(ids))
            room = max(0, min(budget, limit - len(ids)))  # an engine's media tokens can leave less than the budget
            d.answers.append(generated_answer(tokenizer, cut_at_stop(list(out), stop_ids)[:room], stop_ids))


def cut_at_stop(tokens: list[int], stop_ids: list[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[: i + 1]  # the stop token is part of the answer: the drafter must learn to predict it
    return tokens


def with_reasoning(message: dict, prompt: str, answer: str, markers: tuple[str, str]) -> str:
    """The answer as the target wrote it: a turn's separate reasoning_content (what a reasoning parser split off)
    before its content, between the markers it stripped, where the template did not write it; the opening marker
    only where the prompt does not end with it already (templates that open the block themselves)."""
    reasoning = message.get("reasoning_content")
    if not reasoning or not reasoning.strip() or reasoning.strip() in answer:
        return answer
    opened = prompt.rstrip().endswith(markers[0])
    return ("" if opened else markers[0]) + reasoning + markers[1] + answer


def dataset_answers(d: Dialogue, tokenizer, template: ChatTemplate, stop_ids: list[int], limit: int,
                    reasoning_markers: tuple[str, str] = ("<think>", "</think>")) -> None:
    """The dataset's own assistant turns as the answers: each turn's text as the template writes it after the
    generation prompt, up to and including the first stop token, its reasoning first (with_reasoning)."""
    messages, stops = d.record["messages"], stop_texts(tokenizer, stop_ids)
    for k, slot in enumerate(d.slots):
        try:
            prompt = template.render(tokenizer, messages[:slot], add_generation_prompt=True)
            whole = template.render(tokenizer, messages[:slot + 1], add_generation_prompt=False)
        except ConfigError:
            raise
        except Exception as exc:
            raise d.origin.bad(None, f"the chat template refused it ({type(exc).__name__}: {exc})") from None
        if not whole.startswith(prompt):
            raise d.origin.bad(slot, "the chat template writes this assistant turn without the generation prompt it "
                               "writes before an answer, so the answer's tokens cannot be told from the prompt's")
        rest = whole[len(prompt):]
        ends = [rest.index(s) + len(s) for s in stops if s in rest]
        text = with_reasoning(messages[slot], prompt, rest[:min(ends)] if ends else rest, reasoning_markers)
        ids = encode_text(tokenizer, prompt)
        if len(ids) >= limit:
            d.stop_at(k)
            return
        d.texts.append(prompt)
        d.prompts.append(ids)
        d.answers.append(Answer(encode_text(tokenizer, text)[:limit - len(ids)], text))


def assemble(d: Dialogue, tokenizer, limit: int) -> list[tuple[list[int], list[int], list[Answer]]]:
    """The dialogue's traces as (input_ids, loss_mask, the answers in it): one sequence over all answers when each
    prompt continues the one before and its answer, else one per answer; at most `limit` tokens each."""
    n = len(d.answers)
    if n == 0:
        return []
    # A prompt with images holds the engine's media tokens, which the rendered text does not: one trace per answer.
    chained = not d.media and all(d.texts[k + 1] is not None and d.texts[k] is not None
                  and d.texts[k + 1].startswith(d.texts[k] + d.answers[k].text) for k in range(n - 1))
    if not chained:
        return [(p + a.ids, [0] * len(p) + [1] * len(a.ids), [a]) for p, a in zip(d.prompts, d.answers)]
    ids, mask = list(d.prompts[0]), [0] * len(d.prompts[0])
    for k, a in enumerate(d.answers):
        if k:
            glue = encode_text(tokenizer, d.texts[k][len(d.texts[k - 1]) + len(d.answers[k - 1].text):])
            ids, mask = ids + glue, mask + [0] * len(glue)
        ids, mask = ids + a.ids, mask + [1] * len(a.ids)
    return [(ids[:limit], mask[:limit], list(d.answers))]
