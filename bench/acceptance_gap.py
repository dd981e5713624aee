"""Where served acceptance and the trainer's simulated acceptance part ways, on one run's
exported drafter: chain decoding (what is served) against the training-time-test unroll
(ttt.py, teacher forced on the same text) at the very positions where each decoding
cycle started.

    .venv/bin/python bench/acceptance_gap.py RUN_DIR [--prompts 8] [--max-new 64]
        [--chain 3] [--dataset heldout|PATH] [--model PATH] [--dtype float32] [--device auto]
        [--stored N]

Per prompt: decode greedily with chain drafting; then run the target over prompt + output
and unroll the drafter as training does. In exact arithmetic the unroll's count of leading
correct steps at a cycle's first position equals the tokens that cycle accepted (same
features, tokens, rope positions and attention pattern), so `agreement` measures train /
serve skew; the per-token figures show how much harder cycle starts (positions right
after a rejection) are than the average position the trainer reports. For held-out
prompts, the same unroll over the stored reply (the training data, as long as the served
output) shows what the trainer measured on the same conversation; `multi-newline` counts
served tokens such as SmolLM2's one-token "\n\n", which re-tokenized text never holds.
With `--stored N`, a second table splits N held-out stored samples (the trainer's
held-out set) by reply (first or later assistant turn) and offset in the reply: the
trainer's step-0 accuracy per bucket, and a chain-k walk through each reply as served
decoding would take it (each cycle starts one past the previous cycle's accepted drafts),
so the trainer's every-position average can be set against served-like cycles.
Prints the tables, then `cycle_agreement=<x>` (cycles whose accepted count matched) last.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from eagletrain.data.samples import DataSamples
from eagletrain.decode.chain import speculative_chain
from eagletrain.decode.engine import DecodingEngine
from eagletrain.evaluate.in_process import load_for_decoding
from eagletrain.evaluate.prompts import dataset_prompts
from eagletrain.runtime.rundir import reopen_run
from eagletrain.target import target_features
from eagletrain.train.batches import Batch
from eagletrain.train.ttt import TargetHead, TTTSettings, step_weights, ttt_forward


def unrolled_accepts(model, drafter, head, ids: list[int], first_scored: int | list[bool], k: int):
    """Leading correct TTT steps (at most k) at every index of `ids`; the tokens counting as
    targets are those from index `first_scored` on, or those a per-token mask marks."""
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    if isinstance(first_scored, list):
        scored = torch.tensor([first_scored], dtype=torch.bool, device=device)
    else:
        scored = torch.zeros_like(x, dtype=torch.bool)
        scored[:, first_scored:] = True
    aux_ids = list(drafter.config.eagle_aux_layer_ids)
    aux, last = target_features(model, x, torch.ones_like(scored), aux_ids)
    draft_ids = drafter.target_ids()
    in_vocab = torch.zeros(model.config.vocab_size, dtype=torch.bool, device=device)
    in_vocab[draft_ids] = True
    with torch.no_grad():
        p, argmax_in_vocab = head.distribution(last, draft_ids, in_vocab)
        batch = Batch(aux.to(drafter.fc.weight.dtype), last, x, scored)
        settings = TTTSettings(k, step_weights(k, 0.8))
        embed = model.get_input_embeddings()
        result = ttt_forward(drafter, embed, batch, p, argmax_in_vocab, settings)
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


OFFSETS = ((0, 32), (32, 96), (96, 256), (256, 1 << 30))


def replies(mask: list[bool]) -> list[tuple[int, int]]:
    """[start, end) of each run of loss-masked (assistant) tokens."""
    spans, start = [], None
    for i, m in enumerate([*mask, False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def stored_by_offset(samples: DataSamples, keys: list[str], model, drafter, head, k: int):
    """Per (reply, offset bucket): [tokens, step-0 correct, walk cycles, walk accepted,
    tokens inside the draft vocab]."""
    buckets: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0])
    in_draft = set(drafter.target_ids().tolist())

    def offset_bucket(offset: int) -> int:
        return next(j for j, (a, z) in enumerate(OFFSETS) if a <= offset < z)

    for key in keys:
        ids, mask = (t.tolist() for t in samples.get(key))
        mask = [bool(m) for m in mask]
        accepts = unrolled_accepts(model, drafter, head, ids, mask, k)
        for turn, (s, e) in enumerate(replies(mask)):
            reply = "first" if turn == 0 else "later"
            for p in range(max(s, 2), e):  # index p - 2 predicts token p
                b = buckets[reply, offset_bucket(p - s)]
                b[0] += 1
                b[1] += accepts[p - 2] >= 1
                b[4] += ids[p] in in_draft
            p = s + 1  # the reply's first token is the prefill's, the first cycle drafts the next
            while p + k <= e:  # the cycle's k targets inside the reply
                b = buckets[reply, offset_bucket(p - s)]
                b[2] += 1
                b[3] += accepts[p - 2]
                p += accepts[p - 2] + 1
    return buckets


def stored_table(buckets, k: int, samples: int) -> Table:
    table = Table(title=f"{samples} held-out stored samples by reply and offset, chain {k}")
    columns = ("reply", "offset", "tokens", "share", "in draft vocab", "step-0 acc")
    for col in (*columns, "walk cycles", "walk tau"):
        table.add_column(col, justify="right")
    total = sum(b[0] for b in buckets.values())
    rows = sorted(buckets.items(), key=lambda kv: (kv[0][0] != "first", kv[0][1]))
    sums = [sum(b[i] for b in buckets.values()) for i in range(5)]
    for reply, offsets, (tokens, right, cycles, accepted, inside) in [
        *((reply, OFFSETS[j], b) for (reply, j), b in rows),
        ("all", None, sums),
    ]:
        a, z = offsets or (0, 0)
        table.add_row(
            reply, "" if offsets is None else f"{a}-{z - 1}" if z < 1 << 30 else f"{a}+",
            str(tokens), f"{tokens / total:.3f}", f"{inside / max(tokens, 1):.3f}",
            f"{right / max(tokens, 1):.3f}", str(cycles), f"{1 + accepted / max(cycles, 1):.3f}",
        )  # fmt: skip
    return table


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
    parser.add_argument("--stored", type=int, default=0, help="held-out stored samples to split")
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
        engine = DecodingEngine(model)
        decoded = speculative_chain(engine, engine.eagle(drafter), prompt, args.max_new, k, eos)
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
    if args.stored:
        keys = [i.key for i in run.ledger.items("data", "done") if i.split == "heldout"]
        keys = keys[: args.stored]
        buckets = stored_by_offset(stored, keys, model, drafter, head, k)
        Console(width=160).print(stored_table(buckets, k, len(keys)))
    print(f"cycle_agreement={agree / max(total, 1):.3f}")


if __name__ == "__main__":
    main()
