"""Regeneration over a real socket: the OpenAI-compatible client against a server that
misbehaves on purpose, the multi-turn driver, resume after SIGKILL (asserted by the
server's own request counts), secrets, and local batched generation."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import cli_env, eagletrain, eagletrain_background, status_json, write_conversations
from fault_server import FaultPlan, FaultServer, conversation_id

from eagletrain.config import RegenerateConfig
from eagletrain.data.api_client import ChatClient, RegenerationAborted, RequestFailed
from eagletrain.data.regenerate import Regenerated, regenerate_conversation

SECRET = "sk-test-7f3a9c1e5b2d4f60-do-not-leak"


def unique_conversations(path: Path, n: int, seed: int) -> Path:
    """Synthetic conversations made distinct by a number in the first question."""
    write_conversations(path, n, seed)
    lines = []
    for i, line in enumerate(path.read_text().splitlines()):
        conv = json.loads(line)
        conv["conversations"][0]["value"] += f" (question {i})"
        lines.append(json.dumps(conv) + "\n")
    path.write_text("".join(lines))
    return path


def fast_regen(base_url: str, **overrides) -> RegenerateConfig:
    values = {
        "base_url": base_url,
        "model": "tiny",
        "api_key_env": "EAGLETRAIN_TEST_API_KEY",
        "concurrency": 16,
        "timeout_s": 0.3,
        "max_retries": 2,
        "backoff_base_s": 0.01,
        "backoff_max_s": 0.05,
        "circuit_failures": 1000,
        "circuit_cooldown_s": 0.05,
        "max_tokens": 40,
        **overrides,
    }
    return RegenerateConfig(**values)


def regen_config(tmp_path: Path, base: str, regen: RegenerateConfig, mode: str = "api") -> Path:
    lines = [f"{k} = {json.dumps(v)}" for k, v in regen.model_dump().items()]
    path = tmp_path / "regen.toml"
    path.write_text(
        base.replace("[data]", f'[data]\nregenerate = "{mode}"', 1)
        + "\n[data.regen]\n"
        + "\n".join(lines)
        + "\n"
    )
    return path


def with_source(base_config: str, source: Path) -> str:
    return base_config.replace(base_config.split('source = "')[1].split('"')[0], str(source))


def ledger_count(run: Path, count_sql: str) -> int:
    try:
        return ledger_rows(run, count_sql)[0][0]
    except sqlite3.OperationalError:  # the ledger or its table is not there yet
        return 0


def data_in_background(config: Path, run: Path, log: Path, until: Callable[[], bool], env=None):
    """`eagletrain data` started as a background job, returned once `until()` holds (or
    after 120 s)."""
    env = env or cli_env()
    proc = eagletrain_background("data", config, "--run-dir", run, env=env, log=log)
    deadline = time.time() + 120
    while not until() and time.time() < deadline:
        time.sleep(0.02)
    return proc


@pytest.fixture
def base_config(tiny_config: Path) -> str:
    return tiny_config.read_text()


def ledger_rows(run: Path, sql: str) -> list[tuple]:
    conn = sqlite3.connect(run / "ledger.sqlite")
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


def test_multi_turn_regeneration_keeps_reasoning_and_regenerated_history():
    plan = FaultPlan(reasoning=True)
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "old answer 1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "old answer 2"},
    ]

    async def go(url: str):
        async with ChatClient(fast_regen(url)) as client:
            return await regenerate_conversation(messages, client, lambda _h: True)

    with FaultServer(plan) as server:
        out = asyncio.run(go(server.base_url))
        conv = conversation_id(messages)
        assert server.stats.answered[(conv, 0)] == 1 and server.stats.answered[(conv, 1)] == 1
    assert [m["role"] for m in out.messages] == [m["role"] for m in messages]
    assert "old answer" not in out.messages[2]["content"] + out.messages[4]["content"]
    # the second turn was answered on the regenerated first reply, not on the original
    from fault_server import reply_text

    history = [{"role": m["role"], "content": m["content"]} for m in out.messages[:4]]
    assert out.messages[4]["content"] == reply_text(history, plan.reply_words)
    assert out.messages[2]["reasoning_content"] == "thinking about turn 2"
    assert out.finish_reasons == ["stop", "stop"]


def test_retry_after_is_honoured_and_non_retriable_status_fails_at_once():
    async def timed(url: str, **kw):
        async with ChatClient(fast_regen(url, concurrency=1, max_retries=8, **kw)) as client:
            start = time.perf_counter()
            await client.complete([{"role": "user", "content": "hi"}])
            return time.perf_counter() - start

    plan = FaultPlan(fault_rate=0.6, faults=("429",), retry_after_s=0.25, seed=3)
    with FaultServer(plan) as server:
        elapsed = sum(asyncio.run(timed(server.base_url)) for _ in range(4))
        throttled = server.stats.faults["429"]
    assert throttled >= 1
    assert elapsed >= 0.25 * throttled  # each 429 waited at least its Retry-After

    with FaultServer(FaultPlan(api_key="right")) as server:
        os.environ["EAGLETRAIN_TEST_API_KEY"] = "wrong"
        try:
            with pytest.raises(RegenerationAborted, match="HTTP 401"):
                asyncio.run(timed(server.base_url))
        finally:
            del os.environ["EAGLETRAIN_TEST_API_KEY"]
        assert server.stats.requests == 1  # a refused key is not retried


def test_circuit_breaker_stops_a_failing_server():
    async def go(url: str):
        cfg = fast_regen(url, circuit_failures=3, circuit_max_trips=2, max_retries=50)
        async with ChatClient(cfg) as client:
            await client.complete([{"role": "user", "content": "hi"}])

    with FaultServer(FaultPlan(fault_rate=1.0, faults=("500",))) as server:
        with pytest.raises(RegenerationAborted, match="in a row"):
            asyncio.run(go(server.base_url))
        assert server.stats.requests == 6  # two openings of three failures each, then stop


def test_retries_exhausted_is_a_failure_with_its_reason():
    async def go(url: str):
        async with ChatClient(fast_regen(url, max_retries=1)) as client:
            await client.complete([{"role": "user", "content": "hi"}])

    plan = FaultPlan(fault_rate=1.0, faults=("malformed",))
    with FaultServer(plan) as server, pytest.raises(RequestFailed, match=r"bad response.*after 2"):
        asyncio.run(go(server.base_url))


def test_500_conversations_with_30_percent_faults(tmp_path: Path, base_config: str):
    """Every conversation ends done, or failed with its reason; the key never leaks."""
    source = unique_conversations(tmp_path / "conv.jsonl", 500, seed=11)
    with source.open("a") as f:  # ten repeats: items skipped as duplicates, still counted
        f.writelines(source.read_text().splitlines(keepends=True)[:10])
    base = with_source(base_config, source)
    run = tmp_path / "run"
    plan = FaultPlan(fault_rate=0.3, stall_s=0.6, api_key=SECRET, seed=5)
    with FaultServer(plan) as server:
        config = regen_config(tmp_path, base, fast_regen(server.base_url))
        env = cli_env(EAGLETRAIN_TEST_API_KEY=SECRET)
        result = eagletrain("data", config, "--run-dir", run, env=env)
        stats = server.stats
    assert set(stats.faults) == set(plan.faults), stats.faults  # every kind was injected
    assert stats.auth_headers == {f"Bearer {SECRET}"}
    states = dict(ledger_rows(run, "SELECT state, COUNT(*) FROM items GROUP BY state"))
    assert sum(states.values()) == 510
    assert set(states) <= {"done", "failed", "skipped"}
    skipped = dict(
        ledger_rows(run, "SELECT error, COUNT(*) FROM items WHERE state='skipped' GROUP BY 1")
    )
    assert skipped.get("duplicate conversation") == 10
    failed = ledger_rows(run, "SELECT key, error FROM items WHERE state='failed'")
    assert all(err and err.startswith("regenerate: ") for _k, err in failed)
    if failed:  # the stage is not complete: one line naming the failed samples, exit 5
        assert result.returncode == 5 and f"{len(failed)} samples failed" in result.stderr
        assert any(key in result.stderr for key, _err in failed)  # named (long lists elided)
        assert len(result.stderr.strip().splitlines()) == 1
    else:
        assert result.returncode == 0, result.stderr
    assert states.get("done", 0) >= 450
    # usage and cost are summed in the ledger, and status shows them
    detail = json.loads(ledger_rows(run, "SELECT detail FROM stages WHERE stage='data'")[0][0])
    totals = detail["regeneration"]
    assert totals["conversations"] == states["done"] + states["skipped"] - 10
    assert totals["completion_tokens"] > 0 and totals["cost"] > 0
    status = eagletrain("status", run, env=env)
    assert "regenerated" in status.stdout
    # the secret is nowhere: not in the run directory (ledger included), not in any output
    for path in run.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path
    assert SECRET not in result.stdout + result.stderr + status.stdout + status.stderr


def test_sigkill_mid_regeneration_resends_nothing_finished(tmp_path: Path, base_config: str):
    source = unique_conversations(tmp_path / "conv.jsonl", 120, seed=12)
    base = with_source(base_config, source)
    run = tmp_path / "run"
    with FaultServer(FaultPlan(fault_rate=0.3, stall_s=0.6, seed=9)) as server:
        config = regen_config(tmp_path, base, fast_regen(server.base_url, max_retries=8))
        env = cli_env(EAGLETRAIN_FAULT_DELAY="data:0.05")
        saved = "SELECT COUNT(*) FROM regenerated"
        proc = data_in_background(
            config, run, tmp_path / "log", lambda: ledger_count(run, saved) >= 30, env
        )
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        rows = ledger_rows(run, "SELECT key, messages FROM regenerated")
        assert 30 <= len(rows) < 120, len(rows)
        finished = {conversation_id(json.loads(m)) for _k, m in rows}
        before = dict(server.stats.requested)
        server.stats.requested.clear()
        result = eagletrain("data", config, "--run-dir", run, env=cli_env())
        after = dict(server.stats.requested)
    assert result.returncode == 0, result.stderr
    resent = {c: n for c, n in after.items() if c in finished}
    assert not resent, f"finished conversations sent again: {resent}"
    assert before and after  # both runs talked to the server
    states = dict(ledger_rows(run, "SELECT state, COUNT(*) FROM items GROUP BY state"))
    assert states == {"done": 120}
    assert ledger_rows(run, "SELECT COUNT(*) FROM regenerated")[0][0] == 120


def multi_turn_conversations(path: Path, n: int, turns: int) -> Path:
    lines = []
    for i in range(n):
        messages = []
        for t in range(turns):
            messages += [{"from": "human", "value": f"c{i} q{t}"}, {"from": "gpt", "value": "old"}]
        lines.append(json.dumps({"id": f"c{i}", "conversations": messages}) + "\n")
    path.write_text("".join(lines))
    return path


def stored_turns(run: Path) -> set[tuple[str, int]]:
    """(conversation id, assistant turn) of every turn the ledger holds, whole conversations
    and conversations part-way alike, as the fault server keys its answers."""
    turns = set()
    rows = ledger_rows(run, "SELECT messages FROM regenerated")
    rows += [
        (json.dumps(json.loads(r)["messages"]),)
        for (r,) in ledger_rows(run, "SELECT row FROM regen_partial")
    ]
    for (text,) in rows:
        messages = json.loads(text)
        conv = conversation_id(messages)
        replies = sum(m["role"] == "assistant" for m in messages)
        turns.update((conv, i) for i in range(replies))
    return turns


def test_first_sigint_finishes_the_turns_in_flight_and_sends_no_new_one(
    tmp_path: Path, base_config: str
):
    """A stop (`timeout -s INT`) lets the turns already sent finish and sends no new turn,
    not even a conversation's next one: every turn the server answered is in the ledger
    (conversations cut between turns kept part-way), the stage reads stopped, and a rerun
    re-sends no stored turn and completes."""
    source = multi_turn_conversations(tmp_path / "conv.jsonl", 200, turns=3)
    base = with_source(base_config, source).replace("max_length = 96", "max_length = 1024")
    run = tmp_path / "run"
    with FaultServer(FaultPlan(latency_s=0.1, seed=3)) as server:
        config = regen_config(tmp_path, base, fast_regen(server.base_url, timeout_s=5.0))
        saved = "SELECT COUNT(*) FROM regenerated"
        proc = data_in_background(
            config, run, tmp_path / "log", lambda: ledger_count(run, saved) >= 20
        )
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 130
        stored = stored_turns(run)
        answered = set(server.stats.answered)
        assert 20 <= ledger_count(run, saved) < 200
        # every answered turn was kept; conversations were left between turns, not finished
        assert answered == stored, (len(answered), len(stored))
        assert ledger_count(run, "SELECT COUNT(*) FROM regen_partial") > 0
        assert status_json(run)["data"]["verdict"] == "stopped"
        server.stats.answered.clear()
        result = eagletrain("data", config, "--run-dir", run, env=cli_env())
        answered_again = stored & set(server.stats.answered)
    assert result.returncode == 0, result.stderr
    assert not answered_again
    assert ledger_rows(run, "SELECT COUNT(*) FROM regenerated")[0][0] == 200
    assert ledger_count(run, "SELECT COUNT(*) FROM regen_partial") == 0


def test_a_stop_after_every_turn_was_sent_still_completes_the_stage(
    tmp_path: Path, base_config: str
):
    """20 one-turn conversations fit the 32 kept open: every turn is sent before the first
    reply, so a stop then ends nothing early and the stage finishes and verifies."""
    source = unique_conversations(tmp_path / "conv.jsonl", 20, seed=14)
    one_turn = [json.loads(line) for line in source.read_text().splitlines()]
    for conv in one_turn:
        conv["conversations"] = conv["conversations"][:2]
    source.write_text("".join(json.dumps(c) + "\n" for c in one_turn))
    base = with_source(base_config, source)
    run = tmp_path / "run"
    with FaultServer(FaultPlan(latency_s=0.3, seed=4)) as server:
        config = regen_config(tmp_path, base, fast_regen(server.base_url, timeout_s=5.0))
        proc = data_in_background(
            config, run, tmp_path / "log", lambda: bool(server.stats.requested)
        )
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 0, (tmp_path / "log").read_text()[-500:]
    assert status_json(run)["data"]["verdict"] == "done"
    assert ledger_rows(run, "SELECT COUNT(*) FROM regenerated")[0][0] == 20


def test_a_resumed_conversation_sends_only_its_remaining_turns():
    messages = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "old 1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "old 2"},
        {"role": "user", "content": "q3"},
        {"role": "assistant", "content": "old 3"},
    ]
    saved: list[dict] = []

    async def go(url: str, resume=None):
        async with ChatClient(fast_regen(url)) as client:
            return await regenerate_conversation(
                messages,
                client,
                lambda _h: True,
                resume,
                lambda r: saved.append(json.loads(json.dumps(r.row()))),
            )

    with FaultServer(FaultPlan()) as server:
        whole = asyncio.run(go(server.base_url))
        assert len(saved) == 3  # one save a turn
        server.stats.answered.clear()
        resumed = asyncio.run(go(server.base_url, Regenerated.from_row(saved[0])))
        conv = conversation_id(messages)
        assert set(server.stats.answered) == {(conv, 1), (conv, 2)}
    assert resumed.row() == whole.row()


def test_sigkill_loses_only_the_turns_in_flight(tmp_path: Path, base_config: str):
    """Each regenerated turn is stored as it comes: after a SIGKILL and a rerun, a turn is
    answered twice only if it was in flight at the kill (at most `concurrency` of them),
    and every stored turn is the reply to its regenerated history."""
    from fault_server import reply_text

    source = multi_turn_conversations(tmp_path / "conv.jsonl", 120, turns=5)
    base = with_source(base_config, source)
    base = base.replace("max_length = 96", "max_length = 1024")  # all five turns fit
    run = tmp_path / "run"
    plan = FaultPlan(latency_s=0.2, seed=5)
    with FaultServer(plan) as server:
        # a generous timeout: a retried request (answered twice) is not what this counts
        regen = fast_regen(server.base_url, timeout_s=60.0)
        config = regen_config(tmp_path, base, regen)
        part_way_sql = "SELECT COUNT(*) FROM regen_partial"
        proc = data_in_background(  # some conversations whole, more part-way
            config, run, tmp_path / "log", lambda: ledger_count(run, part_way_sql) >= 16
        )
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        part_way = ledger_count(run, part_way_sql)
        assert part_way >= 16
        assert status_json(run)["data"]["regeneration"]["part_way"] == part_way
        result = eagletrain("data", config, "--run-dir", run, env=cli_env())
        answered = dict(server.stats.answered)
    assert result.returncode == 0, result.stderr
    assert len(answered) == 120 * 5
    twice = sum(n - 1 for n in answered.values())
    assert twice <= regen.concurrency, twice
    assert ledger_rows(run, "SELECT COUNT(*) FROM regen_partial")[0][0] == 0
    for (messages,) in ledger_rows(run, "SELECT messages FROM regenerated"):
        messages = json.loads(messages)
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                history = [{"role": h["role"], "content": h["content"]} for h in messages[:i]]
                assert m["content"] == reply_text(history, plan.reply_words)


def test_local_regeneration_left_padded_batches_equal_one_by_one(tiny_target: Path):
    from eagletrain.data.local_generator import LocalGenerator
    from eagletrain.target import TargetSource, load_target, load_tokenizer

    source = TargetSource(tiny_target, "tiny")
    tokenizer, model = load_tokenizer(source), load_target(source, "float32", "cpu")
    gen = LocalGenerator(model, tokenizer, RegenerateConfig(max_tokens=10, batch_size=4))
    chats = [
        [{"role": "user", "content": text}]
        for text in ("What is one plus two?", "two", "And nine times four?", "seven eight")
    ]
    batched = gen.generate(chats)
    single = [gen.generate([c])[0] for c in chats]
    assert [b.text for b in batched] == [s.text for s in single]
    assert all(b.completion_tokens > 0 for b in batched)
    static_cfg = RegenerateConfig(max_tokens=10, batch_size=4, kv_cache="static")
    static = LocalGenerator(model, tokenizer, static_cfg).generate(chats)
    assert [s.text for s in static] == [b.text for b in batched]


def test_packed_gqa_attention_equals_expanded_heads_under_a_padding_mask(tiny_target: Path):
    """One decoding step of left-padded rows: the packed attention gives transformers'
    own SDPA result (keys and values expanded per query head) for every row and head."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from eagletrain.decode.packed_gqa import packed_gqa_attention
    from eagletrain.target import TargetSource, load_target

    model = load_target(TargetSource(tiny_target, "tiny"), "float32", "cpu")
    module = model.model.layers[0].self_attn
    assert module.num_key_value_groups > 1
    heads, kv_heads, dim = model.config.num_attention_heads, model.config.num_key_value_heads, 8
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(3, heads, 1, dim, generator=gen)
    key, value = (torch.randn(3, kv_heads, 7, dim, generator=gen) for _ in range(2))
    mask = torch.ones(3, 1, 1, 7, dtype=torch.bool)
    mask[0, ..., :4] = False  # left padding of different widths
    mask[1, ..., :1] = False
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    packed, _ = packed_gqa_attention(module, query, key, value, mask, scaling=0.3)
    assert packed.shape == expected.shape == (3, 1, heads, dim)
    torch.testing.assert_close(packed, expected)


