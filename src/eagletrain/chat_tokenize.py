"""Chat template rendering and the assistant-only loss mask.

The mask is derived from character spans of the rendered assistant turns: the text each
assistant message adds to the rendered prefix (so the turn's end-of-turn tokens are learned
too), mapped to tokens through the fast tokenizer's offsets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from eagletrain.conversations import Message


@dataclass(frozen=True)
class TokenizedSample:
    input_ids: torch.Tensor  # int32 [T]
    loss_mask: torch.Tensor  # uint8 [T], 1 on assistant tokens


def _render(tokenizer: Any, messages: list[Message], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
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
            # Templates that rewrite earlier turns (e.g. dropping old <think> blocks):
            # fall back to the message text itself.
            start = full.find(message["content"], cursor)
            if start < 0:
                raise ValueError(f"assistant turn {i} not found in the rendered template")
            spans.append((start, start + len(message["content"])))
            cursor = start + len(message["content"])
    return full, spans


def tokenize_conversation(tokenizer: Any, messages: list[Message]) -> TokenizedSample:
    text, spans = assistant_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = torch.tensor(enc["input_ids"], dtype=torch.int32)
    mask = torch.zeros(len(ids), dtype=torch.uint8)
    span_idx = 0
    for j, (s, e) in enumerate(enc["offset_mapping"]):
        while span_idx < len(spans) and spans[span_idx][1] <= s:
            span_idx += 1
        if span_idx < len(spans) and s < spans[span_idx][1] and e > spans[span_idx][0]:
            mask[j] = 1
    return TokenizedSample(ids, mask)
