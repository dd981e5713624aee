"""Evaluation through a running server that serves the target with the drafter
(`eval.backend = "server"`): for targets too large to load here, and to measure the engine
that will actually serve the drafter.

Prompts go one at a time, as the token ids in-process evaluation uses, so each prompt's
acceptance and batch-1 timing are its own. Acceptance comes from the server's counters:
vLLM's Prometheus counters at GET /metrics, read before and after each request
(`vllm:spec_decode_num_drafts_total`, `..._num_accepted_tokens_total`,
`..._num_accepted_tokens_per_pos_total{position}`; tau = 1 + accepted / drafts); SGLang's
`meta_info` of each /generate response (tau = completion_tokens / spec_verify_ct). With
`eval.server.plain_base_url`, the same requests to the target served alone give tokens/s
without the drafter, the speedup, and at T = 0 a check that the outputs are equal.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from eagletrain.config import EvalServerConfig
from eagletrain.decode.acceptance import tau_interval
from eagletrain.errors import InputError
from eagletrain.evaluate.prompts import dataset_name, dataset_prompts
from eagletrain.runtime.progress import stage_progress
from eagletrain.runtime.rundir import Run
from eagletrain.runtime.worker import WorkerSession
from eagletrain.target import load_tokenizer, resolve_target

STAGE = "eval"
VLLM = "vllm:spec_decode_num_"


@dataclass
class Counters:
    """A server's speculative-decoding counters at one moment (or a difference of two)."""

    drafts: float = 0.0
    accepted: float = 0.0
    per_position: dict[int, float] = field(default_factory=dict)

    def plus(self, other: Counters, sign: float = 1.0) -> Counters:
        keys = set(self.per_position) | set(other.per_position)
        return Counters(
            self.drafts + sign * other.drafts,
            self.accepted + sign * other.accepted,
            {k: self.per_position.get(k, 0.0) + sign * other.per_position.get(k, 0.0)
             for k in keys},
        )  # fmt: skip


def vllm_counters(metrics_text: str) -> Counters:
    """vLLM's spec-decode counters from its Prometheus text, summed over engines."""
    out = Counters()
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == f"{VLLM}drafts_total":
                out.drafts += sample.value
            elif sample.name == f"{VLLM}accepted_tokens_total":
                out.accepted += sample.value
            elif sample.name == f"{VLLM}accepted_tokens_per_pos_total":
                position = int(sample.labels["position"])
                out.per_position[position] = out.per_position.get(position, 0.0) + sample.value
    return out


class ServedModel:
    """One server: a completion of prompt ids, with the speculative counts it spent."""

    def __init__(self, cfg: EvalServerConfig, base_url: str, speculative: bool):
        key = os.environ.get(cfg.api_key_env, "")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.cfg, self.speculative = cfg, speculative
        self.root = base_url.rstrip("/").removesuffix("/v1")
        self.http = httpx.Client(headers=headers, timeout=cfg.timeout_s)

    def _post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        try:
            response = self.http.post(self.root + path, json=payload)
        except httpx.HTTPError as err:
            raise InputError(f"{self.root}{path}: {type(err).__name__}: {err}") from None
        if response.status_code != 200:
            raise InputError(
                f"{self.root}{path}: HTTP {response.status_code}: {response.text[:200]}"
            )
        return response.json()

    def _counters(self) -> Counters:
        if not self.speculative or self.cfg.engine != "vllm":
            return Counters()
        response = self.http.get(self.root + "/metrics")
        return vllm_counters(response.text)

    def complete(
        self, ids: list[int], max_new: int, temperature: float, seed: int
    ) -> tuple[str, int, float, Counters]:
        """(text, completion tokens, seconds, counters spent) of one request."""
        before = self._counters()
        start = time.perf_counter()
        if self.cfg.engine == "sglang":
            sampling = {"max_new_tokens": max_new, "temperature": temperature}
            body = self._post("/generate", {"input_ids": ids, "sampling_params": sampling})
            seconds = time.perf_counter() - start
            meta = body.get("meta_info") or {}
            tokens = int(meta.get("completion_tokens") or 0)
            cycles = float(meta.get("spec_verify_ct") or 0)
            # SGLang counts verifications; each adds one token of the target's own
            spent = Counters(cycles, tokens - cycles) if self.speculative else Counters()
            return str(body.get("text", "")), tokens, seconds, spent
        payload = {
            "model": self.cfg.model,
            "prompt": ids,
            "max_tokens": max_new,
            "temperature": temperature,
            "seed": seed,
        }
        body = self._post("/v1/completions", payload)
        seconds = time.perf_counter() - start
        tokens = int((body.get("usage") or {}).get("completion_tokens") or 0)
        return body["choices"][0]["text"], tokens, seconds, self._counters().plus(before, -1.0)


