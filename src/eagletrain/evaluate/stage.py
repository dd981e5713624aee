"""Stage 4b, eval: speculative decoding with the *exported* drafter against the target, on
every dataset of `eval.datasets`: in this process (`eval.backend = "local"`), or through a
running server that serves target + drafter (`"server"`, evaluate/server.py).

Per dataset: tau with a 95% bootstrap interval over prompts, per-position acceptance, the
share of cycles ending on a token outside the draft vocabulary, the speedup over plain
decoding; eval/results.json holds them all, the first dataset is the headline.
"""

from __future__ import annotations

import json
from typing import Any

from eagletrain.decode.tree import TreeShape
from eagletrain.evaluate.in_process import (
    Decoding,
    evaluate_prompts,
    load_for_decoding,
    sized_engine,
)
from eagletrain.evaluate.prompts import dataset_name, dataset_prompts
from eagletrain.runtime.progress import stage_progress
from eagletrain.runtime.rundir import Run, require_previous
from eagletrain.runtime.worker import WorkerSession

STAGE = "eval"


def run_eval(run: Run, allow_partial: bool = False) -> dict[str, Any]:
    ledger, cfg = run.ledger, run.config
    done = ledger.completion(STAGE)
    if done is not None:
        return done["detail"]
    require_previous(run, STAGE, allow_partial)
    ec = cfg.eval
    if ec.backend == "server":
        from eagletrain.evaluate.server import evaluate_server

        results = evaluate_server(run)
    else:
        results = _evaluate_local(run)
    out = run.path("eval", "results.json")
    out.write_text(json.dumps({"results": results}, indent=2))
    summary = {
        **{k: v for k, v in results[0].items() if k != "per_prompt"},
        "datasets": [
            {k: v for k, v in r.items() if k not in ("per_prompt", "tie_divergences")}
            for r in results
        ],
    }
    prompts = sum(r["prompts"] for r in results)
    tokens = sum(p["tokens"] for r in results for p in r["per_prompt"])
    ledger.complete(STAGE, prompts, tokens, "", allow_partial, summary)
    return summary


def _evaluate_local(run: Run) -> list[dict[str, Any]]:
    ledger, cfg, ec = run.ledger, run.config, run.config.eval
    prepack = ec.cpu_prepack and ec.engine != "compiled"
    parts = load_for_decoding(run, cfg.target.dtype, ec.device, prepack=prepack)
    prompt_sets = {d: dataset_prompts(run, parts.tokenizer, d, ec.num_prompts) for d in ec.datasets}
    settings = Decoding(
        ec.max_new_tokens,
        ec.draft_steps,
        ec.temperature,
        ec.seed,
        TreeShape(ec.tree_total_tokens, ec.tree_depth, ec.tree_topk) if ec.tree else None,
        ec.engine,
    )
    every = [p for prompts in prompt_sets.values() for p in prompts]
    ledger.begin_stage(STAGE, "units", len(every), "prompts")

    def done_prompts(led) -> int:
        return (led.stage_row(STAGE) or {}).get("units_done", 0)

    results = []
    with (
        WorkerSession(ledger, run.dir, STAGE, "0/1", done_counter=done_prompts) as worker,
        stage_progress() as bar,
    ):
        task = bar.add_task("eval", total=len(every), unit="prompts")
        # one engine for every dataset: compiled graphs and captures are made once
        engine = sized_engine(parts.model, parts.drafter, every, settings)
        before = 0
        for dataset, prompts in prompt_sets.items():

            def on_prompt(n: int, before: int = before) -> None:
                ledger.set_units_done(STAGE, before + n)
                worker.progressed()
                bar.update(task, completed=before + n)

            r = evaluate_prompts(
                parts.model, parts.drafter, prompts, settings, parts.eos, on_prompt, engine
            )
            results.append({"dataset": dataset_name(dataset), "device": str(parts.device), **r})
            before += len(prompts)
    return results


def describe(summary: dict[str, Any]) -> str:
    """One line per dataset: tau [CI], acceptance per position, out-of-vocab share, speedup,
    prompt lookup and the tree where measured."""
    lines = []
    for r in summary.get("datasets", [summary]):
        ppa = ", ".join(f"{a:.2f}" for a in r["per_position_acceptance"])
        low, high = r.get("tau_ci95", (float("nan"), float("nan")))
        mode = (
            f"greedy ({len(r.get('tie_divergences', []))} divergences at numerical ties)"
            if r["temperature"] == 0
            else f"sampling at T={r['temperature']:g} (lossless by construction)"
        )
        parts = [
            f"eval {r['dataset']}: {r['prompts']} prompts, chain {r['draft_steps']}, {mode}: "
            f"tau {r['tau']:.3f} [95% CI {low:.3f}-{high:.3f}], per position [{ppa}]"
        ]
        if r.get("out_of_vocab_share") is not None:
            parts.append(f"out-of-vocab cycles {100 * r['out_of_vocab_share']:.1f}%")
        if r.get("speedup") is not None:
            parts.append(f"speedup {r['speedup']:.2f}x on {r['device']}")
        if r.get("equal_to_plain") is not None:
            parts.append(f"equal to plain {r['equal_to_plain']}")
        line = ", ".join(parts)
        if r.get("prompt_lookup_tau") is not None:
            line += f"; prompt lookup {r['prompt_lookup_tau']:.3f}"
        tree = r.get("tree")
        if tree:
            line += (
                f"; tree ({tree['total_tokens']}/{tree['depth']}/{tree['topk']}) tau "
                f"{tree['tau']:.3f}, speedup {tree['speedup']:.2f}x"
            )
        lines.append(line)
    return "\n".join(lines)
