"""A few checks on the real embedded target (SmolLM2-135M-Instruct from its GGUF) and the
packaged datasets: the defaults a newcomer's demo runs on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagletrain.config import Config
from eagletrain.data.chat_tokenize import tokenize_conversation
from eagletrain.data.stage import run_data
from eagletrain.decode.chain import plain_decode, speculative_chain
from eagletrain.decode.engine import DecodingEngine
from eagletrain.decode.proposers import PromptLookupProposer
from eagletrain.evaluate.prompts import load_prompts
from eagletrain.runtime.rundir import open_run
from eagletrain.target import (
    default_aux_layer_ids,
    load_target,
    load_tokenizer,
    resolve_target,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def smollm2():
    source = resolve_target(Config().target)
    return load_tokenizer(source), load_target(source, "float32", torch.device("cpu"))


def test_smollm2_layers_and_default_aux_ids(smollm2):
    _, model = smollm2
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    assert default_aux_layer_ids(30) == [1, 14, 26]


def test_data_stage_on_packaged_sharegpt_accounts_for_every_conversation(tmp_path: Path):
    config = Config.model_validate(
        {"data": {"limit": 40, "max_length": 256, "samples_per_chunk": 16}}
    )
    run = open_run(config, tmp_path / "run")
    run_data(run)
    counts = run.ledger.counts("data")
    total = run.ledger.stage_row("data")["total"]
    assert counts.get("done", 0) + counts.get("skipped", 0) == total == 40
    assert counts["done"] > 20
    assert run.ledger.completion("data") is not None


def test_greedy_prompt_lookup_equals_plain_greedy_on_mtbench(smollm2):
    tokenizer, model = smollm2
    eos = {tokenizer.eos_token_id}
    for _, text in load_prompts("mtbench", 3):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        prompt = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        plain = plain_decode(DecodingEngine(model), prompt, 24, eos)
        spec = speculative_chain(DecodingEngine(model), PromptLookupProposer(), prompt, 24, 3, eos)
        assert spec.tokens == plain.tokens


def test_smollm2_template_masks_exactly_the_assistant_turns(smollm2):
    tokenizer, _ = smollm2
    messages = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another?"},
        {"role": "assistant", "content": "Green."},
    ]
    sample = tokenize_conversation(tokenizer, messages)
    ids, mask = sample.input_ids.tolist(), sample.loss_mask.bool().tolist()
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(messages, tokenize=False)
    masked = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert masked == "Blue.<|im_end|>\nGreen.<|im_end|>\n"
