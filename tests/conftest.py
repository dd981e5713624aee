"""Shared fixtures: a tiny random-weight Llama target with a real BPE tokenizer and a
ChatML template, synthetic conversations and prompts, and helpers to run the real CLI."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def synthetic_conversation(rng: random.Random) -> dict:
    a, b = rng.randrange(10), rng.randrange(10)
    turns = [
        {"from": "human", "value": f"What is {WORDS[a]} plus {WORDS[b]}?"},
        {"from": "gpt", "value": f"{WORDS[a]} plus {WORDS[b]} is {a + b}. " * rng.randint(1, 3)},
    ]
    if rng.random() < 0.5:
        turns += [
            {"from": "human", "value": f"And {WORDS[b]} times {WORDS[a]}?"},
            {"from": "gpt", "value": f"{WORDS[b]} times {WORDS[a]} is {a * b}."},
        ]
    return {"id": f"c{rng.random():.8f}", "conversations": turns}


def build_tokenizer(directory: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(1)
    corpus = [json.dumps(synthetic_conversation(rng)) for _ in range(300)]
    corpus += ["system assistant user You are a tiny test model."] * 5
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token="<|im_start|>",
    )
    fast.chat_template = CHATML
    fast.save_pretrained(directory)
    return fast


def build_tiny_target(directory: Path, seed: int = 0, layers: int = 8) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer(directory)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    return build_tiny_target(tmp_path_factory.mktemp("tiny-target"))


def write_conversations(path: Path, n: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    path.write_text("".join(json.dumps(synthetic_conversation(rng)) + "\n" for _ in range(n)))
    return path


@pytest.fixture(scope="session")
def conversations(tmp_path_factory) -> Path:
    return write_conversations(tmp_path_factory.mktemp("data") / "conversations.jsonl", 48)


@pytest.fixture(scope="session")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    rng = random.Random(7)
    lines = [
        json.dumps({"prompt": f"What is {rng.choice(WORDS)} plus {rng.choice(WORDS)}?"})
        for _ in range(6)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def tiny_config_text(target: Path, conversations: Path, prompts: Path, name: str = "tiny") -> str:
    return f"""
[run]
name = "{name}"

[target]
model = "{target}"
dtype = "float32"
device = "cpu"

[data]
source = "{conversations}"
max_length = 96
heldout_fraction = 0.2
samples_per_chunk = 4

[extract]
store_dtype = "float32"
batch_tokens = 128
samples_per_shard = 4

[train]
draft_vocab_size = 64
ttt_steps = 3
epochs = 2
batch_size = 4
lr = 3e-3
device = "cpu"

[eval]
datasets = ["{prompts}"]
num_prompts = 3
max_new_tokens = 12
draft_steps = 3
device = "cpu"
"""


@pytest.fixture
def tiny_config(tmp_path, tiny_target, conversations, prompts) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(tiny_config_text(tiny_target, conversations, prompts))
    return path


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"EAGLETRAIN_HEARTBEAT_S": "0.2", "PYTHONUNBUFFERED": "1", **extra})
    return env


def eagletrain(
    *args: str,
    env: dict[str, str] | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "eagletrain", *map(str, args)],
        capture_output=True,
        text=True,
        env=env or cli_env(),
        timeout=timeout,
    )


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def eagletrain_background(*args: str, env: dict[str, str], log: Path) -> subprocess.Popen:
    """The CLI started as a shell starts a background job: with SIGINT ignored (inherited)."""
    return subprocess.Popen(
        [sys.executable, "-m", "eagletrain", *map(str, args)],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
        preexec_fn=_ignore_sigint,
    )


def status_json(run_dir: Path, **env: str) -> dict[str, dict]:
    """`eagletrain status --json`, which must answer whatever is running. How fast it answers
    is measured in bench/status.py; the bound here only catches status waiting on a busy
    writer (a loaded 2-core CI machine took 1.4 s for a normally ~0.5 s call)."""
    start = time.perf_counter()
    result = eagletrain("status", run_dir, "--json", env=cli_env(**env))
    elapsed = time.perf_counter() - start
    assert result.returncode == 0, result.stderr
    assert elapsed < 15.0, f"status took {elapsed:.2f}s: did it wait on the running stage?"
    return {s["stage"]: s for s in json.loads(result.stdout)}


def wait_for(predicate, timeout: float = 120.0, every: float = 0.2):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError("condition not reached in time")


def train_losses(run: Path) -> dict[int, float]:
    lines = (run / "train" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    steps = [r["step"] for r in records if "eval" not in r]
    assert len(steps) == len(set(steps)), "a step was logged twice"
    return {r["step"]: r["loss"] for r in records if "eval" not in r}
