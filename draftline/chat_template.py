"""How a conversation becomes the target's prompt text: the chat template (the tokenizer's own or a file) and its
kwargs, rendered alike for trace generation and the reference decoder, and handed to the engines' chat requests."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from draftline.conversations import text_of
from draftline.errors import ConfigError

# Arguments the renderer sets itself: a kwarg of the same name would fight it (vLLM refuses some of them outright).
RESERVED_KWARGS = ("messages", "add_generation_prompt", "continue_final_message", "tokenize", "chat_template",
                   "return_dict", "return_tensors", "tools", "documents")
_PROBE = [{"role": "user", "content": "Hello"}]
_PARTS_PROBE = [{"role": "user", "content": [{"type": "text", "text": "draftline-part-one"},
                                             {"type": "text", "text": "draftline-part-two"}]}]
_READS_PARTS: dict[str, bool] = {}


@dataclass(frozen=True)
class ChatTemplate:
    """The chat template (path None: the target tokenizer's own) and the kwargs it is rendered with, such as
    {"enable_thinking": false}: traces.chat_template and traces.chat_template_kwargs."""

    path: str | None = None
    kwargs: dict = field(default_factory=dict)

    @classmethod
    def of(cls, traces_cfg) -> "ChatTemplate":
        return cls(traces_cfg.chat_template, dict(traces_cfg.chat_template_kwargs))

    def text(self, tokenizer) -> str:
        """The template's Jinja source."""
        if self.path:
            path = Path(self.path)
            if not path.is_file():
                raise ConfigError(f"traces.chat_template {path}: no such file; point it at a Jinja chat template")
            return path.read_text(encoding="utf-8")
        text = getattr(tokenizer, "chat_template", None)
        if isinstance(text, dict):  # a tokenizer with named templates
            text = text.get("default")
        if not text:
            raise ConfigError("the target's tokenizer has no chat template; add one to its tokenizer_config.json, "
                              "name a template file in traces.chat_template, or set use_chat_template: false")
        return text

    def source(self) -> str:
        return f"traces.chat_template {self.path}" if self.path else "the target tokenizer's chat template"

    def render(self, tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text, as an engine's chat endpoint would build it: a template that reads strings only gets
        each list of content parts as its text parts joined by newlines."""
        template = self.text(tokenizer)
        if not self._reads_parts(tokenizer, template):
            messages = [{**m, "content": text_of(m["content"])} if isinstance(m.get("content"), list) else m
                        for m in messages]
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **self.kwargs)

    def _reads_parts(self, tokenizer, template: str) -> bool:
        key = hashlib.sha256((template + repr(sorted(self.kwargs.items()))).encode()).hexdigest()
        if key not in _READS_PARTS:
            try:
                out = tokenizer.apply_chat_template(_PARTS_PROBE, chat_template=template, tokenize=False,
                                                    add_generation_prompt=True, **self.kwargs)
                _READS_PARTS[key] = ("draftline-part-one" in out and "draftline-part-two" in out
                                     and "'type'" not in out)
            except Exception:  # a template that adds strings to the content fails on a list
                _READS_PARTS[key] = False
        return _READS_PARTS[key]

    def check(self, tokenizer) -> None:
        """The template renders a user turn, and writes something for the generation prompt: without it the target
        would go on with the user's turn instead of answering it."""
        try:
            answered = self.render(tokenizer, _PROBE, add_generation_prompt=True)
            unanswered = self.render(tokenizer, _PROBE, add_generation_prompt=False)
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(f"{self.source()} cannot render a user turn ({type(exc).__name__}: {exc}); fix the "
                              "template") from None
        if answered == unanswered:
            raise ConfigError(f"{self.source()} drops the generation prompt (add_generation_prompt adds nothing), so "
                              "the target would continue the user's turn instead of answering it; use a template "
                              "that opens the assistant's turn there")

    def describe(self, tokenizer=None, target_dir: str | Path | None = None) -> dict:
        """Which template and kwargs rendered the prompts, for stats and reports; the template's sha256 where its
        text can be read (a file, the tokenizer, or the tokenizer files in `target_dir`)."""
        said: dict = {"template": self.path or "the target tokenizer's own", "kwargs": dict(self.kwargs)}
        try:
            text = self.text(tokenizer) if self.path or tokenizer is not None else _saved_template(target_dir)
        except ConfigError:
            text = None
        if text:
            said["sha256"] = hashlib.sha256(text.encode()).hexdigest()
        return said

    def request_fields(self) -> dict:
        """What an OpenAI chat request carries besides the messages (vLLM and SGLang read chat_template_kwargs)."""
        return {"chat_template_kwargs": dict(self.kwargs)} if self.kwargs else {}

    def server_args(self) -> list[str]:
        """The engine server's flags for this template (both vLLM and SGLang take --chat-template FILE)."""
        return ["--chat-template", str(Path(self.path).resolve())] if self.path else []


def _saved_template(target_dir: str | Path | None) -> str | None:
    """The chat template a tokenizer folder holds (chat_template.jinja, or tokenizer_config.json's chat_template),
    read without loading the tokenizer."""
    if target_dir is None:
        return None
    root = Path(target_dir)
    if (root / "chat_template.jinja").is_file():
        return (root / "chat_template.jinja").read_text(encoding="utf-8")
    try:
        template = json.loads((root / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError):
        return None
    return template if isinstance(template, str) else None


def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of rendered text: the template already wrote the special tokens (BOS) where the model wants them."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
