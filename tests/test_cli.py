"""The CLI end to end on the tiny target: the whole pipeline, gating, verify, bad input."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from conftest import build_tiny_target, eagletrain, status_json


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_target, conversations, prompts) -> Path:
    from conftest import tiny_config_text

    base = tmp_path_factory.mktemp("finished")
    config = base / "tiny.toml"
    config.write_text(tiny_config_text(tiny_target, conversations, prompts))
    result = eagletrain("run", config, "--run-dir", base / "run")
    assert result.returncode == 0, result.stderr
    assert "tau=" in result.stdout.splitlines()[-1]
    assert "export: " in result.stdout
    return base / "run"


def test_run_finishes_every_stage_and_status_says_done(finished_run: Path):
    stages = status_json(finished_run)
    assert {s: v["verdict"] for s, v in stages.items()} == dict.fromkeys(stages, "done")
    assert stages["extract"]["done"] == stages["extract"]["total"] > 0
    (results,) = json.loads((finished_run / "eval" / "results.json").read_text())["results"]
    assert results["lossless"] is True
    assert 1.0 <= results["tau"] <= 1 + results["draft_steps"]
    low, high = results["tau_ci95"]
    assert low <= results["tau"] <= high
    assert 0.0 <= results["out_of_vocab_share"] <= 1.0
    tree = results["tree"]
    assert tree["cycles"] > 0 and 1.0 <= tree["tau"] <= 1 + tree["depth"]
    assert (finished_run / "export" / "sglang" / "config.json").is_file()
    vocab = stages_detail(finished_run, "train")["draft_vocab"]
    assert vocab["draft_vocab_size"] == 64 and 0 < vocab["train_coverage"] <= 1
    assert "smollm2" not in (finished_run / "config.toml").read_text()  # resolved, our target


def test_report_renders_its_plots_from_the_run(finished_run: Path):
    import matplotlib.image

    result = eagletrain("report", finished_run)
    assert result.returncode == 0, result.stderr
    text = (finished_run / "report" / "report.md").read_text()
    for png in ("stages.png", "training.png", "tau.png", "acceptance.png"):
        assert f"]({png})" in text
        pixels = matplotlib.image.imread(finished_run / "report" / png)
        assert pixels.shape[0] > 200 and pixels.shape[1] > 400
        assert pixels[..., :3].std() > 0.05  # not a blank canvas
    (results,) = json.loads((finished_run / "eval" / "results.json").read_text())["results"]
    low, high = results["tau_ci95"]
    row = f"| {results['tau']:.3f} [{low:.2f}-{high:.2f}] | {results['tree']['tau']:.3f} |"
    assert row in text


def test_rerun_of_a_finished_run_does_no_work(finished_run: Path):
    config = finished_run.parent / "tiny.toml"
    before = (finished_run / "train" / "metrics.jsonl").read_text()
    result = eagletrain("run", config, "--run-dir", finished_run)
    assert result.returncode == 0, result.stderr
    assert "already verified complete" in result.stdout
    assert (finished_run / "train" / "metrics.jsonl").read_text() == before


def test_verify_names_the_samples_of_a_truncated_shard(finished_run: Path, tmp_path: Path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    conn = sqlite3.connect(run / "ledger.sqlite")
    (shard,) = conn.execute(
        "SELECT shard FROM items WHERE stage='extract' AND state='done' LIMIT 1"
    ).fetchone()
    keys = {
        k
        for (k,) in conn.execute(
            "SELECT key FROM items WHERE stage='extract' AND shard=?", (shard,)
        )
    }
    conn.close()
    path = run / "hidden" / shard
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    result = eagletrain("verify", run, "--stage", "extract")
    assert result.returncode == 5
    assert all(key in result.stdout for key in keys)
    assert "1 stage(s)" in result.stderr and "Traceback" not in result.stderr
    # The completion record is revoked, so the next stage is gated again.
    assert status_json(run)["extract"]["verdict"] != "done"


def test_train_refuses_without_verified_extraction(tiny_config: Path, tmp_path: Path):
    run = tmp_path / "run"
    assert eagletrain("data", tiny_config, "--run-dir", run).returncode == 0
    result = eagletrain("train", tiny_config, "--run-dir", run)
    assert result.returncode == 3
    assert "stage 'extract' has not run" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "train.no_such_knob=1"], "unknown config key 'train.no_such_knob'"),
        (["--set", "train.epochs=many"], "config key 'train.epochs'"),
        (["--set", "data.source=/nonexistent.jsonl"], "/nonexistent.jsonl: conversations file"),
        (["--set", "target.model=/tmp"], "/tmp: not a model"),
    ],
)
def test_bad_input_is_one_line_and_non_zero(tiny_config: Path, tmp_path: Path, args, message):
    result = eagletrain("data", tiny_config, "--run-dir", tmp_path / "run", *args)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], lines


def test_missing_config_file_is_one_line(tmp_path: Path):
    result = eagletrain("run", tmp_path / "absent.toml")
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {tmp_path / 'absent.toml'}: config file not found"


def test_changing_a_started_stage_is_refused_unless_operational(tiny_config: Path, tmp_path: Path):
    run = tmp_path / "run"
    assert eagletrain("data", tiny_config, "--run-dir", run).returncode == 0
    result = eagletrain("data", tiny_config, "--run-dir", run, "--set", "data.max_length=50")
    assert result.returncode == 2
    assert "data.max_length" in result.stderr
    # how the regenerating decoder runs is not what the dataset holds: a later call may
    # change it (on the H100 a data call was refused for compile_prefill, 2026-12-06)
    how = [
        "data.regen.compile_prefill=true",
        "data.regen.packed_prefill=true",
        "data.regen.continuous_attention=flex",
        "data.regen.continuous_refill_rows=64",
        "data.regen.continuous_prefill_positions=32",
        "data.regen.continuous_check_every=4",
    ]
    sets = [a for h in how for a in ("--set", h)]
    result = eagletrain("data", tiny_config, "--run-dir", run, *sets)
    assert result.returncode == 0, result.stderr


def test_target_dtype_is_fixed_once_a_stage_ran_the_target(tiny_config: Path, tmp_path: Path):
    """The tiny data stage only tokenizes, so the dtype may still change before extraction;
    once hidden states were made at one dtype, training at another is refused."""
    run = tmp_path / "run"
    assert eagletrain("data", tiny_config, "--run-dir", run).returncode == 0
    wider = ["--set", "target.dtype=float64"]
    assert eagletrain("extract", tiny_config, "--run-dir", run, *wider).returncode == 0
    result = eagletrain("train", tiny_config, "--run-dir", run)
    assert result.returncode == 2
    assert "target.dtype" in result.stderr and "use a new --run-dir" in result.stderr


def test_a_later_stage_refuses_another_target(tiny_config: Path, tmp_path: Path):
    """The data stage was made with one target; extracting or training with another (here
    the same architecture, other weights and a changed config) is refused, not mixed in."""
    run = tmp_path / "run"
    assert eagletrain("data", tiny_config, "--run-dir", run).returncode == 0
    other = build_tiny_target(tmp_path / "other-target", seed=1, layers=6)
    for stage in ("extract", "train"):
        result = eagletrain(stage, tiny_config, "--run-dir", run, "--set", f"target.model={other}")
        assert result.returncode == 2, (stage, result.stderr)
        assert "but this run's data stage was made with" in result.stderr
        assert eagletrain(stage, tiny_config, "--run-dir", run).returncode == 0


def test_eval_at_temperature_one_on_heldout_conversations(tiny_config: Path, tmp_path: Path):
    run = tmp_path / "run"
    overrides = ["--set", "eval.temperature=1.0", "--set", 'eval.datasets=["heldout"]']
    result = eagletrain("run", tiny_config, "--run-dir", run, *overrides)
    assert result.returncode == 0, result.stderr
    assert "sampling at T=1" in result.stdout
    (results,) = json.loads((run / "eval" / "results.json").read_text())["results"]
    assert results["temperature"] == 1.0 and results["cycles"] > 0
    assert results["tree"]["cycles"] > 0
    heldout = {
        row[0]
        for row in sqlite3.connect(run / "ledger.sqlite").execute(
            "SELECT key FROM items WHERE stage='data' AND split='heldout'"
        )
    }
    assert heldout and {p["id"] for p in results["per_prompt"]} <= heldout
    assert 1.0 <= results["tau"] <= 1 + results["draft_steps"]
    # each prompt's cycles, chain and tree, add up to the pooled figures (a paired
    # comparison of two drafters resamples them: bench/compare_drafters.py)
    for kind, per in (("cycles", results), ("tree_cycles", results["tree"])):
        assert sum(p[kind] for p in results["per_prompt"]) == per["cycles"]


def stages_detail(run: Path, stage: str) -> dict:
    import sqlite3

    conn = sqlite3.connect(run / "ledger.sqlite")
    (detail,) = conn.execute("SELECT detail FROM completions WHERE stage=?", (stage,)).fetchone()
    conn.close()
    return json.loads(detail)


def test_auto_draft_vocabulary_covers_the_training_replies(tiny_config, tmp_path):
    run = tmp_path / "run"
    overrides = [
        "--set",
        'train.draft_vocab_size="auto"',
        "--set",
        "train.draft_vocab_coverage=0.9",
    ]
    overrides += ["--set", "train.epochs=1"]
    for stage in ("data", "extract", "train"):
        result = eagletrain(stage, tiny_config, "--run-dir", run, *overrides)
        assert result.returncode == 0, result.stderr
    vocab = stages_detail(run, "train")["draft_vocab"]
    # a multiple of 256, or the whole 320-token vocabulary of the tiny target
    assert vocab["draft_vocab_size"] in (256, 320) and vocab["train_coverage"] >= 0.9
    data = stages_detail(run, "data")["assistant_tokens"]
    assert data["counted_tokens"] >= vocab["counted_tokens"] > 0  # train split within the data