def test_local_regeneration_packed_attention_generates_what_transformers_does(tiny_target: Path):
    from eagletrain.data.local_generator import LocalGenerator
    from eagletrain.target import TargetSource, load_target, load_tokenizer

    source = TargetSource(tiny_target, "tiny")
    tokenizer, model = load_tokenizer(source), load_target(source, "float32", "cpu")
    chats = [[{"role": "user", "content": "a " * n}] for n in (1, 9, 4, 20)]
    texts = {}
    for attention in ("transformers", "packed-gqa"):
        cfg = RegenerateConfig(max_tokens=12, batch_size=4, attention=attention)
        gen = LocalGenerator(model, tokenizer, cfg)
        assert model.config._attn_implementation.endswith("sdpa" if attention[0] == "t" else "gqa")
        texts[attention] = [c.text for c in gen.generate(chats)]
    assert texts["packed-gqa"] == texts["transformers"]
    assert all(texts["packed-gqa"])


class PromptLengthRecorder:
    """The real model; records the prompt lengths (unpadded) of every generate batch."""

    def __init__(self, model):
        self.model, self.batches = model, []

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def generate(self, input_ids, attention_mask, **kwargs):
        self.batches.append(sorted(attention_mask.sum(1).tolist()))
        return self.model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)


def test_local_regeneration_batches_waiting_requests_by_length(tiny_target: Path):
    """Every request waiting when the worker wakes is served, in batches of similar prompt
    length (less left padding), and each caller gets its own answer."""
    from eagletrain.data.local_generator import LocalGenerator
    from eagletrain.target import TargetSource, load_target, load_tokenizer

    source = TargetSource(tiny_target, "tiny")
    tokenizer, model = load_tokenizer(source), load_target(source, "float32", "cpu")
    texts = ["a " * 30, "b", "c " * 12, "d d", "e " * 40, "f " * 3, "g " * 25]
    chats = [[{"role": "user", "content": t}] for t in texts]
    recorder = PromptLengthRecorder(model)
    cfg = RegenerateConfig(max_tokens=6, batch_size=3)

    async def ask_all() -> list:
        async with LocalGenerator(recorder, tokenizer, cfg) as gen:
            return await asyncio.gather(*(gen.complete(c) for c in chats))

    served = asyncio.run(ask_all())
    single = LocalGenerator(model, tokenizer, cfg)
    assert [c.text for c in served] == [single.generate([c])[0].text for c in chats]
    assert [len(b) for b in recorder.batches] == [3, 3, 1]  # all seven, at most 3 a batch
    # grouped: each batch's longest prompt is no longer than the next batch's shortest
    assert all(a[-1] <= b[0] for a, b in zip(recorder.batches, recorder.batches[1:], strict=False))