def _dataset_result(
    dataset: str,
    prompts: list[tuple[str, list[int]]],
    run: Run,
    served: ServedModel,
    plain: ServedModel | None,
    on_prompt: Any,
) -> dict[str, Any]:
    ec = run.config.eval
    cfg = ec.server
    per_prompt, spent = [], Counters()
    spec_s = plain_s = 0.0
    equal = 0
    for i, (pid, ids) in enumerate(prompts):
        seed = ec.seed * 100_003 + i
        text, tokens, seconds, counts = served.complete(
            ids, ec.max_new_tokens, ec.temperature, seed
        )
        spent = Counters(
            spent.drafts + counts.drafts,
            spent.accepted + counts.accepted,
            {k: spent.per_position.get(k, 0.0) + v for k, v in counts.per_position.items()},
        )
        spec_s += seconds
        row = {"id": pid, "tokens": tokens, "cycles": counts.drafts, "accepted": counts.accepted,
               "spec_s": seconds}  # fmt: skip
        if plain is not None:
            plain_text, plain_tokens, seconds, _ = plain.complete(
                ids, ec.max_new_tokens, ec.temperature, seed
            )
            plain_s += seconds
            equal += plain_text == text
            row |= {"plain_tokens": plain_tokens, "plain_s": seconds, "equal": plain_text == text}
        per_prompt.append(row)
        on_prompt(i + 1)
    tokens = sum(p["tokens"] for p in per_prompt)
    drafts = spent.drafts
    low, high = tau_interval([(p["cycles"] + p["accepted"], p["cycles"]) for p in per_prompt])
    positions = sorted(spent.per_position)
    result = {
        "dataset": dataset,
        "device": f"server {cfg.engine} at {cfg.base_url}",
        "backend": "server",
        "prompts": len(prompts),
        "draft_steps": ec.draft_steps,
        "temperature": ec.temperature,
        "cycles": drafts,
        "tau": 1 + spent.accepted / drafts if drafts else None,
        "tau_ci95": [low, high],
        "per_position_acceptance": [spent.per_position[k] / drafts for k in positions]
        if drafts
        else [],
        "out_of_vocab_share": None,  # the server's counters do not say which token ended a cycle
        "speculative_seconds": spec_s,
        "speculative_tokens_per_s": tokens / spec_s if spec_s else None,
        "per_prompt": per_prompt,
    }
    if plain is not None:
        plain_tokens = sum(p["plain_tokens"] for p in per_prompt)
        result |= {
            "plain_seconds": plain_s,
            "plain_tokens_per_s": plain_tokens / plain_s if plain_s else None,
            "speedup": (plain_s / plain_tokens) / (spec_s / tokens) if tokens and plain_s else None,
            "equal_to_plain": f"{equal}/{len(prompts)}",
        }
    return result


def evaluate_server(run: Run) -> list[dict[str, Any]]:
    """Every dataset of eval.datasets through the server; one result per dataset."""
    ec, ledger, cfg = run.config.eval, run.ledger, run.config.eval.server
    tokenizer = load_tokenizer(resolve_target(run.config.target))
    prompt_sets = {d: dataset_prompts(run, tokenizer, d, ec.num_prompts) for d in ec.datasets}
    total = sum(len(p) for p in prompt_sets.values())
    ledger.begin_stage(STAGE, "units", total, "prompts")
    results, before = [], 0

    def done_prompts(led) -> int:
        return (led.stage_row(STAGE) or {}).get("units_done", 0)

    served = ServedModel(cfg, cfg.base_url, speculative=True)
    plain = ServedModel(cfg, cfg.plain_base_url, False) if cfg.plain_base_url else None
    with (
        WorkerSession(ledger, run.dir, STAGE, "0/1", done_counter=done_prompts) as worker,
        stage_progress() as bar,
        served.http,
        plain.http if plain else contextlib.nullcontext(),
    ):
        task = bar.add_task("eval (server)", total=total, unit="prompts")
        for dataset, prompts in prompt_sets.items():

            def on_prompt(n: int, before: int = before) -> None:
                ledger.set_units_done(STAGE, before + n)
                worker.progressed()
                bar.update(task, completed=before + n)

            name = dataset_name(dataset)
            results.append(_dataset_result(name, prompts, run, served, plain, on_prompt))
            before += len(prompts)
    return results
