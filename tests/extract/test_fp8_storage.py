"""float8 storage of hidden states: per-token, per-layer scales; decoded transparently for
training; the scales are part of every sample's checksum, so `verify` catches a bad one."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import torch
from conftest import eagletrain
from safetensors.torch import load_file, save_file

from eagletrain.extract.codec import FP8, decode_fp8, encode_fp8
from eagletrain.runtime.ledger import Ledger
from eagletrain.train.hidden_samples import HiddenSamples


def test_codec_round_trip_error_is_that_of_e4m3():
    torch.manual_seed(0)
    # three captured layers of very different magnitude, as in real targets
    x = torch.cat([torch.randn(64, 32) * s for s in (0.01, 1.0, 300.0)], dim=1)
    x[5] = 0.0
    q, scale = encode_fp8(x, 3)
    assert q.dtype == FP8 and scale.shape == (64, 3)
    back = decode_fp8(q, scale)
    assert torch.equal(back[5], x[5])
    for block in range(3):
        part, orig = back[:, block * 32 : (block + 1) * 32], x[:, block * 32 : (block + 1) * 32]
        rel = (part - orig).norm() / orig.norm()
        assert rel < 0.04, (block, float(rel))  # 3 mantissa bits: about 2-3% here


def _extract(config: Path, run: Path, dtype: str) -> None:
    for stage in ("data", "extract"):
        result = eagletrain(
            stage, config, "--run-dir", run, "--set", f"extract.store_dtype={dtype}"
        )
        assert result.returncode == 0, result.stderr


def test_fp8_dataset_decodes_close_to_bf16_trains_and_verifies(tiny_config: Path, tmp_path):
    bf16, fp8 = tmp_path / "bf16", tmp_path / "fp8"
    _extract(tiny_config, bf16, "bfloat16")
    _extract(tiny_config, fp8, "float8_e4m3fn")
    datasets = [
        HiddenSamples(run / "hidden", Ledger(run).items("extract", "done")) for run in (bf16, fp8)
    ]
    assert len(datasets[0]) == len(datasets[1]) > 0
    for i in range(len(datasets[0])):
        for name in ("aux", "last"):
            want, got = datasets[0].tensor(i, name).float(), datasets[1].tensor(i, name)
            assert got.dtype == torch.float32 and got.shape == want.shape
            assert (got - want).norm() / want.norm() < 0.05
    shard = next((fp8 / "hidden").rglob("*.safetensors"))
    assert load_file(shard)["aux"].dtype == FP8  # stored compact, not decoded on disk
    assert eagletrain("verify", fp8, "--stage", "extract").returncode == 0
    result = eagletrain(
        "train", tiny_config, "--run-dir", fp8, "--set", "extract.store_dtype=float8_e4m3fn"
    )
    assert result.returncode == 0, result.stderr

    # one corrupted scale: verify names exactly the sample whose rows hold it
    tensors = load_file(shard)
    from safetensors import safe_open

    with safe_open(str(shard), "pt") as f:
        meta = f.metadata()
    tensors["aux_scale"][0, 0] *= 2
    save_file(tensors, shard, metadata=meta)
    con = sqlite3.connect(fp8 / "ledger.sqlite")
    (key,) = con.execute(
        "SELECT key FROM items WHERE stage='extract' AND shard=? AND offset=0", (shard.name,)
    ).fetchone()
    result = eagletrain("verify", fp8, "--stage", "extract")
    assert result.returncode != 0
    assert f"bad sample {key}: checksum mismatch" in result.stdout