@pytest.mark.parametrize("in_flight_batches", [1, 3])
def test_local_regeneration_groups_lengths_over_the_whole_in_flight_pool(
    tmp_path: Path, tiny_target: Path, in_flight_batches: int
):
    """The stage keeps `batch_size * in_flight_batches` conversations open, so each batch is
    cut from a pool that many conversations wide: with a pool of 3 batches, the first
    three batches are sorted by length across all nine; with a pool of one batch, only
    within each batch (arrival order between them)."""
    from eagletrain.data.conversations import Record
    from eagletrain.data.local_generator import LocalGenerator
    from eagletrain.data.regenerate import regenerate_all
    from eagletrain.runtime.ledger import Ledger
    from eagletrain.target import TargetSource, load_target, load_tokenizer

    source = TargetSource(tiny_target, "tiny")
    tokenizer, model = load_tokenizer(source), load_target(source, "float32", "cpu")
    words = [40, 2, 30, 25, 1, 12, 3, 35, 8]  # long and short prompts interleaved
    records = [
        Record(
            f"r{i}", [{"role": "user", "content": "w " * n}, {"role": "assistant", "content": "x"}]
        )
        for i, n in enumerate(words)
    ]
    recorder = PromptLengthRecorder(model)
    cfg = RegenerateConfig(max_tokens=4, batch_size=3, in_flight_batches=in_flight_batches)
    ledger = Ledger(tmp_path, create=True)

    async def run_all() -> None:
        async with LocalGenerator(recorder, tokenizer, cfg) as gen:
            assert gen.in_flight == 3 * in_flight_batches
            await regenerate_all(
                records, gen, ledger, lambda _: True, gen.in_flight, lambda *_: None
            )

    asyncio.run(run_all())
    first = recorder.batches[:3]
    assert sum(len(b) for b in recorder.batches) == len(records)
    assert ledger.conn.execute("SELECT COUNT(*) FROM regenerated").fetchone()[0] == len(records)
    sorted_across = all(a[-1] <= b[0] for a, b in itertools.pairwise(first))
    assert sorted_across == (in_flight_batches == 3)


