from __future__ import annotations

import torch

from eagletrain.train.draft_vocab import build_draft_vocab, cache_name


def test_most_frequent_tokens_are_chosen():
    counts = torch.tensor([5, 0, 9, 1, 7, 0])
    assert build_draft_vocab(counts, 3).tolist() == [0, 2, 4]


def test_fewer_distinct_tokens_than_size_still_gives_size_rows():
    counts = torch.tensor([0, 3, 0, 0, 8, 0])
    ids = build_draft_vocab(counts, 4)
    assert len(ids) == 4 and {1, 4} <= set(ids.tolist()) and len(set(ids.tolist())) == 4


def test_cache_name_depends_on_everything_it_is_built_from():
    base = cache_name("digest-a", 32000, "target-x")
    assert base != cache_name("digest-b", 32000, "target-x")
    assert base != cache_name("digest-a", 16000, "target-x")
    assert base != cache_name("digest-a", 32000, "target-y")
