"""Training examples from records: chat, prompt/completion and plain text, each encoded into
token ids and a loss mask (1 where a token is a target: what the model learns to answer).

- chat: ``{"messages": [{"role": ..., "content": ...}, ...]}``, rendered through the model
  directory's own chat template (transformers, offline); only the assistant turns count. A
  turn's span is found by rendering the conversation up to it: the text before it (with the
  generation prompt) and the text through it, so the template decides what an answer is
  (its end-of-turn token included). A template that renders a turn differently once later
  turns follow (one that drops earlier reasoning) cannot be split so and is refused.
- prompt/completion: ``{"prompt": ..., "completion": ...}``: the completion and the end token
  count, the prompt does not.
- text: ``{TEXT_FIELD: ...}`` or a text file: every token counts, the end token appended.

The mask is by characters: a token counts when its characters overlap an answer's.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..core.errors import TierflowError

ROLES = ("system", "developer", "user", "assistant", "tool")
CHAT, COMPLETION, TEXT = "chat", "prompt/completion", "text"


@dataclass
class Example:
    """One record's content: its ``kind`` and ``where`` it came from (for errors)."""
    kind: str
    where: str
    text: str = ""  # TEXT: the text; COMPLETION: the prompt
    completion: str = ""
    messages: list[dict[str, str]] | None = None

    def plain_text(self) -> str:
        """Its text as one string (what a tokenizer trained on the corpus sees)."""
        if self.messages is not None:
            return "\n".join(m["content"] for m in self.messages)
        return self.text + self.completion


def example_of(record: Any, where: str, text_field: str) -> Example | None:
    """The example a record holds (None for an empty text); a malformed record is one line."""
    if not isinstance(record, dict):
        raise TierflowError(f"{where} is a {type(record).__name__}, not a record (an object "
                            f"with fields); fix: one object per record")
    if record.get("messages") is not None:
        return Example(CHAT, where, messages=_messages(record["messages"], where))
    if record.get("prompt") is not None and record.get("completion") is not None:
        prompt, completion = (_string(record, k, where) for k in ("prompt", "completion"))
        return Example(COMPLETION, where, text=prompt, completion=completion)
    if text_field not in record:
        raise TierflowError(f"{where} has no field {text_field!r} (found: "
                            f"{', '.join(sorted(record))}), nor 'messages' or 'prompt' + "
                            f"'completion'; fix: name the text field with --text-field")
    text = _string(record, text_field, where)
    return Example(TEXT, where, text=text) if text.strip() else None


def check_columns(path: Path, names: list[str], text_field: str) -> None:
    """A Parquet or CSV file must have the columns of one kind of record."""
    have = set(names)
    if "messages" in have or {"prompt", "completion"} <= have or text_field in have:
        return
    kind = "Parquet" if path.suffix.lower() == ".parquet" else "CSV"
    raise TierflowError(f"{kind} file {path} has no column {text_field!r} (columns: "
                        f"{', '.join(names) or 'none'}); fix: name the text column with "
                        f"--text-field, or give 'messages' or 'prompt' and 'completion' columns")


def _string(record: dict, key: str, where: str) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise TierflowError(f"{where}: field {key!r} is a {type(value).__name__}, not a string; "
                            f"fix: give text there (or name the text field with --text-field)")
    return value


def _messages(messages: Any, where: str) -> list[dict[str, str]]:
    """The turns of a chat record, checked: known roles, string contents, an assistant turn."""
    if not isinstance(messages, list) or not messages:
        raise TierflowError(f"{where}: 'messages' is {_what(messages)}, not a non-empty list of "
                            f"turns; fix: a list of {{'role': ..., 'content': ...}} objects")
    turns = []
    for number, turn in enumerate(messages, 1):
        if not isinstance(turn, dict) or not isinstance(turn.get("content"), str):
            raise TierflowError(f"{where}: turn {number} is not {{'role': ..., 'content': "
                                f"TEXT}}; fix: give each turn a role and a string content")
        if turn.get("role") not in ROLES:
            raise TierflowError(f"{where}: turn {number} has the unknown role "
                                f"{turn.get('role')!r} (known: {', '.join(ROLES)}); fix: use "
                                f"one of those roles")
        turns.append({"role": turn["role"], "content": turn["content"]})
    if not any(t["role"] == "assistant" for t in turns):
        raise TierflowError(f"{where}: the conversation has no assistant turn, so nothing in it "
                            f"would be learned; fix: add the assistant's answer or drop the "
                            f"record")
    return turns


