"""Ragged batches (actors.model.batch) and SlotBackend.forward on the embedded models, checked against
a plain per-row forward with transformers' DynamicCache: mixed lengths in arbitrary slots,
rollback as a length change, K draft chains in one row and moving the winner with a column copy."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from actors.model.backends import SlotBackend
from actors.model.batch import (RowWork, RunAttend, build_batch, chains_row, is_causal_run, linear_row)
from models import resolve_model_path

ATOL = 1e-4  # float32: batched vs per-row attention differ by rounding only
MAX_CONTEXT = 128  # keeps each slot small: capacity = 128 + 64 scratch columns


@pytest.fixture(scope="module", params=["embedded:target", "embedded:draft"])
def backend(request) -> SlotBackend:
    """A SlotBackend on one embedded model, resolved like ``cluster.config`` resolves ``embedded:``."""
    return SlotBackend.load(resolve_model_path(request.param), max_context=MAX_CONTEXT, max_slots=16)


@pytest.fixture
def slots(backend):
    """Eight slots handed out for one test and freed afterwards."""
    taken = [backend.allocate() for _ in range(8)]
    yield taken
    for slot in taken:
        backend.free(slot)


def random_tokens(generator: torch.Generator, n: int) -> list[int]:
    """``n`` token ids in ``[1, 4096)``."""
    return torch.randint(1, 4096, (n,), generator=generator).tolist()


@torch.inference_mode()
def reference_logits(backend: SlotBackend, context: list[int], new: list[int]) -> torch.Tensor:
    """Logits ``[len(new), V]`` of ``new`` after ``context``: one row, a DynamicCache, no masks."""
    model, cache = backend.model, DynamicCache(config=backend.model.config)
    if context:
        model(input_ids=torch.tensor([context]), past_key_values=cache, use_cache=True)
    logits = model(input_ids=torch.tensor([new]), past_key_values=cache, use_cache=True).logits  # [1, L, V]
    return logits[0].float()


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Logits ``[n, V]`` agree to ATOL and pick the same argmax."""
    assert actual.shape == expected.shape
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)
    assert torch.equal(actual.argmax(-1), expected.argmax(-1))


# -- RowWork and build_batch ----------------------------------------------------------------


def test_linear_row_is_the_causal_layout():
    """Columns and positions count up from their starts; token i sees new tokens 0..i."""
    row = linear_row(3, 5, [10, 11, 12], 7, [2, 0])
    assert row.columns == (5, 6, 7)
    assert row.positions == (7, 8, 9)
    assert row.attend == ((5,), (5, 6), (5, 6, 7))
    assert row.keep == (2, 0) and len(row) == 3 and row.end_column == 8


def test_is_causal_run_takes_the_ordinary_causal_rows_only():
    """A linear row, one chain (at any depth), and a verification row whose pending tokens and chain
    are adjacent runs are causal runs; two chains, a row that leaves out a column before its own,
    a run that skips a column and a row that sees a later token are not."""
    assert is_causal_run(linear_row(0, 5, [1, 2, 3], 9, [2]))
    assert is_causal_run(chains_row(0, 4, [[1, 2, 3]], 4, [0, 1, 2]))
    assert not is_causal_run(chains_row(0, 4, [[1, 2], [3, 4]], 4, [0, 1, 2, 3]))
    pending_then_chain = RunAttend((4, 4, 4), (5, 5, 5), (0, 5, 5), (0, 6, 7))  # pending [4, 5), then the chain
    assert is_causal_run(RowWork(0, 4, (1, 2, 3), (4, 5, 6), (4, 5, 6), pending_then_chain, (0, 1, 2)))
    assert not is_causal_run(RowWork(0, 4, (1, 2), (5, 6), (5, 6), ((5,), (5, 6)), (1,)))  # column 4 left out
    # A one-chain draft row at depth 2 (columns 4-5 hold the chain's earlier tokens, uncommitted):
    assert is_causal_run(RowWork(0, 4, (9,), (6,), (6,), RunAttend((4,), (7,)), (0,)))
    assert is_causal_run(RowWork(0, 4, (9,), (6,), (6,), ((4, 5, 6),), (0,)))
    assert not is_causal_run(RowWork(0, 4, (9,), (6,), (6,), RunAttend((5,), (7,)), (0,)))  # column 4 left out
    gap = RunAttend((4, 4, 4), (5, 5, 5), (0, 5, 6), (0, 6, 7))  # token 2 sees columns 4 and 6, not 5
    assert not is_causal_run(RowWork(0, 4, (1, 2, 3), (4, 5, 6), (4, 5, 6), gap, (2,)))
    assert not is_causal_run(RowWork(0, 4, (1, 2), (4, 5), (4, 5), ((4, 5), (4, 5)), (1,)))  # token 0 sees token 1


