from __future__ import annotations

from pathlib import Path

from eagletrain.config import load_config


def test_an_old_runs_eval_dataset_meets_a_datasets_override(tmp_path: Path):
    """A run directory from before `eval.datasets` (one `eval.dataset`) loads with a
    `--set eval.datasets=...` override: the file's key is renamed before the override."""
    config = tmp_path / "config.toml"
    config.write_text('[eval]\ndataset = "/tmp/c/question.jsonl"\nnum_prompts = 6\n')
    assert load_config(config).eval.datasets == ["/tmp/c/question.jsonl"]
    loaded = load_config(config, ['eval.datasets=["a.jsonl", "heldout"]'])
    assert loaded.eval.datasets == ["a.jsonl", "heldout"]
