"""A real vLLM (CPU build, in its own venv: scripts/vllm_venv.sh) serving the target, with
or without an exported drafter, on loopback; started as a subprocess in its own process
group and stopped by it. Used by the vLLM tests and bench/serving_engines.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 900  # a cold start compiles the model's graphs: minutes on 2 cores


def vllm_python() -> Path:
    """The vLLM venv's python, made first if missing (several minutes, once)."""
    venv = (
        subprocess.run(
            ["bash", str(ROOT / "scripts" / "vllm_venv.sh")],
            capture_output=True,
            text=True,
            check=True,
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    return (ROOT / venv if not Path(venv).is_absolute() else Path(venv)) / "bin" / "python"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def vllm_server(
    python: Path, target: Path, draft: Path | None, log: Path, steps: int = 3, eager: bool = False
) -> Iterator[str]:
    """Serve `target` (with the EAGLE-3 drafter at `draft`, chain of `steps`); yields the
    OpenAI base URL once the server answers, stops the whole process group after.
    `eager`: vLLM's --enforce-eager (no graph compilation: starts in ~50 s instead of ~2
    minutes here, decodes slower; for tests of what it computes, not how fast)."""
    with vllm_servers(python, target, [(draft, log)], steps, eager) as (url,):
        yield url


@contextlib.contextmanager
def vllm_servers(
    python: Path,
    target: Path,
    servers: list[tuple[Path | None, Path]],
    steps: int = 3,
    eager: bool = False,
) -> Iterator[list[str]]:
    """Several servers of `target`, one per (draft or None, log), started together (a
    start is mostly one core's work: loading and warming up); yields their OpenAI base
    URLs once every one answers, stops them together after."""
    procs: list[tuple[subprocess.Popen, str, Path]] = []
    try:
        for draft, log in servers:
            procs.append(_start(python, target, draft, log, steps, eager))
        deadline = time.time() + START_TIMEOUT_S
        for proc, base, log in procs:
            _wait_until_serving(proc, base, log, deadline)
        yield [f"{base}/v1" for _, base, _ in procs]
    finally:
        for proc, _, _ in procs:
            _stop(proc)


def _start(
    python: Path, target: Path, draft: Path | None, log: Path, steps: int, eager: bool
) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    cmd = [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(target),
        "--served-model-name", "smollm2", "--dtype", "float32", "--max-model-len", "2048",
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    if draft is not None:
        spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": steps}
        cmd += ["--speculative-config", json.dumps(spec)]
    if eager:
        cmd.append("--enforce-eager")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "PYTHONUNBUFFERED": "1"}
    env.pop("PYTHONPATH", None)  # the venv's own packages only
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return proc, f"http://127.0.0.1:{port}", log


def _wait_until_serving(proc: subprocess.Popen, base: str, log: Path, deadline: float) -> None:
    while True:
        if proc.poll() is not None:
            tail = "\n".join(log.read_text().splitlines()[-15:])
            raise RuntimeError(f"vLLM exited with {proc.returncode} before serving:\n{tail}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/v1/models", timeout=5).status_code == 200:
                return
        if time.time() > deadline:
            raise RuntimeError(f"vLLM did not answer within {START_TIMEOUT_S} s ({log})")
        time.sleep(2)


def _stop(proc: subprocess.Popen) -> None:
    """The whole process group: SIGTERM, then SIGKILL after 30 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
