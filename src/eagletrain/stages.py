"""The pipeline's stages, in order, and which a run skips (kept free of imports so `status`
starts fast)."""

STAGES = ("data", "extract", "train", "export", "eval")
# data.source "self": the prompts the target writes itself, a sub-stage the data stage runs
# first (data/self_prompts.py); shown by `status` when a run has it
PROMPTS = "prompts"


def skipped_stages(train_online: bool) -> dict[str, str]:
    """The stages a run does not run, each with the reason: the one place that decides it."""
    if train_online:
        return {"extract": "train.online: the target runs inside the training job"}
    return {}


def previous_stage(stage: str, skipped: dict[str, str]) -> str | None:
    """The stage whose verified completion `stage` waits for (skipped ones passed over)."""
    earlier = [s for s in STAGES[: STAGES.index(stage)] if s not in skipped]
    return earlier[-1] if earlier else None
