"""The run directory: its resolved config, its ledger, and the gate between stages."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from eagletrain.config import Config, config_diff, dump_toml, load_config
from eagletrain.errors import ConfigError, GateError
from eagletrain.runtime.ledger import Ledger
from eagletrain.stages import STAGES, previous_stage

CONFIG_NAME = "config.toml"
# Keys that say how to run, not what the run is: they may change when a run is reopened.
OPERATIONAL_KEYS = {
    "target.device",
    "train.device",
    "eval.device",
    "extract.check_space",
    "extract.writer_threads",
    # how to reach and read the engine's files, not what the dataset holds (aux_layer_ids)
    *(
        f"extract.engine.{k}"
        for k in (
            "dump_dir",
            "convention",
            "layer_ids",
            "base_url",
            "api_key_env",
            "concurrency",
            "timeout_s",
            "max_retries",
        )
    ),
    *(
        f"data.regen.{k}"
        for k in (
            "base_url",
            "api_key_env",
            "concurrency",
            "timeout_s",
            "max_retries",
            "backoff_base_s",
            "backoff_max_s",
            "circuit_failures",
            "circuit_cooldown_s",
            "circuit_max_trips",
            "batch_size",
            "in_flight_batches",
            "decoder",
            "continuous_attention",
            "packed_prefill",
            "compile_prefill",
            "continuous_refill_rows",
            "continuous_prefill_positions",
            "continuous_check_every",
            "kv_cache",
            "attention",
            "sdpa_cudnn",
        )
    ),
}

# Where the target is, checked by identity instead (require_data_target): a run directory
# and its model files may move between machines.
TARGET_LOCATION_KEYS = {"target.model", "target.gguf_file"}


@dataclass
class Run:
    dir: Path
    config: Config
    ledger: Ledger

    def path(self, *parts: str) -> Path:
        p = self.dir.joinpath(*parts)
        p.parent.mkdir(parents=True, exist_ok=True)
        return p


def ran_target(config: Config, started: set[str]) -> bool:
    """Whether a started stage ran the target's forward, whose dtype its output then carries
    (regenerated replies, hidden states, the online training signal)."""
    return (
        ("data" in started and config.data.regenerate == "local")
        or "extract" in started
        or "train" in started
    )


def default_run_dir(config: Config) -> Path:
    return Path("runs") / config.run.name


def open_run(config: Config, run_dir: Path | None) -> Run:
    """Create or reopen a run directory, writing the fully resolved config at start.

    Reopening with a config that changes a stage already started is refused: the run
    directory is the record of one configuration.
    """
    run_dir = run_dir or default_run_dir(config)
    run_dir.mkdir(parents=True, exist_ok=True)
    ledger = Ledger(run_dir, create=True)
    config_path = run_dir / CONFIG_NAME
    if config_path.is_file():
        previous = load_config(config_path)
        started = {s for s in STAGES if ledger.stage_row(s) is not None}
        fixed = started | ({"target"} if ran_target(previous, started) else set())
        conflicts = [
            k
            for k in config_diff(previous, config)
            if k not in OPERATIONAL_KEYS | TARGET_LOCATION_KEYS and k.split(".")[0] in fixed
        ]
        if conflicts:
            raise ConfigError(
                f"{config_path}: this run already started with different values for "
                f"{', '.join(conflicts)}; use a new --run-dir"
            )
    tmp = config_path.with_suffix(f".tmp{os.getpid()}")  # ranks may open it together
    tmp.write_text(dump_toml(config))
    os.replace(tmp, config_path)
    return Run(run_dir, config, ledger)


def reopen_run(run_dir: Path) -> Run:
    config_path = run_dir / CONFIG_NAME
    if not config_path.is_file():
        raise ConfigError(f"{run_dir}: not a run directory (no {CONFIG_NAME})")
    return Run(run_dir, load_config(config_path), Ledger(run_dir, create=True))


def require_data_target(run: Run, identity: str) -> None:
    """A later stage's target must be the one the data stage regenerated and tokenized with
    (by identity: a GGUF's hash, an HF directory's config, not its path, which may move)."""
    made_with = (run.ledger.stage_row("data") or {}).get("detail", {}).get("target")
    if made_with is not None and made_with != identity:
        raise ConfigError(
            f"target.model {run.config.target.model} is {identity}, but this run's data stage "
            f"was made with {made_with}; use that target or a new --run-dir"
        )


def require_previous(run: Run, stage: str, allow_partial: bool) -> None:
    """The gate: a stage starts only on its predecessor's verified completion record (a
    stage the run skips is passed over)."""
    prev = previous_stage(stage, run.config.skipped_stages)
    if prev is None or run.ledger.completion(prev) is not None:
        return
    row = run.ledger.stage_row(prev)
    if row is None and not allow_partial:
        raise GateError(
            f"{stage}: refusing to start: stage {prev!r} has not run (eagletrain {prev})"
        )
    counts = run.ledger.counts(prev)
    total = row["total"] if row else 0
    done = (
        counts.get("done", 0)
        if row and row["kind"] == "items"
        else (row or {}).get("units_done", 0)
    )
    shortfall = f"{done} of {total} {row['unit'] if row else 'items'} present"
    if allow_partial and row is not None:
        run.ledger.begin_stage(stage, "items", 0, "items")
        run.ledger.update_detail(stage, allow_partial=f"started on partial {prev}: {shortfall}")
        return
    raise GateError(
        f"{stage}: refusing to start: stage {prev!r} is not verified complete ({shortfall}); "
        f"finish it (eagletrain {prev}) or pass --allow-partial"
    )
