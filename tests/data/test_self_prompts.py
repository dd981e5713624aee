"""Prompts the target writes itself (data.source = "self"): each a ledger item, filtered
with counted reasons, resumable after kill -9 with the prompts an uninterrupted run keeps
and no duplicates, then answered and tokenized like any conversation."""

from __future__ import annotations

import json
import re
import signal
import sqlite3
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_target, cli_env, eagletrain, eagletrain_background, wait_for

from eagletrain.data.dedupe import Deduplicator, degenerate, normalized
from eagletrain.data.self_prompts import user_turn_prefix


@pytest.fixture(scope="module")
def chatty_target(tmp_path_factory) -> Path:
    """The tiny target with its end-of-turn token made likely, so it writes short turns
    that end (a random tiny model almost never stops on its own)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    directory = build_tiny_target(tmp_path_factory.mktemp("chatty"), layers=2)
    model = LlamaForCausalLM.from_pretrained(directory)
    eos = AutoTokenizer.from_pretrained(directory).eos_token_id
    with torch.no_grad():
        hidden = model.model(
            torch.randint(3, 300, (32, 16), generator=torch.Generator().manual_seed(0))
        )
        mean = hidden.last_hidden_state.reshape(-1, model.config.hidden_size).mean(0)
        model.lm_head.weight[eos] = 2.0 * mean / mean.norm() ** 2
    model.save_pretrained(directory)
    return directory


def self_config(tmp_path: Path, target: Path, extra: str = "", source: str = '"self"') -> Path:
    path = tmp_path / "self.toml"
    path.write_text(f"""
[target]
model = "{target}"
dtype = "float32"
device = "cpu"

[data]
source = {source}
limit = 24
max_length = 96
regenerate = "local"
samples_per_chunk = 4

[data.regen]
max_tokens = 8
batch_size = 4
decoder = "continuous"

[data.prompts]
max_tokens = 16
batch_size = 6
min_words = 1
max_attempts = 40
{extra}
""")
    return path


def conn_detail(run: Path, stage: str) -> str:
    conn = sqlite3.connect(run / "ledger.sqlite")
    (detail,) = conn.execute("SELECT detail FROM completions WHERE stage=?", (stage,)).fetchone()
    conn.close()
    return detail


def kept_prompts(run: Path) -> list[tuple[int, str]]:
    conn = sqlite3.connect(run / "ledger.sqlite")
    rows = conn.execute("SELECT slot, text FROM self_prompts WHERE dropped IS NULL ORDER BY slot")
    out = [(int(a), b) for a, b in rows]
    conn.close()
    return out


def test_normalised_exact_and_near_duplicates_are_counted_apart():
    dedupe = Deduplicator(threshold=0.7)
    base = "Write a short poem about the sea at night, with waves and a lonely lighthouse."
    assert dedupe.duplicate(base) is None
    assert dedupe.duplicate("  write a SHORT poem about the sea at night with waves, and a "
                            "lonely lighthouse!") == "exact duplicate"  # fmt: skip
    near = "Write a short poem about the sea at night, with waves and a lonely old lighthouse."
    assert dedupe.duplicate(near) == "near duplicate"
    other = "How do I compute the compound interest on a loan of 5000 dollars over 3 years?"
    assert dedupe.duplicate(other) is None
    assert normalized("Héllo,   World!") == "hello world"


def test_degenerate_text_is_dropped_with_its_reason():
    assert degenerate("anything at all here", finished=False, min_words=3).startswith("unfinished")
    assert degenerate("hi there", finished=True, min_words=3) == "too short"
    assert degenerate("buy now " * 12, finished=True, min_words=3) == "repetition"
    assert degenerate("Plan a three day trip to Rome for two people.", True, 3) is None


def test_the_prefix_is_the_template_up_to_the_user_words(chatty_target):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chatty_target)
    assert user_turn_prefix(tokenizer, None) == (
        "<|im_start|>system\nYou are a tiny test model.<|im_end|>\n<|im_start|>user\n"
    )
    assert user_turn_prefix(tokenizer, "Be brief.").startswith("<|im_start|>system\nBe brief.")


def test_each_slot_is_written_under_its_system_prompt_and_opening(tmp_path, chatty_target):
    """With `system_prompts` and `openings`, slot s is written under system_prompts[s % n]
    and its request begins with openings[s % m]: a real completions server on loopback sees
    each slot's template prefix followed by its opening, and the request kept is the
    opening followed by what the target wrote; the local writer runs the same mixed batch
    (prefixes of different lengths in one decoder) and keeps each slot's opening."""
    from collections import Counter

    from fault_server import FaultServer

    from eagletrain.config import load_config
    from eagletrain.data.self_prompts import api_writer, local_writer
    from eagletrain.target import load_target, load_tokenizer, resolve_target, target_eos

    mix, openings = ["Be brief.", "Code.", "Go."], ["Tell me", "Explain why "]
    extra = f"system_prompts = {json.dumps(mix)}\nopenings = {json.dumps(openings)}"
    with FaultServer() as server:
        sets = [f"data.regen.base_url={json.dumps(server.base_url)}", 'data.regen.model="t"']
        config = load_config(self_config(tmp_path, chatty_target, extra), sets)
        tokenizer = load_tokenizer(resolve_target(config.target))
        written = api_writer(tokenizer, config)([(slot, 0) for slot in range(8)])
        opening = [openings[slot % 2].strip() for slot in range(8)]
        assert [text for text, _, _ in written] == [
            f"{opening[slot]} Asked after: {mix[slot % 3]}<|im_end|>" for slot in range(8)
        ]
        assert server.stats.prompts == Counter(
            user_turn_prefix(tokenizer, mix[slot % 3]) + opening[slot] for slot in range(8)
        )
    model = load_target(resolve_target(config.target), "float32", torch.device("cpu"))
    write = local_writer(model, tokenizer, config, target_eos(model, tokenizer))
    texts = [text for text, _, _ in write([(slot, 0) for slot in range(8)])]
    assert all(t.startswith(opening[slot]) for slot, t in enumerate(texts)), texts


