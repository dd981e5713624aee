"""Chat template rendering and the assistant-only loss mask.

A template that marks its assistant output with `{% generation %}` gets the tokenizer's own
assistant mask. Otherwise the mask comes from character spans of the rendered assistant
turns: the text each assistant message adds to the rendered prefix (so the turn's
end-of-turn tokens are learned too), mapped to tokens through the fast tokenizer's offsets.
There, a regenerated reply carrying `token_ids` (the ids the target generated) keeps those
ids instead of a re-tokenization of its text, which can differ (SmolLM2 emits one "\n\n"
token before "1." where re-tokenizing gives "\n", "\n"): the drafter learns the tokens the
target really emits.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from eagletrain.data.conversations import Message


@dataclass(frozen=True)
class TokenizedSample:
    input_ids: torch.Tensor  # int32 [T]
    loss_mask: torch.Tensor  # uint8 [T], 1 on assistant tokens


def _for_template(messages: list[Message]) -> list[Message]:
    """The messages without the generated ids, which are ours, not the template's."""
    return [{k: v for k, v in m.items() if k != "token_ids"} for m in messages]


def _render(tokenizer: Any, messages: list[Message], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        _for_template(messages), tokenize=False, add_generation_prompt=generation_prompt
    )


def assistant_spans(tokenizer: Any, messages: list[Message]) -> tuple[str, list[tuple[int, int]]]:
    """The full rendered text and the [start, end) character span of each assistant turn."""
    if messages[0]["role"] == "text":
        return messages[0]["content"], [(0, len(messages[0]["content"]))]
    full = _render(tokenizer, messages, False)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], True)
        upto = _render(tokenizer, messages[: i + 1], False)
        if upto.startswith(before) and full.startswith(upto):
            spans.append((len(before), len(upto)))
            cursor = len(upto)
        else:
            # Templates that render a turn differently once later turns follow (e.g. Kimi
            # and Qwen3 empty the <think> of earlier turns): locate the message text, then
            # widen to the turn's opening and closing text where they are unambiguous.
            content = message["content"]
            start = full.find(content, cursor)
            if start < 0:
                raise ValueError(f"assistant turn {i} not found in the rendered template")
            end = start + len(content)
            at = upto.rfind(content) if content else -1
            closing = upto[at + len(content) :] if at >= 0 else ""
            if closing and full.startswith(closing, end):
                end += len(closing)
            if full.startswith(before) and cursor <= len(before) <= start:
                start = len(before)
            spans.append((start, end))
            cursor = end
    return full, spans


_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


def has_generation_tags(tokenizer: Any) -> bool:
    return bool(_GENERATION_TAG.search(tokenizer.chat_template or ""))


def _template_masked(tokenizer: Any, messages: list[Message]) -> TokenizedSample:
    enc = tokenizer.apply_chat_template(
        _for_template(messages), tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids = torch.tensor(enc["input_ids"], dtype=torch.int32)
    mask = torch.tensor(enc["assistant_masks"], dtype=torch.uint8)
    return TokenizedSample(ids, mask)


def tokenize_conversation(tokenizer: Any, messages: list[Message]) -> TokenizedSample:
    if messages[0]["role"] != "text" and has_generation_tags(tokenizer):
        return _template_masked(tokenizer, messages)
    return _offset_masked(tokenizer, messages)


def _generated_pieces(
    tokenizer: Any, messages: list[Message], text: str, spans: list[tuple[int, int]]
) -> list[tuple[int, int, list[int]]]:
    """(start, end, ids): the character range of each assistant reply that carries the ids
    the target generated for it, when those ids decode to exactly that reply (special
    tokens included: a stop token among them would repeat the template's own)."""
    pieces = []
    turns = [m for m in messages if m["role"] == "assistant"]
    for message, (start, end) in zip(turns, spans, strict=True):
        ids, content = message.get("token_ids"), message["content"]
        if not ids or tokenizer.decode(ids, skip_special_tokens=False) != content:
            continue
        at = text.find(content, start, end)
        if at >= 0:
            pieces.append((at, at + len(content), list(ids)))
    return pieces


def _offset_masked(tokenizer: Any, messages: list[Message]) -> TokenizedSample:
    """The rendered text tokenized piece by piece: a regenerated reply that carries the
    target's own ids keeps them (what the target emits when served), the rest is
    tokenized as the template renders it; the mask comes from the assistant spans."""
    text, spans = assistant_spans(tokenizer, messages)
    pieces = _generated_pieces(tokenizer, messages, text, spans)
    ids: list[int] = []
    mask: list[int] = []
    cursor = 0
    for start, end, generated in [*pieces, (len(text), len(text), [])]:
        enc = tokenizer(text[cursor:start], add_special_tokens=False, return_offsets_mapping=True)
        ids += enc["input_ids"]
        mask += [_in_spans(cursor + s, cursor + e, spans) for s, e in enc["offset_mapping"]]
        ids += generated
        mask += [1] * len(generated)
        cursor = end
    return TokenizedSample(
        torch.tensor(ids, dtype=torch.int32), torch.tensor(mask, dtype=torch.uint8)
    )


def _in_spans(start: int, end: int, spans: list[tuple[int, int]]) -> int:
    return int(any(start < e and end > s for s, e in spans))
