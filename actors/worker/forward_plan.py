"""How a worker step's rows are cut into forwards, and how its token budget is shared.

:func:`forward_groups`: a step's rows go into the forwards that cost least under a model of a
forward's cost (a fixed overhead plus its padded positions). :func:`prefill_grants`: chunked
prefill; a step's token budget (``engine.max_tokens_per_step``) goes first to the rows of the other
items (decoding, verification, short prompts), and what is left to the prompts' prefill chunks, in
item order; the first prompt in line always gets at least :data:`MIN_PREFILL_SHARE` of the budget,
so no prompt waits forever behind running streams.
"""

from __future__ import annotations

from collections.abc import Sequence

from actors.model.batch import RowWork

#: The first prefill chunk in line gets at least this share of the budget even when the step's
#: other rows take it all.
MIN_PREFILL_SHARE = 0.25


def prefill_grants(other_tokens: int, remaining: Sequence[int], budget: int) -> list[int]:
    """The prefill chunk of each prompt in line, in order: what ``budget`` leaves after the
    ``other_tokens`` of the step's other rows, first come first served; the first prompt gets at
    least ``MIN_PREFILL_SHARE`` of the budget (one token at least) whatever the others take.
    ``remaining``: the prompt tokens each still has to feed."""
    left = max(0, budget - other_tokens)
    floor = max(1, int(budget * MIN_PREFILL_SHARE))
    grants = []
    for index, wanted in enumerate(remaining):
        grant = min(wanted, max(left, floor) if index == 0 else left)
        grants.append(grant)
        left = max(0, left - grant)
    return grants


def forward_groups(rows: dict[int, RowWork], overhead_tokens: int) -> list[dict[int, RowWork]]:
    """Split one forward's rows into the forwards that cost least.

    A batch is padded to its longest row, so a prompt's prefill next to fifteen one-token rows
    would make every row cost the prompt's length, and two prompts of 60 and 190 tokens in one
    forward cost 380 positions for 250 tokens. Modelled cost of a forward: ``overhead_tokens``
    plus its padded positions (rows x longest row). Rows sorted by length are cut into the
    contiguous runs of least total cost (exact, by dynamic programming over the cut points);
    runs are returned longest rows first.
    """
    if not rows:
        return []
    order = sorted(rows, key=lambda i: len(rows[i]))  # indices, shortest row first
    lengths = [len(rows[i]) for i in order]
    best = [0] + [float("inf")] * len(order)  # best[j]: least cost of the first j rows
    cut = [0] * (len(order) + 1)  # cut[j]: where the last forward of that best split starts
    for end in range(1, len(order) + 1):
        for start in range(end):
            cost = best[start] + overhead_tokens + (end - start) * lengths[end - 1]
            if cost < best[end]:
                best[end], cut[end] = cost, start
    groups, end = [], len(order)
    while end:
        groups.append({i: rows[i] for i in order[cut[end]:end]})
        end = cut[end]
    return groups
