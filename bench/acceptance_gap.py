"""Where served acceptance and the trainer's simulated acceptance part ways, on one run's
exported drafter: chain decoding (what is served) against the training-time-test unroll
(ttt.py, teacher forced on the same text) at the very positions where each decoding
cycle started.

    .venv/bin/python bench/acceptance_gap.py RUN_DIR [--prompts 8] [--max-new 64]
        [--chain 3] [--dataset heldout|PATH] [--model PATH] [--dtype float32] [--device auto]

Per prompt: decode greedily with chain drafting; then run the target over prompt + output
and unroll the drafter as training does. In exact arithmetic the unroll's count of leading
correct steps at a cycle's first position equals the tokens that cycle accepted (same
features, tokens, rope positions and attention pattern), so `agreement` measures train /
serve skew; the per-token figures show how much harder cycle starts (positions right
after a rejection) are than the average position the trainer reports. For held-out
prompts, the same unroll over the stored reply (the training data, as long as the served
output) shows what the trainer measured on the same conversation; `multi-newline` counts
served tokens such as SmolLM2's one-token "\n\n", which re-tokenized text never holds.
Prints a table, then `cycle_agreement=<x>` (cycles whose accepted count matched) last.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from eagletrain.evaluate import dataset_prompts, load_for_decoding
from eagletrain.extract import DataSamples
from eagletrain.rundir import reopen_run
from eagletrain.speculative import EagleProposer, speculative_greedy
from eagletrain.target import target_features
from eagletrain.ttt import TargetHead, step_weights, ttt_forward


def unrolled_accepts(model, drafter, head, ids: list[int], first_scored: int, k: int):
    """Leading correct TTT steps (at most k) at every index of `ids`, tokens from index
    `first_scored` on counting as targets."""
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    scored = torch.zeros_like(x, dtype=torch.bool)
    scored[:, first_scored:] = True
    aux_ids = list(drafter.config.eagle_aux_layer_ids)
    aux, last = target_features(model, x, torch.ones_like(scored), aux_ids)
    draft_ids = drafter.target_ids()
    in_vocab = torch.zeros(model.config.vocab_size, dtype=torch.bool, device=device)
    in_vocab[draft_ids] = True
    with torch.no_grad():
        p, argmax_in_vocab = head.distribution(last, draft_ids, in_vocab)
        result = ttt_forward(
            drafter, model.get_input_embeddings(), aux.to(drafter.fc.weight.dtype), x,
            scored, p, argmax_in_vocab, k, step_weights(k, 0.8),
        )  # fmt: skip
    return result.accepted[0].tolist()


def multi_newline(tokenizer, token: int) -> bool:
    text = tokenizer.decode([token])
    return not text.strip() and text.count("\n") >= 2


def stored_reply_acc(
    samples: DataSamples, key: str, prompt: list[int], length: int, model, drafter, head
) -> float:
    """Step-0 accuracy of the unroll over the stored reply's first `length` tokens (the
    training data for this conversation), scored as `every` is for the served output."""
    if key not in samples.rows:
        return float("nan")
    ids = samples.get(key)[0].tolist()[: len(prompt) + length]
    accepts = unrolled_accepts(model, drafter, head, ids, len(prompt) + 1, 1)
    every = [accepts[i] >= 1 for i in range(len(prompt) - 1, len(ids) - 2)]
    return sum(every) / max(len(every), 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--chain", type=int, default=3)
    parser.add_argument("--dataset", default="heldout")
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()

    run = reopen_run(args.run_dir)
    parts = load_for_decoding(run, args.dtype, args.device, args.model)
    model, tokenizer, drafter, device = parts.model, parts.tokenizer, parts.drafter, parts.device
    head = TargetHead(
        model.model.norm.weight.detach(), model.config.rms_norm_eps, model.lm_head.weight.detach()
    )
    eos, k = parts.eos, args.chain
    prompts = dataset_prompts(run, tokenizer, args.dataset, args.prompts)
    stored = DataSamples(run)

    table = Table(
        title=f"served chain {k} against the TTT unroll at the same positions, "
        f"{args.dataset}, {str(model.dtype).removeprefix('torch.')} on {device}"
    )
    for col in (
        "prompt", "cycles", "agreement", "served tau", "unrolled tau at cycle starts",
        "step-0 acc at cycle starts", "step-0 acc, every position",
        "step-0 acc, stored reply", "multi-newline tokens",
    ):  # fmt: skip
        table.add_column(col, justify="right")
    agree = total = 0
    for key, prompt in prompts:
        decoded = speculative_greedy(
            model, EagleProposer(drafter, model.get_input_embeddings()), prompt,
            args.max_new, k, eos,
        )  # fmt: skip
        out = decoded.tokens
        accepts = unrolled_accepts(model, drafter, head, prompt + out, len(prompt) + 1, k)
        served, unrolled, start = [], [], 1  # out[start] is the cycle's first draft target
        for a in decoded.accepted_per_cycle:
            if start + k >= len(out):  # the unroll needs the cycle's k targets in the text
                break
            served.append(a)
            unrolled.append(accepts[len(prompt) + start - 2])
            start += a + 1
        # every output position's step-0 prediction (index i predicts token i + 2)
        every = [accepts[i] >= 1 for i in range(len(prompt) - 1, len(prompt) + len(out) - 2)]
        stored_acc = stored_reply_acc(stored, key, prompt, len(out), model, drafter, head)
        newlines = sum(multi_newline(tokenizer, t) for t in out)
        matched = sum(s == u for s, u in zip(served, unrolled, strict=True))
        agree, total = agree + matched, total + len(served)
        n = max(len(served), 1)
        table.add_row(
            key[:12], str(len(served)), f"{matched / n:.2f}",
            f"{1 + sum(served) / n:.3f}", f"{1 + sum(unrolled) / n:.3f}",
            f"{sum(u >= 1 for u in unrolled) / n:.3f}", f"{sum(every) / max(len(every), 1):.3f}",
            f"{stored_acc:.3f}" if args.dataset == "heldout" else "-", str(newlines),
        )  # fmt: skip
        print(f"row {key} cycles={len(served)} matched={matched}", flush=True)
    Console(width=160).print(table)
    print(f"cycle_agreement={agree / max(total, 1):.3f}")


if __name__ == "__main__":
    main()
