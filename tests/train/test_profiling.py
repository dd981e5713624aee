"""train.profile_step: the run writes where three of its steps' time went."""

from __future__ import annotations

from pathlib import Path

from conftest import eagletrain


def test_profile_step_writes_the_kernel_table_of_three_steps(tiny_config: Path, tmp_path: Path):
    run = tmp_path / "run"
    sets = ["--set", "train.online=true", "--set", "train.profile_step=2"]
    for stage in ("data", "train"):
        result = eagletrain(stage, tiny_config, "--run-dir", run, *sets)
        assert result.returncode == 0, result.stderr
    written = sorted(p.name for p in (run / "train").glob("profile-*.txt"))
    assert written == ["profile-steps-2-4.txt"]
    text = (run / "train" / written[0]).read_text()
    assert text.startswith("steps 2-4: ") and "s a step (wall)" in text
    assert "aten::mm" in text or "aten::addmm" in text  # the drafter's and target's matmuls