def _what(value: Any) -> str:
    return "empty" if value in ([], "", None) else f"a {type(value).__name__}"


class ChatTemplate:
    """The chat template of a model directory's tokenizer, through transformers (offline)."""

    def __init__(self, source: str | os.PathLike[str]):
        from transformers import AutoTokenizer

        directory = Path(source) if Path(source).is_dir() else Path(source).parent
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        except Exception as err:  # noqa: BLE001 - transformers raises many kinds here
            reason = " ".join(str(err).split())[:160]
            raise TierflowError(f"--tokenizer {directory} cannot be loaded by transformers "
                                f"({reason}); fix: give a model directory saved by "
                                f"save_pretrained") from None
        if not getattr(self.tokenizer, "chat_template", None):
            raise TierflowError(f"--tokenizer {directory} has no chat template, so chat records "
                                f"cannot be rendered; fix: use the instruct model's directory "
                                f"(its tokenizer_config.json or chat_template.jinja has one)")
        self.source = directory

    def end_ids(self) -> set[int]:
        """The ids that end an answer: the tokenizer's eos token (a chat template's end of
        turn, e.g. ``<|im_end|>``) and the generation config's eos ids beside it."""
        ids = {self.tokenizer.eos_token_id} - {None}
        generation = self.source / "generation_config.json"
        if generation.is_file():
            import json
            try:
                eos = json.loads(generation.read_text(encoding="utf-8")).get("eos_token_id")
            except (OSError, ValueError, AttributeError):
                eos = None
            ids |= {eos} if isinstance(eos, int) else set(eos) if isinstance(eos, list) else set()
        return {int(i) for i in ids}

    def render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def answer_spans(self, example: Example) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans of its assistant turns."""
        messages = example.messages or []
        full = self.render(messages, False)
        spans = []
        for i, turn in enumerate(messages):
            if turn["role"] != "assistant":
                continue
            before, through = self.render(messages[:i], True), self.render(messages[:i + 1], False)
            if not (through.startswith(before) and full.startswith(through)):
                raise TierflowError(f"{example.where}: the chat template of {self.source} "
                                    f"renders turn {i + 1} differently once later turns follow, "
                                    f"so its answer cannot be located; fix: split the "
                                    f"conversation into one record per assistant turn")
            spans.append((len(before), len(through)))
        return full, spans


def encode_example(example: Example, tok: Any, eot_id: int,
                   template: ChatTemplate | None) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) of ``example``: (n,) int64 ids and (n,) uint8 targets. ``tok`` is a
    ``tokenizers`` Tokenizer (the template's, for chat records)."""
    if example.kind == CHAT:
        if template is None:
            raise TierflowError(f"{example.where} is a chat record, which needs a chat template; "
                                f"fix: tokenize with --tokenizer MODEL_DIR (the model's own "
                                f"directory)")
        text, spans = template.answer_spans(example)
        return _masked(tok, text, spans, None)
    if example.kind == COMPLETION:
        text = example.text + example.completion
        return _masked(tok, text, [(len(example.text), len(text))], eot_id)
    return _masked(tok, example.text, [(0, len(example.text))], eot_id)


def _masked(tok: Any, text: str, spans: list[tuple[int, int]],
            end_id: int | None) -> tuple[np.ndarray, np.ndarray]:
    """``text`` encoded (no special tokens added: a template writes its own), each token a
    target when its characters overlap a span; ``end_id`` appended as a target."""
    encoding = tok.encode(text, add_special_tokens=False)
    n = len(encoding.ids)
    ids = np.empty(n + (end_id is not None), dtype=np.int64)  # (tokens,)
    ids[:n] = encoding.ids
    offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(n, 2)  # (tokens, 2)
    mask = np.zeros(len(ids), dtype=np.uint8)
    for start, end in spans:
        mask[:n] |= ((offsets[:, 1] > start) & (offsets[:, 0] < end)).astype(np.uint8)
    if end_id is not None:
        ids[-1], mask[-1] = end_id, 1
    return ids, mask
