"""The command line: a thin layer over the stage entry points."""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from eagletrain.errors import EagletrainError, InputError, VerifyError
from eagletrain.runtime.faults import install as install_faults
from eagletrain.runtime.launcher import die_with_launcher
from eagletrain.stages import STAGES

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Train EAGLE-3 drafters end to end: resumable, verifiable, observable.",
)

ConfigArg = Annotated[Path, typer.Argument(help="TOML config file.")]
RunDirOpt = Annotated[
    Path | None, typer.Option("--run-dir", help="Run directory (default runs/<run.name>).")
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", help="Override a config field: key.path=value (repeatable)."),
]
PartialOpt = Annotated[
    bool,
    typer.Option(
        "--allow-partial",
        help="Start even if the previous stage is incomplete (recorded in the ledger).",
    ),
]
ShardOpt = Annotated[
    str | None,
    typer.Option(
        "--shard",
        help="Work on partition i of N (i/N, 0-based); under torchrun "
        "the default is RANK/WORLD_SIZE.",
    ),
]


def _quiet_libraries() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    import warnings

    import transformers

    warnings.filterwarnings("ignore", category=FutureWarning)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _fail(err: Exception, code: int) -> None:
    typer.echo(f"error: {err}", err=True)
    raise typer.Exit(code)


def _guarded(fn):
    """Expected failures become one line on stderr and a non-zero exit, never a traceback."""

    def wrapper(*args, **kwargs):
        # SIGINT stops a stage cleanly (resumable, `status` says stopped) even when the
        # launcher ignored it, as a shell does for a background job, which Python inherits
        signal.signal(signal.SIGINT, signal.default_int_handler)
        # `kill -USR1 PID` prints every thread's stack to stderr: where a quiet stage is
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
        die_with_launcher()  # under torchrun: no rank outlives a killed torchrun
        install_faults()  # the reliability tests' simulated full disk, when asked for
        try:
            return fn(*args, **kwargs)
        except EagletrainError as err:
            _fail(err, err.exit_code)
        except KeyboardInterrupt:
            _fail(Exception("interrupted; rerun the same command to resume"), 130)
        except OSError as err:
            if err.errno == 28:  # ENOSPC
                _fail(Exception(f"disk full: {err.filename or ''} {err.strerror}"), 7)
            raise

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    wrapper.__wrapped__ = fn
    return wrapper


def _partition(text: str | None) -> tuple[int, int]:
    """--shard i/N, else a torchrun rank (RANK/WORLD_SIZE), else the whole stage."""
    if text is None:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        return (int(os.environ.get("RANK", "0")), world) if world > 1 else (0, 1)
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise InputError(f"--shard {text!r}: expected i/N, e.g. 0/4") from None
    if not (n >= 1 and 0 <= i < n):
        raise InputError(f"--shard {text!r}: need 0 <= i < N")
    return i, n


def _served_target(run) -> str:
    """The target as an engine loads it: its HF directory (a GGUF's de-quantized copy)."""
    from eagletrain.target import resolve_target

    return str(resolve_target(run.config.target).directory)


def _open(config: Path, run_dir: Path | None, overrides: list[str] | None):
    from eagletrain.config import load_config
    from eagletrain.runtime.rundir import open_run

    _quiet_libraries()
    return open_run(load_config(config, overrides or []), run_dir)


@app.command()
@_guarded
def run(
    config: ConfigArg,
    run_dir: RunDirOpt = None,
    set_: SetOpt = None,
    allow_partial: PartialOpt = False,
) -> None:
    """Run every stage in order, resuming whatever is already done."""
    from eagletrain.pipeline import run_all

    r = _open(config, run_dir, set_)
    typer.echo(f"run directory: {r.dir}")
    start = time.time()
    results = run_all(r, allow_partial)
    ev = results["eval"]
    from eagletrain.export import serve_commands

    typer.echo(f"export: {r.dir / 'export'} (sglang, vllm, speculators)")
    for line in serve_commands(r.dir / "export", _served_target(r), r.config.eval.draft_steps):
        typer.echo(f"serve with {line}")
    typer.echo(
        f"pipeline finished in {time.time() - start:.0f}s; "
        f"`eagletrain status {r.dir}` shows every stage"
    )
    from eagletrain.evaluate.stage import describe

    typer.echo(describe(ev))
    typer.echo(f"tau={ev['tau']:.3f}")


RepairOpt = Annotated[
    bool,
    typer.Option(
        "--repair",
        help="extract only: re-extract exactly the samples verify finds bad.",
    ),
]