def test_chains_row_is_chain_major():
    """Chain k token j sits at prefix + k*G + j, position first + j, and sees only its chain."""
    row = chains_row(0, 4, [[1, 2], [3, 4]], 4, [0, 1, 2, 3])
    assert row.columns == (4, 5, 6, 7)
    assert row.positions == (4, 5, 4, 5)
    assert row.attend == ((4,), (4, 5), (6,), (6, 7))


def test_build_batch_pads_to_trash_column_and_copies_last_mask_row():
    """Shapes, padding and mask of a 2-row batch with 3 and 1 new tokens."""
    rows = [linear_row(2, 4, [7, 8, 9], 4, [2]), linear_row(0, 1, [5], 1, [0])]
    batch = build_batch(rows, capacity=10)
    assert batch.kv_length == 7  # row 0 writes up to column 6
    assert batch.input_ids.tolist() == [[7, 8, 9], [5, 0, 0]]  # [B=2, L=3]
    assert batch.position_ids.tolist() == [[4, 5, 6], [1, 1, 1]]
    assert batch.write_columns.tolist() == [[4, 5, 6], [1, 10, 10]]  # 10 = trash column
    assert batch.slots.tolist() == [2, 0]
    mask = batch.attention_mask  # [2, 1, 3, 7]
    assert mask.shape == (2, 1, 3, 7) and mask.dtype == torch.bool
    assert mask[0, 0].int().tolist() == [[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 0], [1] * 7]
    assert mask[1, 0].int().tolist() == [[1, 1, 0, 0, 0, 0, 0]] * 3  # padded queries copy the last
    assert batch.keep_index.tolist() == [2, 3] and batch.keep_counts == (1, 1)


def expected_mask(rows: list[RowWork], width: int, kv_length: int) -> torch.Tensor:
    """The mask ``[B, 1, L, T_kv]`` spelled out entry by entry."""
    mask = torch.zeros(len(rows), 1, width, kv_length, dtype=torch.bool)
    for b, row in enumerate(rows):
        for i in range(width):
            seen = row.attend[min(i, len(row) - 1)]
            mask[b, 0, i, : row.prefix_length] = True
            mask[b, 0, i, list(seen)] = True
    return mask


def test_long_causal_rows_get_the_same_mask():
    """A long linear row (triangular block path), a padded one, and long draft chains (scattered
    entries path) give the entry-by-entry mask."""
    rows = [
        linear_row(0, 3, list(range(20)), 3, [19]),  # causal, padded to 24
        linear_row(1, 0, list(range(24)), 0, [0]),  # causal, full width
        chains_row(2, 7, [list(range(12)), list(range(12))], 7, [5]),  # 24 tokens, not causal
        linear_row(3, 9, [1, 2], 9, [1]),  # short
    ]
    batch = build_batch(rows, capacity=40)
    assert batch.kv_length == 31
    assert torch.equal(batch.attention_mask, expected_mask(rows, 24, 31))


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"columns": (5, 6)}, "RowWork.columns has"),
        ({"positions": (5,)}, "RowWork.positions has"),
        ({"attend": ((5,),)}, "RowWork.attend has"),
        ({"columns": (5, 5, 6), "attend": ((5,), (5,), (5, 6))}, "RowWork.columns must be distinct"),
        ({"columns": (4, 5, 6), "attend": ((4,), (4, 5), (4, 5, 6))}, "RowWork.columns must be >= prefix_length"),
        ({"attend": ((5,), (5,), (5, 6, 7))}, r"RowWork.attend\[1\] must include the token's own column 6"),
        ({"attend": ((3, 5), (5, 6), (5, 6, 7))}, r"RowWork.attend\[0\] lists columns below"),
        ({"keep": (3,)}, "RowWork.keep index 3"),
        ({"token_ids": (), "columns": (), "positions": (), "attend": ()}, "RowWork.token_ids"),
        ({"prefix_length": -1}, "RowWork.prefix_length"),
        ({"positions": (-1, 0, 1)}, "RowWork.positions"),
    ],
)
def test_row_validation_names_the_field(change, field):
    """Each inconsistent RowWork raises a ValueError naming the bad field."""
    fields = {"slot": 0, "prefix_length": 5, "token_ids": (1, 2, 3), "columns": (5, 6, 7),
              "positions": (5, 6, 7), "attend": ((5,), (5, 6), (5, 6, 7)), "keep": (2,)}
    with pytest.raises(ValueError, match=field):
        RowWork(**{**fields, **change})


