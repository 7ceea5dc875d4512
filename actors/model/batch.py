"""Ragged inputs for one batched forward: each row is one session's new tokens in its KV slot.

A :class:`RowWork` says, for one session, which tokens to run, where their keys/values go in
the session's cache slot (storage columns), which rotary position each token has, and which
columns each token sees: the slot's prefix ``[0, prefix_length)`` plus the columns listed in
``attend``. That covers the ordinary causal case (:func:`linear_row`), a rollback (a shorter
``prefix_length``; stale columns are simply not visible and get overwritten) and K drafts in
one row (:func:`chains_row`: chains laid out side by side, each token seeing only its own chain).

:func:`build_batch` pads the rows of a forward into tensors for the model:

* ``input_ids``, ``position_ids``, ``write_columns``: ``[B, L]``, ``L`` the longest row;
  padded tokens write to the slot's trash column (``capacity``), which nothing reads;
* ``attention_mask``: bool ``[B, 1, L, T_kv]`` (True = attend), ``T_kv`` the highest column
  any row touches plus one; a padded query copies its row's last real query (a fully masked
  query row gives NaN in some attention kernels);
* the flat indices of the kept positions, whose logits are the only ones computed.

Every row's keys/values are gathered through the cache's block tables
(:mod:`actors.model.kv_cache`), so the rows of a forward may live anywhere in the pool.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

#: Rows at least this long whose tokens see exactly the earlier new tokens and themselves get a
#: triangular block in the mask instead of O(L^2) scattered entries (a long prefill).
CAUSAL_BLOCK_MIN_TOKENS = 16

class RunAttend(Sequence):
    """``attend`` as column runs, O(1) per token: token ``i`` sees (beyond the prefix) columns
    ``[first_start[i], first_end[i])`` and ``[second_start[i], second_end[i])`` (empty when equal).
    That covers every row the engine builds: a causal row (one run growing by a column a
    token), a draft chain (its own chain's run) and a verification row (the pending tokens' run,
    then its chain's run). Indexing gives the tuple a plain ``attend`` would hold, so every reader
    works unchanged; :func:`build_batch` builds the mask from the runs with tensor operations and
    the checks are O(tokens) (a 4,096-token prompt's row was ~1 s of Python as a tuple per
    token, plus ~1 s to build its mask)."""

    __slots__ = ("first_start", "first_end", "second_start", "second_end")

    def __init__(self, first_start: Sequence[int], first_end: Sequence[int],
                 second_start: Sequence[int] | None = None, second_end: Sequence[int] | None = None):
        self.first_start, self.first_end = tuple(first_start), tuple(first_end)
        empty = (0,) * len(self.first_start)
        self.second_start = tuple(second_start) if second_start is not None else empty
        self.second_end = tuple(second_end) if second_end is not None else empty
        lengths = {len(self.first_start), len(self.first_end), len(self.second_start), len(self.second_end)}
        if len(lengths) != 1:
            raise ValueError(f"RunAttend: the four run bounds must have one length, got {sorted(lengths)}")

    @classmethod
    def causal(cls, first_column: int, length: int) -> RunAttend:
        """Token ``i`` sees columns ``first_column .. first_column + i``."""
        return cls((first_column,) * length, range(first_column + 1, first_column + length + 1))

    def __len__(self) -> int:
        return len(self.first_start)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(len(self))))
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        return (tuple(range(self.first_start[index], self.first_end[index]))
                + tuple(range(self.second_start[index], self.second_end[index])))

    def runs(self, index: int) -> tuple[int, int, int, int]:
        return (self.first_start[index], self.first_end[index], self.second_start[index], self.second_end[index])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RunAttend):
            return tuple(self) == tuple(other)
        return tuple(self) == other if isinstance(other, tuple) else NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"RunAttend({len(self)} tokens)"


def _check_runs(row: RowWork) -> None:
    """The per-token checks of a plain ``attend`` on runs, O(tokens)."""
    attend = row.attend
    for i, column in enumerate(row.columns):
        first_start, first_end, second_start, second_end = attend.runs(i)
        if first_start > first_end or second_start > second_end:
            raise ValueError(f"RowWork.attend[{i}] has a run that ends before it starts (slot {row.slot})")
        if not (first_start <= column < first_end or second_start <= column < second_end):
            raise ValueError(
                f"RowWork.attend[{i}] must include the token's own column {column}, got {attend[i]} (slot {row.slot})"
            )
        if (first_end > first_start and first_start < row.prefix_length) or (
                second_end > second_start and second_start < row.prefix_length):
            raise ValueError(
                f"RowWork.attend[{i}] lists columns below prefix_length {row.prefix_length} "
                f"(the prefix is always visible), got {attend[i]} (slot {row.slot})"
            )


@dataclass(frozen=True)
class RowWork:
    """One session's new tokens in one batched forward."""

    slot: int  # the session's cache slot
    prefix_length: int  # storage columns [0, prefix_length) of the slot are visible to every new token
    token_ids: tuple[int, ...]  # [L_b] new tokens
    columns: tuple[int, ...]  # [L_b] storage column each new token's keys/values are written to
    positions: tuple[int, ...]  # [L_b] rotary position id of each new token
    attend: tuple[tuple[int, ...], ...]  # [L_b] visible columns beyond the prefix, per new token
    keep: tuple[int, ...]  # indices into token_ids whose logits are returned, in this order

    def __post_init__(self) -> None:
        """Normalise sequences to tuples (of ints, except inside ``attend``) and check everything
        that does not depend on the cache's capacity (:func:`build_batch` checks that)."""
        for name in ("token_ids", "columns", "positions", "keep"):
            object.__setattr__(self, name, tuple(map(int, getattr(self, name))))
        if not isinstance(self.attend, RunAttend):
            object.__setattr__(self, "attend", tuple(seen if type(seen) is tuple else tuple(seen) for seen in self.attend))
        _check_row(self)

    def __len__(self) -> int:
        """Number of new tokens ``L_b``."""
        return len(self.token_ids)

    @property
    def end_column(self) -> int:
        """One past the highest column this row reads or writes (its share of ``T_kv``)."""
        return max(self.prefix_length, max(self.columns) + 1)


def linear_row(
    slot: int, prefix_length: int, token_ids: Sequence[int], first_position: int, keep: Sequence[int]
) -> RowWork:
    """The ordinary causal case: new token ``i`` goes to column ``prefix_length + i`` at position
    ``first_position + i`` and sees the prefix, the earlier new tokens and itself."""
    columns = tuple(range(prefix_length, prefix_length + len(token_ids)))  # [L_b]
    return RowWork(
        slot=slot,
        prefix_length=prefix_length,
        token_ids=tuple(token_ids),
        columns=columns,
        positions=tuple(range(first_position, first_position + len(token_ids))),
        attend=RunAttend.causal(prefix_length, len(columns)),
        keep=tuple(keep),
    )


def chains_row(
    slot: int, prefix_length: int, chains: Sequence[Sequence[int]], first_position: int, keep: Sequence[int]
) -> RowWork:
    """K draft chains after one copy of the prefix, laid out chain-major: token ``j`` of chain
    ``k`` goes to column ``prefix_length + k * G + j`` (``G`` the longest chain) at position
    ``first_position + j`` and sees the prefix, its own chain's earlier tokens and itself.
    ``token_ids`` (and so ``keep``) run through chain 0, then chain 1, ..."""
    width = max((len(chain) for chain in chains), default=0)
    token_ids, columns, positions, attend = [], [], [], []
    for k, chain in enumerate(chains):
        chain_columns = tuple(range(prefix_length + k * width, prefix_length + k * width + len(chain)))
        token_ids.extend(chain)
        columns.extend(chain_columns)
        positions.extend(range(first_position, first_position + len(chain)))
        attend.extend(chain_columns[: j + 1] for j in range(len(chain)))
    return RowWork(
        slot=slot,
        prefix_length=prefix_length,
        token_ids=tuple(token_ids),
        columns=tuple(columns),
        positions=tuple(positions),
        attend=tuple(attend),
        keep=tuple(keep),
    )


def _check_row(row: RowWork) -> None:
    """Raise ``ValueError`` naming the field when ``row`` is inconsistent."""
    length = len(row.token_ids)
    if row.slot < 0:
        raise ValueError(f"RowWork.slot must be >= 0, got {row.slot}")
    if row.prefix_length < 0:
        raise ValueError(f"RowWork.prefix_length must be >= 0, got {row.prefix_length}")
    if length == 0:
        raise ValueError("RowWork.token_ids must hold at least one token")
    for name in ("columns", "positions", "attend"):
        if len(getattr(row, name)) != length:
            raise ValueError(
                f"RowWork.{name} has {len(getattr(row, name))} entries for {length} token_ids (slot {row.slot})"
            )
    if len(set(row.columns)) != length:
        raise ValueError(f"RowWork.columns must be distinct, got {row.columns} (slot {row.slot})")
    if min(row.columns) < row.prefix_length:
        raise ValueError(
            f"RowWork.columns must be >= prefix_length {row.prefix_length}, got {row.columns} (slot {row.slot})"
        )
    if min(row.positions) < 0:
        raise ValueError(f"RowWork.positions must be >= 0, got {row.positions} (slot {row.slot})")
    if isinstance(row.attend, RunAttend):
        _check_runs(row)
        _check_keep(row, length)
        return
    for i, (column, seen) in enumerate(zip(row.columns, row.attend)):
        if column not in seen:
            raise ValueError(
                f"RowWork.attend[{i}] must include the token's own column {column}, got {seen} (slot {row.slot})"
            )
        if min(seen) < row.prefix_length:
            raise ValueError(
                f"RowWork.attend[{i}] lists columns below prefix_length {row.prefix_length} "
                f"(the prefix is always visible), got {seen} (slot {row.slot})"
            )
    _check_keep(row, length)


def _check_keep(row: RowWork, length: int) -> None:
    for index in row.keep:
        if not 0 <= index < length:
            raise ValueError(f"RowWork.keep index {index} out of range for {length} tokens (slot {row.slot})")


def _is_causal(row: RowWork) -> bool:
    """True when new token ``i`` sees exactly the new tokens ``0..i`` (in column order)."""
    columns = row.columns
    return all(seen == columns[: i + 1] for i, seen in enumerate(row.attend))


def is_causal_run(row: RowWork) -> bool:
    """Whether ``row``'s new tokens sit at consecutive columns ``c, c + 1, ...`` and token ``i``
    sees exactly every column of the slot before its own and itself (``[0, c + i]``): the prefix,
    the columns between the prefix and ``c`` (a draft chain's earlier tokens, fed uncommitted) and
    the new tokens ``0..i``. That is the ordinary causal row (:func:`linear_row`), a one-chain draft
    row at any depth and a verification row whose pending tokens and chain are adjacent runs,
    which a forward of that row alone runs with no mask to build (the causal block at the end of
    its key columns), O(tokens)."""
    start, length = row.columns[0], len(row)
    if start < row.prefix_length or row.columns != tuple(range(start, start + length)):
        return False
    attend, prefix = row.attend, row.prefix_length
    if isinstance(attend, RunAttend):
        for i in range(length):
            first_start, first_end, second_start, second_end = attend.runs(i)
            runs = sorted(run for run in ((first_start, first_end), (second_start, second_end)) if run[1] > run[0])
            if runs[0][0] != prefix or runs[-1][1] != start + i + 1 or (len(runs) == 2 and runs[0][1] != runs[1][0]):
                return False
        return True
    return all(seen == tuple(range(prefix, start + i + 1)) for i, seen in enumerate(attend))


def _check_capacity(row: RowWork, capacity: int) -> None:
    """Raise ``ValueError`` naming the field when ``row`` reaches past the slot's ``capacity``."""
    if row.prefix_length > capacity:
        raise ValueError(f"RowWork.prefix_length {row.prefix_length} exceeds capacity {capacity} (slot {row.slot})")
    if max(row.columns) >= capacity:
        raise ValueError(f"RowWork.columns must be < capacity {capacity}, got {row.columns} (slot {row.slot})")
    if isinstance(row.attend, RunAttend):
        highest = max(max(row.attend.first_end), max(row.attend.second_end)) - 1
        if highest >= capacity:
            raise ValueError(f"RowWork.attend must be < capacity {capacity}, got column {highest} (slot {row.slot})")
        return
    for i, seen in enumerate(row.attend):
        if max(seen) >= capacity:
            raise ValueError(f"RowWork.attend[{i}] must be < capacity {capacity}, got {seen} (slot {row.slot})")


@dataclass(frozen=True)
class RaggedBatch:
    """The padded tensors of one forward over ``B`` rows of up to ``L`` new tokens."""

    slots: torch.Tensor  # [B] long: each row's cache slot
    input_ids: torch.Tensor  # [B, L] long: new tokens, padding 0
    position_ids: torch.Tensor  # [B, L] long: rotary positions, padding repeats the row's last
    write_columns: torch.Tensor  # [B, L] long: storage column per token, padding -> trash column
    attention_mask: torch.Tensor  # [B, 1, L, T_kv] bool: True = attend
    kv_length: int  # T_kv: columns [0, T_kv) of each slot are read by attention
    keep_index: torch.Tensor  # [N_keep] long: flat indices b * L + i of the kept positions, row-major
    keep_counts: tuple[int, ...]  # [R] kept positions per given row, in ``row_order``
    row_order: tuple[int, ...]  # [R] index into the given rows of each batch row, in batch order


def build_batch(
    rows: Sequence[RowWork], *, capacity: int, device: str | torch.device = "cpu"
) -> RaggedBatch:
    """Pad ``rows`` into the tensors of one forward, on ``device``.

    ``capacity`` is the number of usable columns per slot; column ``capacity`` is the trash
    column padded tokens write to. Rows must use distinct slots; the batch rows are the given
    rows, in order.
    """
    if not rows:
        raise ValueError("build_batch needs at least one RowWork")
    slots = [row.slot for row in rows]
    if len(set(slots)) != len(slots):
        raise ValueError(f"RowWork.slot must be distinct within one forward, got {slots}")
    for row in rows:
        _check_capacity(row, capacity)
    batch, width = len(rows), max(len(row) for row in rows)
    kv_length = max(row.end_column for row in rows)

    batch_slots, prefixes, input_ids, positions, columns = [], [], [], [], []
    attend_rows, attend_queries, attend_columns = [], [], []
    run_rows, run_queries = [], []  # RunAttend rows: each query (b, i), every query of the row in order ...
    run_bounds: tuple[list[int], ...] = ([], [], [], [])  # ... and its 4 run bounds
    keep_index, causal_rows = [], []
    for b, row in enumerate(rows):
        pad = width - len(row)
        batch_slots.append(row.slot)
        prefixes.append(row.prefix_length)
        input_ids.extend(row.token_ids + (0,) * pad)
        positions.extend(row.positions + (row.positions[-1],) * pad)
        columns.extend(row.columns + (capacity,) * pad)
        keep_index.extend(b * width + i for i in row.keep)
        if isinstance(row.attend, RunAttend):
            attend = row.attend  # a padded query sees exactly what the row's last real query sees
            last = len(row) - 1
            run_rows.extend(itertools.repeat(b, width))
            run_queries.extend(range(width))
            for kept, bounds in zip(run_bounds, (attend.first_start, attend.first_end, attend.second_start, attend.second_end)):
                kept.extend(bounds)
                kept.extend(itertools.repeat(bounds[last], pad))
            continue
        if len(row) >= CAUSAL_BLOCK_MIN_TOKENS and _is_causal(row):
            causal_rows.append(b)
            continue
        # A padded query sees exactly what the row's last real query sees.
        attend = row.attend + (row.attend[-1],) * pad
        counts = [len(seen) for seen in attend]
        attend_columns.extend(itertools.chain.from_iterable(attend))
        attend_queries.extend(itertools.chain.from_iterable(itertools.repeat(i, n) for i, n in enumerate(counts)))
        attend_rows.extend(itertools.repeat(b, sum(counts)))

    # One host-to-device transfer for every index list, then views into it.
    parts = (batch_slots, prefixes, input_ids, positions, columns, keep_index,
             attend_rows, attend_queries, attend_columns, run_rows, run_queries, *run_bounds)
    flat = torch.tensor(list(itertools.chain.from_iterable(parts)), dtype=torch.long, device=device)  # [sum of lengths]
    (slots_t, prefix, ids_t, positions_t, columns_t, keep_t, rows_t, queries_t, seen_t,
     run_rows_t, run_queries_t, *bounds_t) = torch.split(flat, [len(part) for part in parts])
    kv_columns = torch.arange(kv_length, device=device)  # [T_kv]
    mask = kv_columns[None, :] < prefix[:, None]  # [B, T_kv]
    mask = mask[:, None, :].repeat(1, width, 1)  # [B, L, T_kv]
    mask[rows_t, queries_t, seen_t] = True
    if run_rows:
        first_start, first_end, second_start, second_end = (b[:, None] for b in bounds_t)  # each [N_run_queries, 1]
        seen = ((kv_columns >= first_start) & (kv_columns < first_end)) | (
            (kv_columns >= second_start) & (kv_columns < second_end))  # [N_run_queries, T_kv]
        run_batch_rows = run_rows_t[::width]  # [R]: every query of a run row, in order, so a row every width
        mask[run_batch_rows] = mask[run_batch_rows] | seen.view(-1, width, kv_length)  # [R, L, T_kv]; rows distinct
    for b in causal_rows:
        length = len(rows[b])
        block = torch.ones(width, length, dtype=torch.bool, device=device).tril()  # [L, L_b]; padding: all
        mask[b, :, columns_t[b * width : b * width + length]] = block
    row_order = tuple(range(batch))
    return RaggedBatch(
        slots=slots_t,  # [B]
        input_ids=ids_t.view(batch, width),  # [B, L]
        position_ids=positions_t.view(batch, width),  # [B, L]
        write_columns=columns_t.view(batch, width),  # [B, L]
        attention_mask=mask[:, None],  # [B, 1, L, T_kv]
        kv_length=kv_length,
        keep_index=keep_t,  # [N_keep]
        keep_counts=tuple(len(rows[i].keep) for i in row_order),
        row_order=row_order,
    )
