"""Extraction from engine dumps: files in vLLM's extract_hidden_states format (token_ids
[T], hidden_states [T, L, H], a companion .lock), written here from the real tiny target
through transformers' own output_hidden_states (not eagletrain's hooks), under random
names and with an unrelated file among them. Matching is by token ids, layer ids are
converted per engine convention, a dump still being written is left alone, a missing dump
keeps the stage incomplete, and the request driver fills an empty directory through a
real HTTP server on loopback that writes dumps the way the connector does."""

from __future__ import annotations

import fcntl
import json
import os
import random
import sqlite3
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from conftest import eagletrain
from safetensors.torch import save_file

from eagletrain.runtime.ledger import Ledger
from eagletrain.target import TargetSource, load_target
from eagletrain.train.hidden_samples import HiddenSamples

AUX = [1, 3, 4]  # the tiny target's defaults (8 layers): outputs of layers 1, 3, 4


def engine_states(model, ids: torch.Tensor, convention: str) -> tuple[list[int], torch.Tensor]:
    """(the engine's layer ids, hidden_states [T, L, H]) as that engine would capture them.
    HF hidden_states[j] is the stream entering layer j (vLLM's id j) except the last entry,
    which is after the final norm: the last layer's pre-norm output is taken by a hook."""
    layers = model.config.num_hidden_layers
    kept: dict[str, torch.Tensor] = {}
    handle = model.model.layers[-1].register_forward_hook(
        lambda _m, _a, out: kept.update(last=out[0] if isinstance(out, tuple) else out)
    )
    with torch.no_grad():
        out = model.model(input_ids=ids[None].long(), output_hidden_states=True)
    handle.remove()
    states = [out.hidden_states[k + 1][0] for k in AUX] + [kept["last"][0]]
    offset = 1 if convention == "vllm" else 0
    return [k + offset for k in [*AUX, layers - 1]], torch.stack(states, dim=1)


def write_dump(directory: Path, ids: torch.Tensor, states: torch.Tensor) -> Path:
    path = directory / f"{uuid.uuid4().hex}.safetensors"
    Path(f"{path}.lock").touch()
    save_file({"hidden_states": states.contiguous(), "token_ids": ids.long()}, path)
    return path


def data_samples(run: Path) -> list[torch.Tensor]:
    from safetensors import safe_open

    ledger = Ledger(run)
    out = []
    for item in ledger.items("data", "done"):
        with safe_open(str(run / "data" / item.shard), framework="pt") as f:
            out.append(f.get_slice("input_ids")[item.offset : item.offset + item.tokens])
    return out


def checksums(run: Path) -> dict[str, str]:
    return {i.key: i.checksum for i in Ledger(run).items("extract", "done")}


@pytest.fixture
def model(tiny_target):
    return load_target(TargetSource(tiny_target, "tiny"), "float32", torch.device("cpu"))


def _extract(config, run, dumps, *sets, stage="extract"):
    overrides = ["--set", "extract.backend=engine", "--set", f"extract.engine.dump_dir={dumps}"]
    for s in sets:
        overrides += ["--set", s]
    return eagletrain(stage, config, "--run-dir", run, *overrides)