def test_both_system_prompt_settings_or_an_empty_one_are_refused():
    from pydantic import ValidationError

    from eagletrain.config import SelfPromptConfig

    with pytest.raises(ValidationError, match="system_prompt or system_prompts, not both"):
        SelfPromptConfig(system_prompt="a", system_prompts=["b"])
    with pytest.raises(ValidationError, match="holds an empty prompt"):
        SelfPromptConfig(system_prompts=["b", " "])
    with pytest.raises(ValidationError, match="holds an empty opening"):
        SelfPromptConfig(openings=["Write", ""])
    mix = SelfPromptConfig(system_prompts=["a", "b", "c"], openings=["Write ", "Solve"])
    assert [mix.system_prompt_of(s) for s in range(5)] == ["a", "b", "c", "a", "b"]
    assert [mix.opening_of(s) for s in range(3)] == ["Write", "Solve", "Write"]
    assert mix.kinds == 6 and [mix.min_words_of(s) for s in range(2)] == [4, 4]
    assert SelfPromptConfig().opening_of(4) == ""


def test_prompts_are_ledger_items_counted_by_reason_then_answered(tmp_path, chatty_target):
    openings = ["Name", "List"]  # a tiny random model answers some of these
    extra = f'system_prompts = ["Ask.", "Say.", "Go."]\nopenings = {json.dumps(openings)}'
    config = self_config(tmp_path, chatty_target, extra)
    run = tmp_path / "run"
    result = eagletrain("data", config, "--run-dir", run)
    assert result.returncode == 0, result.stderr
    kept = kept_prompts(run)
    assert len(kept) == 24 and [s for s, _ in kept] == list(range(24))
    assert len({normalized(t) for _, t in kept}) == 24  # no exact duplicate kept
    conn = sqlite3.connect(run / "ledger.sqlite")
    written = conn.execute("SELECT COUNT(*) FROM self_prompts").fetchone()[0]
    dropped = dict(conn.execute(
        "SELECT dropped, COUNT(*) FROM self_prompts WHERE dropped IS NOT NULL GROUP BY 1"
    ).fetchall())  # fmt: skip
    detail = json.loads(conn.execute(
        "SELECT detail FROM completions WHERE stage='data'").fetchone()[0])  # fmt: skip
    conn.close()
    assert written == 24 + sum(dropped.values()) and dropped  # a random model drops some
    status = eagletrain("status", run).stdout
    assert f"written {written}, kept 24" in status and "prompts" in status
    assert all(f"{n} {why}" in status for why, n in dropped.items())
    # the regenerating decoder's occupancy: 4 rows, busy a share of its steps
    decoder = next(line for line in status.splitlines() if "decoder (last run)" in line)
    assert "4 rows" in decoder and "rows busy" in decoder and " 0 steps" not in decoder
    assert re.search(
        r"device \d+\.\d s prefilling \([1-9]\d* refills, [1-9]\d* forwards\)", decoder
    )
    assert detail["records_per_source"] == {"self": 24}
    tally = json.loads(conn_detail(run, "prompts"))
    assert tally["kept_per_system_prompt"] == [8, 8, 8]  # slots 0-23, by slot % 3
    assert tally["kept_per_opening"] == [12, 12]
    assert all(t.startswith(openings[s % 2]) for s, t in kept)
    # the target's own words after the opening count toward min_words (1): none is bare
    assert not any(t in openings for _, t in kept)
    assert detail["regenerated_by"].startswith("local:")
    coverage = detail["assistant_tokens"]  # what the replies cover, for the draft vocab
    assert coverage["counted_tokens"] > 0 and 0 < coverage["size_for_0.999"] <= 512


