"""Which draft vocabulary keeps out-of-vocabulary cycles under a goal, measured before
training. The run's assistant-token counts (its training samples, as the trainer counts
them) give each coverage target's "auto" size and its vocabulary; the target's own greedy
replies to an eval set (transformers' generate, one prompt at a time: the tokens a
lossless speculative decode emits) give the share of emitted tokens outside each
vocabulary. Every such token ends a decoding cycle (no draft can propose it), so the
share of cycles ending out of vocabulary is that token share times tau (tokens a cycle).

`--vocab EXPORT_DIR` adds the vocabulary of an exported drafter (its d2t), to check the
estimate against that drafter's measured out-of-vocab share.

    python bench/vocab_coverage.py RUN_DIR [--datasets mtbench] [--prompts 80]
        [--max-new 128] [--coverages 0.999,0.9995,0.9999,1.0] [--tau 2.0] [--vocab DIR]

Prints a table, then `oov_cycles_<dataset>_<coverage>=<share>` last: the first dataset's
smallest coverage whose estimate is under 2% (or the largest tried).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from eagletrain.config import TargetConfig, load_config
from eagletrain.data.samples import DataSamples
from eagletrain.data.token_coverage import count_tokens, size_for_coverage
from eagletrain.evaluate.prompts import chat_prompts
from eagletrain.export import load_exported
from eagletrain.runtime.ledger import Ledger
from eagletrain.runtime.rundir import CONFIG_NAME, Run
from eagletrain.target import load_target, load_tokenizer, resolve_target, target_eos
from eagletrain.train.draft_vocab import build_draft_vocab

GOAL = 0.02


def training_tokens(run_dir: Path):
    """The assistant (loss-masked) tokens of the run's training samples (held-out ones
    left out, as the trainer counts them)."""
    run = Run(run_dir, load_config(run_dir / CONFIG_NAME), Ledger(run_dir, create=False))
    samples = DataSamples(run)
    for item in run.ledger.items("data", "done"):
        if item.split != "heldout":
            ids, mask = samples.get(item.key)
            yield ids[mask.bool()]


@torch.inference_mode()
def greedy_replies(model, prompts: list[list[int]], max_new: int, eos: set[int]) -> list[int]:
    out: list[int] = []
    for n, prompt in enumerate(prompts, 1):
        ids = torch.tensor([prompt], device=model.device)
        new = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
            do_sample=False, eos_token_id=sorted(eos), pad_token_id=sorted(eos)[0],
        )[0, len(prompt) :].tolist()  # fmt: skip
        out.extend(t for t in new if t not in eos)
        if n % 10 == 0:
            print(f"  {n}/{len(prompts)} prompts answered", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--datasets", default="mtbench")
    parser.add_argument("--prompts", type=int, default=80)
    parser.add_argument("--max-new", type=int, default=128)
    parser.add_argument("--coverages", default="0.999,0.9995,0.9999,1.0")
    parser.add_argument("--tau", type=float, default=2.0, help="tokens a cycle, for the estimate")
    parser.add_argument("--vocab", type=Path, default=None, help="an export dir: its d2t too")
    parser.add_argument("--model", default="smollm2")
    args = parser.parse_args()

    source = resolve_target(TargetConfig(model=args.model))
    model = load_target(source, "float32", torch.device("cpu")).eval()
    tokenizer = load_tokenizer(source)
    eos = target_eos(model, tokenizer)
    vocab_size = model.config.vocab_size
    counts = count_tokens(training_tokens(args.run_dir), vocab_size)
    print(f"{int(counts.sum())} assistant tokens of training samples in {args.run_dir}")
    vocabs: dict[str, torch.Tensor] = {}
    for share in (float(c) for c in args.coverages.split(",")):
        size = vocab_size if share >= 1 else size_for_coverage(counts, share)
        vocabs[f"{share:g}"] = build_draft_vocab(counts, size)
    if args.vocab is not None:
        vocabs[f"export {args.vocab.name}"] = load_exported(args.vocab).target_ids()

    table = Table(title=f"out-of-vocab estimate from the target's greedy replies, tau {args.tau}")
    for col in ("dataset", "vocabulary", "size", "train-data coverage", "emitted tokens",
                "out of vocab", "token share", "est. cycle share"):  # fmt: skip
        table.add_column(col, justify="right")
    headline = None
    for dataset in args.datasets.split(","):
        prompts = [ids for _, ids in chat_prompts(tokenizer, dataset, args.prompts)]
        replies = torch.tensor(greedy_replies(model, prompts, args.max_new, eos))
        for name, vocab in vocabs.items():
            inside = torch.zeros(vocab_size, dtype=torch.bool)
            inside[vocab] = True
            outside = int((~inside[replies]).sum())
            share = outside / len(replies)
            covered = float(counts[inside].sum() / counts.sum())
            table.add_row(dataset, name, str(len(vocab)), f"{covered:.4%}", str(len(replies)),
                          str(outside), f"{share:.2%}", f"{share * args.tau:.2%}")  # fmt: skip
            first = dataset == args.datasets.split(",")[0]
            if (
                first
                and not name.startswith("export")
                and (headline is None or headline[2] >= GOAL)
            ):
                headline = (dataset, name, share * args.tau)
    Console(width=160).print(table)
    dataset, name, estimate = headline
    print(f"oov_cycles_{dataset}_{name}={estimate:.4f}")


if __name__ == "__main__":
    main()
