"""The assistant-only loss mask covers exactly the assistant turns (and their end-of-turn)."""

from __future__ import annotations

from eagletrain.chat_tokenize import tokenize_conversation
from eagletrain.target import TargetSource, load_tokenizer

MESSAGES = [
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "two plus two is 4."},
    {"role": "user", "content": "And three?"},
    {"role": "assistant", "content": "three plus two is 5."},
]


def test_mask_covers_assistant_turns_and_their_end_tokens(tiny_target):
    tokenizer = load_tokenizer(TargetSource(tiny_target, "tiny"))
    sample = tokenize_conversation(tokenizer, MESSAGES)
    ids, mask = sample.input_ids.tolist(), sample.loss_mask.bool().tolist()
    masked = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert masked == "two plus two is 4.<|im_end|>\nthree plus two is 5.<|im_end|>\n"
    unmasked = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if not m])
    assert "What is two plus two?" in unmasked and "<|im_start|>assistant\n" in unmasked
    # the token ids are exactly the rendered template's
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False)
    assert tokenizer.decode(ids) == rendered