class OutOfMemoryAbove:
    """The real model, except that `generate` on more than `rows` rows raises the error a
    GPU raises when the batch does not fit (fault injection, not a fake result)."""

    def __init__(self, model, rows: int):
        self.model, self.rows, self.calls = model, rows, []

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def generate(self, input_ids, **kwargs):
        self.calls.append(len(input_ids))
        if len(input_ids) > self.rows:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return self.model.generate(input_ids=input_ids, **kwargs)


def test_local_regeneration_splits_a_batch_that_runs_out_of_memory(tiny_target: Path):
    from eagletrain.data.local_generator import LocalGenerator
    from eagletrain.target import TargetSource, load_target, load_tokenizer

    source = TargetSource(tiny_target, "tiny")
    tokenizer, model = load_tokenizer(source), load_target(source, "float32", "cpu")
    cfg = RegenerateConfig(max_tokens=8, batch_size=5)
    chats = [[{"role": "user", "content": f"count to {n}"}] for n in range(5)]
    whole = LocalGenerator(model, tokenizer, cfg).generate(chats)
    limited = OutOfMemoryAbove(model, rows=2)
    gen = LocalGenerator(limited, tokenizer, cfg)
    split = gen.generate(chats)
    assert [c.text for c in split] == [c.text for c in whole]
    assert limited.calls == [5, 2, 3, 1, 2]  # 5 -> 2 + 3, and 3 -> 1 + 2
    assert gen.memory_splits == 2
    with pytest.raises(torch.OutOfMemoryError):  # one row that cannot fit is a real error
        LocalGenerator(OutOfMemoryAbove(model, rows=0), tokenizer, cfg).generate(chats[:1])