def test_engine_dumps_become_the_same_dataset_as_the_hooks(tiny_config, model, tmp_path):
    hooks, vllm, sglang = tmp_path / "hooks", tmp_path / "vllm", tmp_path / "sglang"
    for run in (hooks, vllm, sglang):
        assert eagletrain("data", tiny_config, "--run-dir", run).returncode == 0
    assert eagletrain("extract", tiny_config, "--run-dir", hooks).returncode == 0
    samples = data_samples(vllm)
    for convention, run in (("vllm", vllm), ("sglang", sglang)):
        dumps = tmp_path / f"dumps-{convention}"
        dumps.mkdir()
        for ids in random.Random(0).sample(samples, len(samples)):
            layer_ids, states = engine_states(model, ids, convention)
            write_dump(dumps, ids, states)
        stranger = torch.tensor([5, 6, 7])  # a request that is not one of our samples
        write_dump(dumps, stranger, engine_states(model, stranger, convention)[1])
        result = _extract(
            tiny_config, run, dumps, f"extract.engine.convention={convention}",
            f"extract.engine.layer_ids={layer_ids}",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert Ledger(run).completion("extract") is not None
    # the same states bit for bit whichever convention named the layers
    assert checksums(vllm) == checksums(sglang)
    ours, theirs = (
        HiddenSamples(r / "hidden", Ledger(r).items("extract", "done")) for r in (hooks, vllm)
    )
    by_key = {it.key: j for j, it in enumerate(theirs.items)}
    assert len(ours) == len(theirs) == len(samples)
    for j, item in enumerate(ours.items):
        for name in ("aux", "last"):
            torch.testing.assert_close(
                theirs.tensor(by_key[item.key], name), ours.tensor(j, name), atol=1e-5, rtol=1e-4
            )
    meta = json.loads((vllm / "hidden" / "dataset.json").read_text())
    assert meta["aux_layer_ids"] == AUX and "vllm" in meta["source"]


def test_missing_and_unfinished_dumps_leave_the_stage_incomplete(tiny_config, model, tmp_path):
    run, dumps = tmp_path / "run", tmp_path / "dumps"
    dumps.mkdir()
    assert eagletrain("data", tiny_config, "--run-dir", run).returncode == 0
    samples = data_samples(run)
    half = len(samples) // 2
    paths = [write_dump(dumps, ids, engine_states(model, ids, "vllm")[1]) for ids in samples[:half]]
    writing = os.open(f"{paths[0]}.lock", os.O_RDWR)  # the engine still writes this one
    fcntl.flock(writing, fcntl.LOCK_EX)
    try:
        result = _extract(tiny_config, run, dumps)
    finally:
        os.close(writing)
    assert result.returncode == 0, result.stderr
    missing = len(samples) - (half - 1)
    assert f"extract: {missing} samples of partition 0/1 have no engine dump" in result.stdout
    assert "extract: 1 engine dumps are still being written" in result.stdout
    assert Ledger(run).counts("extract").get("done") == half - 1
    refused = _extract(tiny_config, run, dumps, stage="train")
    assert refused.returncode == 3 and "not verified complete" in refused.stderr
    for ids in samples[half:]:
        write_dump(dumps, ids, engine_states(model, ids, "vllm")[1])
    assert _extract(tiny_config, run, dumps).returncode == 0
    assert Ledger(run).completion("extract") is not None


def test_a_malformed_dump_is_named(tiny_config, tmp_path):
    run, dumps = tmp_path / "run", tmp_path / "dumps"
    dumps.mkdir()
    assert eagletrain("data", tiny_config, "--run-dir", run).returncode == 0
    bad = write_dump(dumps, torch.arange(5), torch.zeros(5, 2, 64))  # 2 layers, not 4
    result = _extract(tiny_config, run, dumps)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: {bad}: hidden_states [5, 2, 64], expected [T, 4, 64] (T tokens, the "
        "engine's captured layers, hidden size)"
    ]
    wrong = _extract(tiny_config, run, dumps, "extract.engine.layer_ids=[2, 4, 8]")
    assert wrong.returncode == 2 and "the engine must capture [2, 4, 5, 8]" in wrong.stderr


class EngineServer(ThreadingHTTPServer):
    """/v1/completions as vLLM serves it with extract_hidden_states + the hidden-states
    connector: a prefill of the prompt's token ids, the dump written under a new request
    id, its path in kv_transfer_params. Every third new prompt first fails with a 503."""

    def __init__(self, model, directory: Path):
        super().__init__(("127.0.0.1", 0), _EngineHandler)
        self.model, self.directory, self.lock = model, directory, threading.Lock()
        self.requests = 0
        self.seen: set[tuple[int, ...]] = set()


class _EngineHandler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server: EngineServer = self.server  # type: ignore[assignment]
        with server.lock:
            server.requests += 1
            prompt = tuple(body["prompt"])
            flaky = prompt not in server.seen and len(server.seen) % 3 == 0
            server.seen.add(prompt)
            if not flaky:
                ids = torch.tensor(body["prompt"])
                path = write_dump(
                    server.directory, ids, engine_states(server.model, ids, "vllm")[1]
                )
        if flaky:
            self.send_response(503)
            self.end_headers()
            return
        reply = json.dumps(
            {"choices": [{"text": "x"}], "kv_transfer_params": {"hidden_states_path": str(path)}}
        )
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(reply.encode())


def test_the_driver_asks_the_engine_for_every_missing_dump(tiny_config, model, tmp_path):
    run, dumps = tmp_path / "run", tmp_path / "dumps"
    dumps.mkdir()
    assert eagletrain("data", tiny_config, "--run-dir", run).returncode == 0
    server = EngineServer(model, dumps)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        result = _extract(tiny_config, run, dumps, f"extract.engine.base_url={url}",
                          "extract.engine.max_retries=2")  # fmt: skip
    finally:
        server.shutdown()
    assert result.returncode == 0, result.stderr
    n = len(data_samples(run))
    assert Ledger(run).completion("extract") is not None
    assert server.requests > n  # the 503s were retried
    rows = sqlite3.connect(run / "ledger.sqlite").execute(
        "SELECT count(*) FROM items WHERE stage='extract' AND state='done'"
    )
    assert rows.fetchone()[0] == n