def test_build_batch_checks_capacity_and_distinct_slots():
    """Columns past the slot's capacity and two rows in one slot are refused."""
    with pytest.raises(ValueError, match="RowWork.columns must be < capacity 6"):
        build_batch([linear_row(0, 4, [1, 2, 3], 4, [0])], capacity=6)
    with pytest.raises(ValueError, match="RowWork.slot must be distinct"):
        build_batch([linear_row(1, 0, [1], 0, [0]), linear_row(1, 2, [1], 2, [0])], capacity=6)
    with pytest.raises(ValueError, match="at least one"):
        build_batch([], capacity=6)


# -- SlotBackend.forward against DynamicCache -----------------------------------------------

CONTEXTS = (5, 60, 17, 33, 9, 48, 24)  # context length per row
NEW = (1, 5, 3, 2, 4, 1, 5)  # new tokens per row
ORDER = (5, 2, 7, 0, 3, 6, 1)  # which of the 8 slots each row uses


def prefill(backend, rows_slots, contexts):
    """Feed each context into its slot in one ragged forward; return the last positions' logits."""
    rows = [linear_row(slot, 0, ctx, 0, [len(ctx) - 1]) for slot, ctx in zip(rows_slots, contexts)]
    return backend.forward(rows)  # B x [1, V]


def test_ragged_batch_matches_rows_run_alone(backend, slots):
    """A ragged prefill, then 1-5 new tokens per row (keep in odd orders), match DynamicCache."""
    generator = torch.Generator().manual_seed(0)
    row_slots = [slots[i] for i in ORDER]
    contexts = [random_tokens(generator, n) for n in CONTEXTS]
    for ctx, logits in zip(contexts, prefill(backend, row_slots, contexts)):
        assert_close(logits, reference_logits(backend, [], ctx)[-1:])

    news = [random_tokens(generator, n) for n in NEW]
    keeps = [tuple(reversed(range(n))) if b % 2 else tuple(range(n)) for b, n in enumerate(NEW)]
    rows = [linear_row(s, len(c), t, len(c), k) for s, c, t, k in zip(row_slots, contexts, news, keeps)]
    for ctx, new, keep, logits in zip(contexts, news, keeps, backend.forward(rows)):
        assert logits.shape == (len(keep), backend.vocab_size)
        assert_close(logits, reference_logits(backend, ctx, new)[list(keep)])


def test_rollback_is_a_length_change(backend, slots):
    """Lower prefix_length on some rows and write other tokens over the same columns."""
    generator = torch.Generator().manual_seed(1)
    row_slots = [slots[i] for i in ORDER]
    fed = [random_tokens(generator, c + n) for c, n in zip(CONTEXTS, NEW)]  # context + new per row
    prefill(backend, row_slots, fed)

    cuts = [len(tokens) - r for tokens, r in zip(fed, (3, 0, 2, 0, 7, 0, 1))]  # 0: no rollback
    replacements = [random_tokens(generator, n) for n in (2, 1, 4, 3, 1, 2, 5)]
    rows = [linear_row(s, cut, new, cut, range(len(new))) for s, cut, new in zip(row_slots, cuts, replacements)]
    for tokens, cut, new, logits in zip(fed, cuts, replacements, backend.forward(rows)):
        assert_close(logits, reference_logits(backend, tokens[:cut], new))


