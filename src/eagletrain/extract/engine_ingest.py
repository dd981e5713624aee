"""Extraction from a serving engine: for targets too large for transformers, the engine runs
the prefill and writes the hidden states; this module turns its files into our shards.

The file format is vLLM's `extract_hidden_states` speculative method with its hidden-states
connector: one safetensors file per request holding `token_ids` [T] and `hidden_states`
[T, L, H], the L captured layers in ascending layer order (the order the decoder loop
reaches them), with a companion `<file>.lock` that the writer holds exclusively until the
file is complete. SGLang's in-process capture (`set_eagle3_layers_to_capture`) dumped to the
same layout is read the same way; only its layer-id convention differs.

Files are matched to samples by content: the sha256 of the token ids, then the ids
themselves compared; never by file name or arrival order (the bug class of the pipeline
we started from). Layer ids are converted explicitly:
  vLLM   id k = the residual stream entering layer k = output of layer k-1 (ours: k-1);
         id = num_layers is the last layer's output before the final norm.
  SGLang id k = output of layer k (ours: k).
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from eagletrain.config import EngineConfig
from eagletrain.errors import ConfigError, InputError
from eagletrain.extract.codec import to_store_dtype
from eagletrain.extract.shard_writer import CapturedBatch
from eagletrain.runtime.ledger import ItemRow

# engine id of our layer k ("output of layer k") = k + offset
CONVENTION_OFFSET = {"vllm": 1, "sglang": 0}


def engine_layer_ids(aux_ids: list[int], num_layers: int, convention: str) -> list[int]:
    """The ids to configure the engine with: the three aux layers and the last layer."""
    offset = CONVENTION_OFFSET[convention]
    return sorted(k + offset for k in [*aux_ids, num_layers - 1])


def serve_command(
    model_dir: str, dump_dir: str, aux_ids: list[int], num_layers: int, max_len: int
) -> str:
    """A vLLM server that writes exactly the dumps this stage reads."""
    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {
            "hf_config": {
                "eagle_aux_hidden_state_layer_ids": engine_layer_ids(aux_ids, num_layers, "vllm")
            }
        },
    }
    transfer = {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": dump_dir},
    }
    # prefix caching off: cached prefixes leave fewer hidden states than tokens (vllm#44485)
    return (
        f"vllm serve {model_dir} --max-model-len {max_len} --no-enable-prefix-caching "
        f"--speculative-config '{json.dumps(spec)}' --kv-transfer-config '{json.dumps(transfer)}'"
    )


def token_ids_hash(ids: torch.Tensor) -> str:
    return hashlib.sha256(ids.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()


@contextmanager
def finished_file(path: Path) -> Iterator[bool]:
    """True while `path` may be read: no writer holds its companion lock (a file without a
    lock was written whole, as older connectors did)."""
    lock = Path(f"{path}.lock")
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        yield True
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        yield False  # the engine is still writing it
        return
    try:
        yield True
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


@dataclass(frozen=True)
class Dump:
    path: Path
    tokens: int


class EngineDumps:
    """The dump directory indexed by token-id hash, and the layer positions to read."""

    def __init__(self, cfg: EngineConfig, aux_ids: list[int], num_layers: int, hidden: int):
        if not cfg.dump_dir:
            raise ConfigError("extract.backend = 'engine' needs extract.engine.dump_dir")
        self.dir = Path(cfg.dump_dir).expanduser()
        self.hidden = hidden
        captured = sorted(cfg.layer_ids or engine_layer_ids(aux_ids, num_layers, cfg.convention))
        ours = [i - CONVENTION_OFFSET[cfg.convention] for i in captured]
        needed = [*aux_ids, num_layers - 1]
        missing = [k for k in needed if k not in ours]
        if missing:
            want = engine_layer_ids(aux_ids, num_layers, cfg.convention)
            raise ConfigError(
                f"extract.engine.layer_ids {captured} ({cfg.convention} convention) lack our "
                f"layers {missing} (output-of-layer ids); the engine must capture {want}"
            )
        self.layer_count = len(captured)
        self.aux_positions = [ours.index(k) for k in aux_ids]
        self.last_position = ours.index(num_layers - 1)
        self.by_hash: dict[str, list[Dump]] = {}
        self.in_progress = 0

    def scan(self) -> None:
        """Index every finished dump (one directory listing; headers and token ids only)."""
        if not self.dir.is_dir():
            raise InputError(f"{self.dir}: engine dump directory not found")
        self.by_hash.clear()
        self.in_progress = 0
        with os.scandir(self.dir) as entries:
            names = sorted(e.name for e in entries if e.name.endswith(".safetensors"))
        for name in names:
            path = self.dir / name
            with finished_file(path) as finished:
                if not finished:
                    self.in_progress += 1
                    continue
                ids, shape = self._header(path)
            self._check_shape(path, shape, len(ids))
            self.by_hash.setdefault(token_ids_hash(ids), []).append(Dump(path, len(ids)))

    def _header(self, path: Path) -> tuple[torch.Tensor, list[int]]:
        try:
            with safe_open(str(path), framework="pt") as f:
                if not {"token_ids", "hidden_states"} <= set(f.keys()):
                    raise InputError(
                        f"{path}: not an engine hidden-state dump (needs token_ids and "
                        f"hidden_states, has {sorted(f.keys())})"
                    )
                return f.get_tensor("token_ids"), list(f.get_slice("hidden_states").get_shape())
        except SafetensorError as err:
            raise InputError(f"{path}: unreadable engine dump ({err})") from None

    def _check_shape(self, path: Path, shape: list[int], tokens: int) -> None:
        if len(shape) != 3 or shape[1] != self.layer_count or shape[2] != self.hidden:
            raise InputError(
                f"{path}: hidden_states {shape}, expected [T, {self.layer_count}, "
                f"{self.hidden}] (T tokens, the engine's captured layers, hidden size)"
            )
        if shape[0] != tokens:
            raise InputError(
                f"{path}: {shape[0]} hidden-state rows for {tokens} token ids (prefix caching "
                f"must be off in the engine: cached prefixes are not written)"
            )

    def find(self, ids: torch.Tensor) -> Dump | None:
        """The dump whose token ids equal the sample's (hash first, then the ids)."""
        for dump in self.by_hash.get(token_ids_hash(ids), []):
            with safe_open(str(dump.path), framework="pt") as f:
                if torch.equal(f.get_tensor("token_ids").to(torch.int64), ids.to(torch.int64)):
                    return dump
        return None

    def captured(
        self,
        items: list[ItemRow],
        inputs: list[tuple[torch.Tensor, torch.Tensor]],
        dumps: list[Dump],
        store_dtype: torch.dtype,
    ) -> CapturedBatch:
        """A batch of samples read from their dumps, in the layout the shard writer takes."""
        aux_rows, last_rows, finite = [], [], []
        for dump in dumps:
            with safe_open(str(dump.path), framework="pt") as f:
                states = f.get_tensor("hidden_states").float()  # [T, L, H]
            aux = torch.cat([states[:, p] for p in self.aux_positions], dim=-1)
            last = states[:, self.last_position]
            finite.append(bool(torch.isfinite(aux).all() and torch.isfinite(last).all()))
            aux_rows.append(aux)
            last_rows.append(last)
        aux, last, scales = to_store_dtype(
            torch.cat(aux_rows), torch.cat(last_rows), len(self.aux_positions), store_dtype
        )
        return CapturedBatch(
            items,
            [d.tokens for d in dumps],
            aux,
            last,
            torch.tensor(finite),
            [x for x, _ in inputs],
            [m for _, m in inputs],
            None,
            scales,
        )


def request_dumps(cfg: EngineConfig, samples: list[tuple[str, torch.Tensor]]) -> list[str]:
    """Ask a vLLM server (extract_hidden_states + its connector) for each sample's dump: a
    prefill of the sample's token ids with one new token. The returned paths are not used
    for matching (the scan matches by content); the keys of failed requests are returned."""
    from eagletrain.data.api_client import RequestFailed, ServerClient

    def parse(body: dict[str, Any]) -> str:
        params = body.get("kv_transfer_params") or {}
        path = params.get("hidden_states_path")
        if not isinstance(path, str):
            raise ValueError("no kv_transfer_params.hidden_states_path")
        return path

    async def main() -> list[str]:
        failed: list[str] = []
        async with ServerClient(cfg) as client:

            async def one(key: str, ids: torch.Tensor) -> None:
                payload = {"model": cfg.model, "prompt": ids.tolist(), "max_tokens": 1}
                try:
                    await client.post("completions", payload, parse)
                except RequestFailed:
                    failed.append(key)

            await asyncio.gather(*(one(k, ids) for k, ids in samples))
        return failed

    return asyncio.run(main())