def _stage_command(stage: str, sharded: bool):
    def command(
        config: ConfigArg,
        run_dir: RunDirOpt = None,
        set_: SetOpt = None,
        allow_partial: PartialOpt = False,
        shard: ShardOpt = None,
        repair: RepairOpt = False,
    ) -> None:
        from eagletrain.pipeline import stage_runners

        if shard is not None and not sharded:
            raise InputError(f"--shard applies to data and extract, not {stage}")
        # under torchrun, train splits each batch between the ranks itself
        partition = _partition(shard) if sharded else (0, 1)
        if repair and stage != "extract":
            raise InputError(f"--repair applies to extract, not {stage}")
        r = _open(config, run_dir, set_)
        if stage in r.config.skipped_stages:
            typer.echo(f"{stage}: skipped ({r.config.skipped_stages[stage]})")
            return
        result = stage_runners(partition, allow_partial, repair)[stage](r)
        if stage == "extract" and repair:
            typer.echo(f"repaired {len(result)} samples: {' '.join(result)}")
        if stage == "export":
            from eagletrain.export import serve_commands

            typer.echo(f"export: {result} ({', '.join(p.name for p in sorted(result.iterdir()))})")
            if weights := _exported_weights(r):
                typer.echo(weights)
            for line in serve_commands(result, _served_target(r), r.config.eval.draft_steps):
                typer.echo(f"serve with {line}")
        elif stage == "eval":
            typer.echo(f"tau={result['tau']:.3f}")
        from eagletrain.runtime.status import format_line, stage_status

        typer.echo(format_line(stage_status(r.ledger, stage)))

    command.__doc__ = f"Run the {stage} stage (resumes; skips if already verified complete)."
    command.__name__ = stage
    return _guarded(command)


def _exported_weights(r) -> str | None:
    w = r.ledger.completion("export")["detail"].get("weights")  # None: exported before 12-07
    if w is None:
        return None
    how = "best held-out evaluation" if w["evaluated"] else "not evaluated"
    line = f"weights: train/{w['directory']} (step {w['step']}, {how})"
    if w["newest_step"] > w["step"]:
        line += f"; step {w['newest_step']} is saved too: --set export.weights=latest takes it"
    return line


for _stage in STAGES:
    app.command(name=_stage)(_stage_command(_stage, _stage in ("data", "extract")))


@app.command()
@_guarded
def status(
    run_dir: Annotated[Path, typer.Argument(help="Run directory.")],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable.")] = False,
) -> None:
    """Per stage: running / stalled / dead / done / failed / pending, N of M, rate, ETA."""
    from eagletrain.runtime.status import format_line, run_status

    stages = run_status(run_dir)
    if as_json:
        typer.echo(json.dumps([s.as_dict() for s in stages], indent=2))
        return
    for st in stages:
        typer.echo(format_line(st))


@app.command()
@_guarded
def verify(
    run_dir: Annotated[Path, typer.Argument(help="Run directory.")],
    stage: Annotated[str | None, typer.Option("--stage", help="Only this stage.")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="Skip re-hashing data.")] = False,
) -> None:
    """Re-check a stage's output against the ledger; write or revoke its completion record."""
    from eagletrain.runtime.rundir import reopen_run
    from eagletrain.runtime.verify import SHARDED_STAGES, finalize_items_stage, verify_stage

    if stage is not None and stage not in STAGES:
        raise InputError(f"--stage {stage!r}: expected one of {', '.join(STAGES)}")
    r = reopen_run(run_dir)
    failures = []
    for name in [stage] if stage else [s for s in SHARDED_STAGES]:
        if r.ledger.stage_row(name) is None:
            typer.echo(f"{name}: not started")
            continue
        report = verify_stage(r.dir, r.ledger, name, deep=not quick)
        if report.bad:
            r.ledger.revoke_completion(name)
            failures.append(report.summary())
            typer.echo("\n".join(report.lines()))
            continue
        if not report.unfinished and r.ledger.completion(name) is None:
            finalize_items_stage(r.dir, r.ledger, name, deep=not quick)
        typer.echo(report.summary())
    if failures:
        raise VerifyError(f"verification failed for {len(failures)} stage(s)")


@app.command()
@_guarded
def report(run_dir: Annotated[Path, typer.Argument(help="Run directory.")]) -> None:
    """Write RUN_DIR/report/report.md with PNG plots: training curves, tau per dataset
    against prompt lookup, per-position acceptance, stage timings."""
    from eagletrain.report import write_report
    from eagletrain.runtime.rundir import reopen_run

    typer.echo(f"report: {write_report(reopen_run(run_dir))}")


def main() -> None:  # pragma: no cover
    sys.exit(app())