def test_k_drafts_in_one_row_then_keep_the_winner(backend, slots):
    """K=3 chains after one prefix match scoring each draft alone; copying chain 2's accepted
    entries right after the prefix and continuing matches a fresh run on the accepted context."""
    generator = torch.Generator().manual_seed(2)
    slot, other = slots[6], slots[3]
    prefix, other_ctx = random_tokens(generator, 30), random_tokens(generator, 11)
    prefill(backend, [slot, other], [prefix, other_ctx])

    gamma, drafts = 4, [random_tokens(generator, 4) for _ in range(3)]
    other_new = random_tokens(generator, 2)
    rows = [
        chains_row(slot, len(prefix), drafts, len(prefix), range(3 * gamma)),
        linear_row(other, len(other_ctx), other_new, len(other_ctx), [1]),  # an ordinary row alongside
    ]
    scored, other_logits = backend.forward(rows)  # [12, V], [1, V]
    for k, draft in enumerate(drafts):
        assert_close(scored[k * gamma : (k + 1) * gamma], reference_logits(backend, prefix, draft))
    assert_close(other_logits, reference_logits(backend, other_ctx, other_new)[1:])

    winner, accepted = 2, 3  # chain 2, its first 3 tokens
    start = len(prefix)
    backend.copy_columns(slot, [start + winner * gamma + j for j in range(accepted)],
                         [start + j for j in range(accepted)])
    context = prefix + drafts[winner][:accepted]
    bonus = random_tokens(generator, 2)
    (logits,) = backend.forward([linear_row(slot, len(context), bonus, len(context), [0, 1])])
    assert_close(logits, reference_logits(backend, context, bonus))


# -- reading the slots in place --------------------------------------------------------------


def test_forward_refuses_unallocated_slot(backend):
    """A row in a slot nobody allocated is refused before the model runs."""
    with pytest.raises(ValueError, match="RowWork.slot 15 is not allocated"):
        backend.forward([linear_row(15, 0, [1, 2], 0, [1])])


# ------------------------------------------------------------------ column runs (O(tokens))
def _as_tuples(row: RowWork) -> RowWork:
    return RowWork(slot=row.slot, prefix_length=row.prefix_length, token_ids=row.token_ids, columns=row.columns,
                   positions=row.positions, attend=tuple(tuple(seen) for seen in row.attend), keep=row.keep)


def test_run_rows_build_the_mask_a_tuple_per_token_builds():
    """A verification-shaped row (2 pending tokens, then 2 chains of 3 seeing the pending tokens and
    their own chain) and a long causal prompt, next to a one-token row: the runs give exactly the
    mask, ids and positions of the same rows with a tuple per token."""
    base, pending, gamma = 10, 2, 3
    chain_start = base + pending
    chains = [chain_start + k * gamma for k in range(2)]
    verify = RowWork(
        slot=1, prefix_length=base, token_ids=tuple(range(1, pending + 2 * gamma + 1)),
        columns=tuple(range(base, chain_start + 2 * gamma)),
        positions=tuple(range(base, chain_start)) + tuple(chain_start + j for _ in chains for j in range(gamma)),
        attend=RunAttend(first_start=[base] * (pending + 2 * gamma),
                         first_end=[base + 1, base + 2] + [chain_start] * (2 * gamma),
                         second_start=[0, 0] + [c for c in chains for _ in range(gamma)],
                         second_end=[0, 0] + [c + j + 1 for c in chains for j in range(gamma)]),
        keep=(1, 2, 3, 4, 5, 6, 7),
    )
    prompt = linear_row(2, 0, list(range(1, 41)), 0, [39])
    decode = linear_row(0, 7, [5], 7, [0])
    for rows in ([verify, decode], [prompt, verify, decode]):
        runs = build_batch(rows, capacity=64)
        tuples = build_batch([_as_tuples(row) for row in rows], capacity=64)
        assert torch.equal(runs.attention_mask, tuples.attention_mask)
        assert torch.equal(runs.input_ids, tuples.input_ids) and torch.equal(runs.position_ids, tuples.position_ids)
    assert verify.attend[pending + gamma] == (base, base + 1, chains[1])  # chain 1's first token


def test_a_long_prompt_row_is_linear_in_its_tokens():
    row = linear_row(0, 0, list(range(1, 20001)), 0, [19999])
    assert isinstance(row.attend, RunAttend) and row.attend[2] == (0, 1, 2) and len(row.attend) == 20000


@pytest.mark.parametrize("bounds,message", [
    (([5, 5], [6, 6]), r"RowWork.attend\[1\] must include the token's own column 6"),
    (([3, 5], [6, 7]), r"RowWork.attend\[0\] lists columns below prefix_length 5"),
    (([5, 5], [6]), "one length"),
])
def test_bad_runs_name_the_field(bounds, message):
    with pytest.raises(ValueError, match=message):
        RowWork(slot=0, prefix_length=5, token_ids=(1, 2), columns=(5, 6), positions=(5, 6),
                attend=RunAttend(*bounds), keep=(1,))