def test_kill_minus_nine_then_rerun_keeps_what_an_uninterrupted_run_keeps(tmp_path, chatty_target):
    config = self_config(tmp_path, chatty_target)
    whole = tmp_path / "whole"
    assert eagletrain("data", config, "--run-dir", whole).returncode == 0
    run = tmp_path / "killed"
    env = cli_env(EAGLETRAIN_FAULT_DELAY="prompts:0.6")
    proc = eagletrain_background("data", config, "--run-dir", run, env=env, log=tmp_path / "log")

    def some_kept() -> bool:
        try:
            return 6 <= len(kept_prompts(run)) < 24
        except sqlite3.Error:
            return False

    wait_for(some_kept, timeout=120, every=0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = kept_prompts(run)
    assert eagletrain("status", run).returncode == 0
    result = eagletrain("data", config, "--run-dir", run)
    assert result.returncode == 0, result.stderr
    after = kept_prompts(run)
    assert set(before) <= set(after)  # nothing kept before the kill was lost or changed
    assert after == kept_prompts(whole)  # the same prompts as an uninterrupted run
    assert len({normalized(t) for _, t in after}) == len(after) == 24


def test_sources_mix_with_their_counts_recorded(tmp_path, chatty_target, conversations):
    config = self_config(
        tmp_path, chatty_target, "count = 10", source=f'["{conversations}", "self"]'
    )
    run = tmp_path / "run"
    result = eagletrain("data", config, "--run-dir", run)
    assert result.returncode == 0, result.stderr
    conn = sqlite3.connect(run / "ledger.sqlite")
    detail = json.loads(conn.execute(
        "SELECT detail FROM completions WHERE stage='data'").fetchone()[0])  # fmt: skip
    conn.close()
    assert detail["records_per_source"] == {str(conversations): 24, "self": 10}


def test_self_without_replies_or_count_is_a_clear_config_error(tmp_path, chatty_target):
    config = self_config(tmp_path, chatty_target)
    result = eagletrain(
        "data", config, "--run-dir", tmp_path / "a", "--set", "data.regenerate=none"
    )
    assert result.returncode == 2 and "the target must answer them" in result.stderr
    result = eagletrain(
        "data", config, "--run-dir", tmp_path / "b", "--set", f'data.source=["{config}", "self"]'
    )
    assert result.returncode == 2 and "set data.prompts.count" in result.stderr


def test_an_input_with_no_usable_conversation_ends_the_stage_with_exit_2(tmp_path, chatty_target):
    empty = tmp_path / "nothing.jsonl"
    empty.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}]}) + "\n")
    config = self_config(tmp_path, chatty_target, source=f'"{empty}"')
    result = eagletrain("data", config, "--run-dir", tmp_path / "run")
    assert result.returncode == 2
    assert "no usable conversation among 1 records (1 no assistant turn)" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
