from __future__ import annotations

import torch

from eagletrain.data.token_coverage import coverage, coverage_curve, size_for_coverage
from eagletrain.train.draft_vocab import (
    build_draft_vocab,
    cached_counts,
    resolve_size,
)


def test_most_frequent_tokens_are_chosen():
    counts = torch.tensor([5, 0, 9, 1, 7, 0])
    assert build_draft_vocab(counts, 3).tolist() == [0, 2, 4]


def test_fewer_distinct_tokens_than_size_still_gives_size_rows():
    counts = torch.tensor([0, 3, 0, 0, 8, 0])
    ids = build_draft_vocab(counts, 4)
    assert len(ids) == 4 and {1, 4} <= set(ids.tolist()) and len(set(ids.tolist())) == 4


def test_the_full_target_vocabulary_is_a_valid_draft_vocabulary():
    counts = torch.tensor([5, 0, 9, 1, 7, 0])
    assert build_draft_vocab(counts, 6).tolist() == list(range(6))


def test_auto_size_is_the_smallest_multiple_of_256_reaching_the_coverage():
    # 1,000 tokens seen, each twice as rare as the one before: a long tail
    counts = torch.zeros(4096, dtype=torch.long)
    counts[:1000] = (1e9 / 1.01 ** torch.arange(1000)).long()
    size = size_for_coverage(counts, 0.999)
    assert size % 256 == 0 and coverage(counts, size) >= 0.999
    assert coverage(counts, size - 256) < 0.999
    assert resolve_size(counts, "auto", 0.999) == size and resolve_size(counts, 512, 0.9) == 512
    assert size_for_coverage(counts, 1.0) == 1024  # every seen token, rounded up
    curve = coverage_curve(counts)
    assert curve["size_for_0.999"] == size and curve["distinct_tokens"] == 1000


def test_counts_are_cached_by_dataset_and_target(tmp_path):
    calls = []

    def tokens():
        calls.append(1)
        return [torch.tensor([1, 2, 2])]

    a = cached_counts(tmp_path, "digest-a", "target-x", tokens, 5)
    assert a.tolist() == [0, 1, 2, 0, 0]
    assert cached_counts(tmp_path, "digest-a", "target-x", tokens, 5).tolist() == a.tolist()
    assert len(calls) == 1
    cached_counts(tmp_path, "digest-b", "target-x", tokens, 5)
    cached_counts(tmp_path, "digest-a", "target-y", tokens, 5)
    assert len(calls) == 3
