"""The assistant-only loss mask covers exactly the assistant turns (and their end-of-turn),
for ChatML, a Llama-3-style template, a Kimi-style thinking template and a template with
`{% generation %}` tags (the tokenizer's own mask)."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagletrain.data.chat_tokenize import _offset_masked, has_generation_tags, tokenize_conversation
from eagletrain.target import TargetSource, load_tokenizer, template_hash

TEMPLATES = Path(__file__).parent / "templates"
MESSAGES = [
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "two plus two is 4."},
    {"role": "user", "content": "And three?"},
    {"role": "assistant", "content": "three plus two is 5.", "reasoning_content": "add one"},
]


def tokenizer_with(tiny_target: Path, template: str | None, specials: list[str]):
    tokenizer = load_tokenizer(TargetSource(tiny_target, "tiny"))
    if template is not None:
        tokenizer.chat_template = (TEMPLATES / template).read_text()
    tokenizer.add_tokens(specials, special_tokens=True)  # as the real tokenizers have them
    return tokenizer


def masked_and_unmasked(tokenizer, messages) -> tuple[str, str]:
    sample = tokenize_conversation(tokenizer, messages)
    ids, mask = sample.input_ids.tolist(), sample.loss_mask.bool().tolist()
    # the token ids are exactly the rendered template's
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(messages, tokenize=False)
    masked = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
    unmasked = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if not m])
    return masked, unmasked


@pytest.mark.parametrize(
    ("template", "specials", "expected"),
    [
        (None, [], "two plus two is 4.<|im_end|>\nthree plus two is 5.<|im_end|>\n"),
        (
            "llama3.jinja",
            ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
            "two plus two is 4.<|eot_id|>three plus two is 5.<|eot_id|>",
        ),
        (
            "kimi_thinking.jinja",
            ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>"],
            # the earlier turn renders an empty think block; the last keeps its reasoning
            "<think></think>two plus two is 4.<|im_end|>"
            "<think>add one</think>three plus two is 5.<|im_end|>",
        ),
        (
            "chatml_generation.jinja",
            [],
            "two plus two is 4.<|im_end|>\nthree plus two is 5.<|im_end|>\n",
        ),
    ],
)
def test_mask_covers_assistant_turns_and_their_end_tokens(
    tiny_target, template, specials, expected
):
    tokenizer = tokenizer_with(tiny_target, template, specials)
    masked, unmasked = masked_and_unmasked(tokenizer, MESSAGES)
    assert masked == expected
    assert "What is two plus two?" in unmasked and "And three?" in unmasked
    assert "assistant" in unmasked  # the assistant header is prompt, not target output


def test_tokenizer_own_mask_is_used_and_agrees_with_offsets(tiny_target):
    tokenizer = tokenizer_with(tiny_target, "chatml_generation.jinja", [])
    assert has_generation_tags(tokenizer)
    own = tokenize_conversation(tokenizer, MESSAGES)
    by_offsets = _offset_masked(tokenizer, MESSAGES)
    assert own.input_ids.tolist() == by_offsets.input_ids.tolist()
    assert own.loss_mask.tolist() == by_offsets.loss_mask.tolist()


def test_thinking_and_plain_variants_have_different_template_hashes(tiny_target):
    plain = tokenizer_with(tiny_target, "llama3.jinja", [])
    thinking = tokenizer_with(tiny_target, "kimi_thinking.jinja", [])
    assert template_hash(plain) != template_hash(thinking)


def test_regenerated_reply_keeps_the_ids_the_target_generated(tiny_target):
    """A reply carrying `token_ids` keeps them, even where re-tokenizing its text gives
    other ids (as SmolLM2's one "\\n\\n" token comes back as "\\n", "\\n"); the mask and the
    text stay the template's. Ids that do not decode to the reply are ignored."""
    tokenizer = tokenizer_with(tiny_target, None, [])
    content = MESSAGES[1]["content"]
    canonical = tokenizer(content, add_special_tokens=False)["input_ids"]
    # the same text in other ids: the first multi-character token spelled out by characters
    at = next(i for i, t in enumerate(canonical) if len(tokenizer.decode([t])) > 1)
    chars = [
        tokenizer.convert_tokens_to_ids(c) for c in tokenizer.convert_ids_to_tokens(canonical[at])
    ]
    generated = canonical[:at] + chars + canonical[at + 1 :]
    assert generated != canonical and tokenizer.decode(generated) == content
    messages = [dict(m) for m in MESSAGES]
    messages[1]["token_ids"] = generated

    spliced = tokenize_conversation(tokenizer, messages)
    ids, mask = spliced.input_ids.tolist(), spliced.loss_mask.tolist()
    start = next(i for i in range(len(ids)) if ids[i : i + len(generated)] == generated)
    assert all(mask[start : start + len(generated)])
    plain = tokenize_conversation(tokenizer, MESSAGES)
    assert ids[:start] == plain.input_ids.tolist()[:start]  # the prompt as before
    masked = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert masked == "two plus two is 4.<|im_end|>\nthree plus two is 5.<|im_end|>\n"

    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for other in (generated[:-1], [*generated, eos]):  # not exactly this reply: as before
        messages[1]["token_ids"] = other
        fallback = tokenize_conversation(tokenizer, messages)
        assert fallback.input_ids.tolist() == plain.input_ids.tolist()
