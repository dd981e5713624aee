"""A real serving engine in the loop: vLLM (CPU build) serves a demo-sized SmolLM2 drafter
that eagletrain trained and exported, in the vLLM and the speculators format.

Each export loads with the layers eagletrain trained on and no weight left out, greedy
text equals the target served alone, and vLLM's acceptance, read by `eagletrain eval`
through the server, agrees with eagletrain's own in-process evaluation of the same
prompts. The SGLang folder carries what makes vLLM read its layers right; vLLM's own
config code shows it, and that the folder without it would be read one layer early.

Bound: in exact arithmetic both decode the same greedy tokens with the same drafts, so
tau agrees exactly; float32 kernels that differ (vLLM's CPU attention, ours) can flip a
near-tied draft now and then: 3% of tau, and 0.05 per draft position.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import eagletrain
from vllm_server import vllm_python, vllm_servers

from eagletrain.config import Config
from eagletrain.target import resolve_target

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

PROMPTS, NEW_TOKENS = 8, 48
FORMATS = ("vllm", "speculators")
DEMO = f"""
[run]
name = "vllm-demo"

[target]
model = "smollm2"
dtype = "float32"
device = "cpu"

[data]
source = "sharegpt"
limit = 120
max_length = 192
heldout_fraction = 0.1
samples_per_chunk = 16

[extract]
batch_tokens = 2048

[train]
draft_vocab_size = 2048
ttt_steps = 3
epochs = 2
batch_size = 4
lr = 1e-3
warmup_steps = 5
device = "cpu"

[eval]
datasets = ["mtbench"]
num_prompts = {PROMPTS}
max_new_tokens = {NEW_TOKENS}
draft_steps = 3
tree = false
device = "cpu"
"""


@pytest.fixture(scope="module")
def python() -> Path:
    return vllm_python()


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[Path, Path]:
    """(config, run dir) of a demo-sized SmolLM2 drafter: trained and exported, not yet
    evaluated."""
    root = tmp_path_factory.mktemp("vllm-demo")
    config = root / "demo.toml"
    config.write_text(DEMO)
    run = root / "run"
    for stage in ("data", "extract", "train", "export"):
        result = eagletrain(stage, config, "--run-dir", run, timeout=900)
        assert result.returncode == 0, result.stderr
    return config, run


@pytest.fixture(scope="module")
def target() -> Path:
    return resolve_target(Config().target).directory  # the de-quantized HF directory


@pytest.fixture(scope="module")
def in_process_evaluation(demo) -> Iterator[Future]:
    """eagletrain's own evaluation of the demo, begun in the background before the servers
    start: their start keeps one of this machine's two cores idle for over a minute."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        yield pool.submit(evaluated, *demo, "in-process")


@pytest.fixture(scope="module")
def servers(
    python, target, demo, in_process_evaluation, tmp_path_factory
) -> Iterator[dict[str, tuple[str, Path]]]:
    """name ("plain" or a format) -> (base URL, log): the target alone and with each
    export, started together and stopped after the module."""
    _, run = demo
    logs = tmp_path_factory.mktemp("vllm-logs")
    drafts = {"plain": None, **{fmt: run / "export" / fmt for fmt in FORMATS}}
    wanted = [(draft, logs / f"{name}.log") for name, draft in drafts.items()]
    with vllm_servers(python, target, wanted, eager=True) as urls:
        yield {name: (url, log) for name, url, (_, log) in zip(drafts, urls, wanted, strict=True)}


def evaluated(config: Path, run: Path, name: str, *overrides: str) -> dict:
    """The run evaluated in a copy of its directory; the results of its one dataset."""
    copy = run.parent / name
    shutil.copytree(run, copy)
    result = eagletrain("eval", config, "--run-dir", copy, *overrides, timeout=1200)
    assert result.returncode == 0, result.stderr
    (only,) = json.loads((copy / "eval" / "results.json").read_text())["results"]
    return only


@pytest.fixture(scope="module")
def in_process(in_process_evaluation) -> dict:
    return in_process_evaluation.result()


@pytest.mark.parametrize("fmt", FORMATS)
def test_vllm_serves_the_export_as_eagletrain_evaluates_it(fmt, demo, servers, in_process):
    config, run = demo
    url, log = servers[fmt]
    served = evaluated(
        config, run, f"served-{fmt}",
        "--set", 'eval.backend="server"',
        "--set", f'eval.server.base_url="{url}"',
        "--set", f'eval.server.plain_base_url="{servers["plain"][0]}"',
        "--set", 'eval.server.model="smollm2"',
    )  # fmt: skip
    text = log.read_text()  # while it serves: vLLM logs its own shutdown as errors
    # the layers eagletrain trained on (outputs of 1, 14, 26), in vLLM's convention
    assert "Using auxiliary layers from speculative config: (2, 15, 27)" in text
    # vLLM names weights a checkpoint left out ("were not initialized from checkpoint")
    for sign in ("were not initialized", "Traceback", "KeyError"):
        assert sign not in text, sign
    assert "Loading drafter model" in text
    assert served["equal_to_plain"] == f"{PROMPTS}/{PROMPTS}"  # greedy: lossless
    assert served["prompts"] == in_process["prompts"] == PROMPTS
    assert in_process["tau"] > 1.05  # the drafter was trained: there is something to agree on
    assert served["tau"] == pytest.approx(in_process["tau"], rel=0.03)
    for ours, theirs in zip(
        in_process["per_position_acceptance"], served["per_position_acceptance"], strict=True
    ):
        assert theirs == pytest.approx(ours, abs=0.05)
    low, high = served["tau_ci95"]
    assert low <= served["tau"] <= high
    assert served["speculative_tokens_per_s"] > 0 and served["plain_tokens_per_s"] > 0


def test_the_sglang_folder_is_read_right_by_vllms_own_config_code(python, demo, tmp_path):
    _, run = demo
    # the model runner's own method (the CPU runner's too: it logged the served ids above),
    # on the drafter config as vLLM loads it
    probe = """
import sys
from types import SimpleNamespace
from vllm.transformers_utils.config import get_config
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
config = get_config(sys.argv[1], trust_remote_code=False)
spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=config))
runner = SimpleNamespace(speculative_config=spec)
print(list(GPUModelRunner._get_eagle3_aux_layers_from_config(runner)))
"""

    def vllm_reads(folder: Path) -> list[int]:
        out = subprocess.run(
            [str(python), "-c", probe, str(folder)], capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    sglang = run / "export" / "sglang"
    assert vllm_reads(sglang) == [2, 15, 27] == vllm_reads(run / "export" / "vllm")
    # the same folder as SGLang alone would have it: vLLM would capture one layer early
    bare = tmp_path / "sglang-bare"
    shutil.copytree(sglang, bare)
    config = json.loads((bare / "config.json").read_text())
    del config["eagle_aux_hidden_state_layer_ids"]
    (bare / "config.json").write_text(json.dumps(config))
    assert vllm_reads(bare) == [1, 14, 26]
