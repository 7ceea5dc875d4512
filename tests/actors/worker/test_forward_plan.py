"""How a worker step's rows are cut into forwards (actors.worker.forward_plan.forward_groups): the
cheapest split under its cost model, checked against every split by brute force."""

from __future__ import annotations

import itertools
import random

from actors.model.batch import linear_row
from actors.worker.forward_plan import forward_groups


def _rows(lengths: list[int]) -> dict:
    return {i: linear_row(i, 0, [1] * n, 0, [n - 1]) for i, n in enumerate(lengths)}


def _cost(groups: list[dict], overhead: int) -> int:
    return sum(overhead + len(group) * max(len(row) for row in group.values()) for group in groups)


def _cheapest_split(lengths: list[int], overhead: int) -> int:
    """The least cost over every partition of the rows into forwards (brute force)."""
    best = None
    indices = list(range(len(lengths)))
    for labels in itertools.product(range(len(lengths)), repeat=len(lengths)):
        groups = {}
        for index, label in zip(indices, labels):
            groups.setdefault(label, []).append(lengths[index])
        cost = sum(overhead + len(group) * max(group) for group in groups.values())
        best = cost if best is None else min(best, cost)
    return best


def test_a_prefill_gets_its_own_forward_and_decode_rows_share_one():
    rows = _rows([1] * 15 + [131])
    groups = forward_groups(rows, overhead_tokens=8)
    assert [sorted(len(r) for r in g.values()) for g in groups] == [[131], [1] * 15]


def test_prompts_of_very_different_lengths_are_not_padded_to_the_longest():
    groups = forward_groups(_rows([60, 190, 64, 1, 1]), overhead_tokens=8)
    assert [sorted(len(r) for r in g.values()) for g in groups] == [[190], [60, 64], [1, 1]]


def test_a_large_overhead_keeps_everything_in_one_forward():
    groups = forward_groups(_rows([1, 5, 16, 40]), overhead_tokens=512)
    assert len(groups) == 1 and len(groups[0]) == 4


def test_every_row_lands_in_exactly_one_forward_of_least_cost():
    generator = random.Random(0)
    for _ in range(60):
        lengths = [generator.choice([1, 2, 5, 9, 16, 30, 131]) for _ in range(generator.randint(1, 6))]
        overhead = generator.choice([0, 4, 8, 64])
        groups = forward_groups(_rows(lengths), overhead_tokens=overhead)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        assert _cost(groups, overhead) == _cheapest_split(lengths, overhead)


def test_no_rows_no_forwards():
    assert forward_groups({}, overhead_tokens=8) == []
