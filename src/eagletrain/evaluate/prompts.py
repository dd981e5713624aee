"""Evaluation prompts as token ids: MT-bench and HumanEval (packaged), any JSONL with
`prompt` or `turns`, or the run's own held-out conversations."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from eagletrain.data.samples import DataSamples
from eagletrain.embedded import embedded_file, is_embedded
from eagletrain.errors import InputError
from eagletrain.runtime.rundir import Run


def load_prompts(dataset: str, limit: int | None = None) -> list[tuple[str, str]]:
    """(id, first user turn) pairs from MT-bench, HumanEval, or a JSONL with `prompt`/`turns`."""
    path = embedded_file(dataset) if is_embedded(dataset) else Path(dataset)
    if not path.is_file():
        raise InputError(f"{path}: prompts file not found")
    opener = gzip.open if path.suffix == ".gz" else open
    prompts = []
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise InputError(f"{path}:{lineno}: invalid JSON ({err.msg})") from None
            text = obj.get("turns", [None])[0] if "turns" in obj else obj.get("prompt")
            if not isinstance(text, str):
                raise InputError(f"{path}:{lineno}: no prompt text (`turns` or `prompt`)")
            prompts.append((str(obj.get("question_id", obj.get("task_id", lineno))), text))
            if limit is not None and len(prompts) >= limit:
                break
    return prompts


def heldout_prompts(run: Run, limit: int | None = None) -> list[tuple[str, list[int]]]:
    """(key, prompt ids) of held-out training conversations: each sample's tokens before
    its first assistant (loss-masked) token, i.e. the history and the generation prompt.
    Read from the data stage: decoding needs tokens only, not extracted hidden states."""
    samples = DataSamples(run)
    keys = [key for key, row in samples.rows.items() if row.split == "heldout"]
    if not keys:
        raise InputError(
            f"{run.dir}: eval.datasets holds 'heldout' but the run has no held-out split"
        )
    prompts = []
    for key in keys[:limit]:
        ids, mask = samples.get(key)
        first = int(mask.nonzero()[0]) if mask.any() else len(ids)
        if first > 0:
            prompts.append((key, ids[:first].tolist()))
    return prompts


def chat_prompts(
    tokenizer: Any, dataset: str, limit: int | None = None
) -> list[tuple[str, list[int]]]:
    out = []
    for pid, text in load_prompts(dataset, limit):
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        out.append((pid, tokenizer(chat, add_special_tokens=False)["input_ids"]))
    return out


def dataset_prompts(
    run: Run, tokenizer: Any, dataset: str, limit: int | None = None
) -> list[tuple[str, list[int]]]:
    """Prompt ids of "heldout" (the run's held-out conversations) or a prompt dataset."""
    if dataset == "heldout":
        return heldout_prompts(run, limit)
    return chat_prompts(tokenizer, dataset, limit)


def dataset_name(dataset: str) -> str:
    """ "mtbench", "humaneval", "heldout", or a prompts file's stem."""
    return Path(dataset).name.split(".")[0]