@pytest.mark.parametrize("decoder", ["generate", "graphed"])
def test_local_regeneration_through_the_cli(tmp_path: Path, base_config: str, decoder: str):
    run = tmp_path / "run"
    regen = RegenerateConfig(max_tokens=8, batch_size=8, decoder=decoder)
    config = regen_config(tmp_path, base_config, regen, mode="local")
    result = eagletrain("data", config, "--run-dir", run)
    assert result.returncode == 0, result.stderr
    assert ledger_rows(run, "SELECT COUNT(*) FROM regenerated")[0][0] > 0
    source = Path(base_config.split('source = "')[1].split('"')[0])
    originals = {
        turn["value"]
        for line in source.read_text().splitlines()
        for turn in json.loads(line)["conversations"]
        if turn["from"] == "gpt"
    }
    replies = [
        m["content"]
        for (messages,) in ledger_rows(run, "SELECT messages FROM regenerated")
        for m in json.loads(messages)
        if m["role"] == "assistant"
    ]
    assert replies and not originals.intersection(replies)  # every reply is the target's own
    detail = json.loads(ledger_rows(run, "SELECT detail FROM stages WHERE stage='data'")[0][0])
    assert detail["regenerated_by"].startswith("local:")
    assert detail["regeneration"]["requests"] > 0
    # each stored sample holds, in its loss mask, the very ids the target generated
    from eagletrain.data.samples import DataSamples
    from eagletrain.runtime.rundir import reopen_run

    samples = DataSamples(reopen_run(run))
    for key, messages in ledger_rows(run, "SELECT key, messages FROM regenerated"):
        if key not in samples.rows:
            continue  # skipped at tokenization (e.g. over max_length)
        ids, mask = (t.tolist() for t in samples.get(key))
        masked = [t for t, m in zip(ids, mask, strict=True) if m]
        for turn in (m for m in json.loads(messages) if m["role"] == "assistant"):
            generated = turn["token_ids"]
            assert any(masked[i : i + len(generated)] == generated for i in range(len(masked)))


def test_refused_key_stops_the_stage_with_one_line_and_keeps_nothing_secret(
    tmp_path: Path, base_config: str
):
    run = tmp_path / "run"
    with FaultServer(FaultPlan(api_key="the-right-key")) as server:
        config = regen_config(tmp_path, base_config, fast_regen(server.base_url))
        result = eagletrain(
            "data", config, "--run-dir", run, env=cli_env(EAGLETRAIN_TEST_API_KEY=SECRET)
        )
    assert result.returncode == 8, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "401" in result.stderr
    assert SECRET not in result.stdout + result.stderr
    for path in run.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path
