"""Packing samples into fixed-length rows: fewer padding tokens per step, and one sequence
length for every batch (flex_attention and torch.compile then build one kernel, not one
per length). Boundaries stay exact: ttt.py restarts positions and cuts attention and the
loss at each sample's edge."""

from __future__ import annotations


class SampleTooLong(ValueError):
    """A sample longer than a row: `index` (into the lengths) and its `tokens`."""

    def __init__(self, index: int, tokens: int, row_tokens: int):
        super().__init__(
            f"sample {index} has {tokens} tokens, more than a packed row's {row_tokens}"
        )
        self.index, self.tokens = index, tokens


def pack_rows(lengths: list[int], row_tokens: int) -> list[list[int]]:
    """Sample indices per row, first-fit decreasing (deterministic: ties by index). Every
    row's samples sum to at most row_tokens; a longer sample is an error of the caller's."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        if n > row_tokens:
            raise SampleTooLong(i, n, row_tokens)
        for r, free in enumerate(room):
            if n <= free:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(row_tokens - n)
    return rows
