"""CUDA graphs for the one-row, one-token decode forward (``engine.cuda_graphs``; default off).

A decode step of a lone request is a forward of one token whose GPU work is a few microseconds
per kernel, while eager PyTorch launches each of its ~19 kernels a layer from Python: the launches,
not the GPU, set its time. A CUDA graph records the kernels once and replays them with one launch.
A graph replays fixed shapes and fixed addresses, so the forward it records is
:class:`FixedDecode`: the lean decoder (:mod:`actors.model.lean_decoder`) over

* the token, its position and the column it writes in device tensors the caller fills before a
  replay (no shape or Python number of the step inside the graph);
* attention over every column of the slot (``capacity``), gathered from the paged KV cache through
  a device tensor of the slot's storage rows, under a bool mask that lets the token see columns
  ``[0, column]`` (the same attended set as the eager one-row forward, which reads the slot up to
  its column; a masked column gets exactly zero weight);
* the new keys/values written with ``index_copy_`` at the column's storage row.

The slot enters only through those tensors, so ONE graph serves every slot: recorded on the first
lone decode and replayed from then on. A forward the graph does
not cover (more than one token or row, a sliding-window model, a model off the lean path) runs
eagerly as before. The logits are the eager forward's up to the summation order of the masked
attention: ``make gpu-check`` compares them and times both, and the switch is meant to be on only
where that measurement shows it pays.

On a CPU the switch does nothing (CUDA graphs are a CUDA feature): :func:`decode_graphs` logs a
warning naming the model and the eager forward runs.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from actors.model.architectures import apply_head
from actors.model.batch import RowWork

logger = logging.getLogger(__name__)


class _SlotColumn:
    """The cache seen by :class:`FixedDecode`'s lean forward: one new column written at storage row
    ``write_row`` ``[1]``, every column of the slot read through its storage rows ``rows``
    ``[capacity]`` (device tensors; the lean decoder calls :meth:`write_and_gather`)."""

    def __init__(self, cache: Any, rows: torch.Tensor, write_row: torch.Tensor):
        self.cache, self.rows, self.write_row = cache, rows, write_row

    def write_and_gather(self, layer_idx: int, key_states: torch.Tensor,
                         value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[1, H_kv, 1, d]`` new keys/values at the column; return ``[1, H_kv, capacity, d]``."""
        read = []
        for kind, states in enumerate((key_states, value_states)):
            layer = self.cache.storage[kind, layer_idx]  # [H_kv, rows, d]
            layer.index_copy_(1, self.write_row, states[0].to(layer.dtype))  # [H_kv, 1, d] at the column's row
            read.append(layer.index_select(1, self.rows)[None])  # [1, H_kv, capacity, d]
        return read[0], read[1]


class FixedDecode:
    """The one-token decode forward of a :class:`actors.model.backends.SlotBackend` with every shape
    and address fixed (see the module doc): :meth:`set_inputs` from a row, then :meth:`compute`."""

    def __init__(self, backend: Any):
        self.backend = backend
        device, capacity = backend.device, backend.cache.capacity
        self.token = torch.zeros((1, 1), dtype=torch.long, device=device)  # [1, 1]
        self.position = torch.zeros((1, 1), dtype=torch.long, device=device)  # [1, 1]
        self.column = torch.zeros(1, dtype=torch.long, device=device)  # [1]
        self.mask = torch.zeros((1, 1, 1, capacity), dtype=torch.bool, device=device)  # [1, 1, 1, capacity]
        self.rows = torch.zeros(capacity, dtype=torch.long, device=device)  # [capacity] the slot's storage rows
        self.write_row = torch.zeros(1, dtype=torch.long, device=device)  # [1] the new column's storage row
        self._columns = torch.arange(capacity, device=device)  # [capacity]

    @staticmethod
    def covers(row: RowWork) -> bool:
        """Whether ``row`` is a one-token decode step keeping its one position."""
        return len(row) == 1 and tuple(row.keep) == (0,)

    def set_inputs(self, row: RowWork) -> None:
        """Fill the input tensors for ``row`` (:meth:`covers`): token, position, column, mask and the
        slot's storage rows (the block under the column allocated first, or copied where shared)."""
        self.rows.copy_(self.backend.cache.decode_rows(row.slot, row.columns[0]))
        values = torch.tensor((row.token_ids[0], row.positions[0], row.columns[0]), dtype=torch.long)
        values = values.to(self.token.device, non_blocking=True)  # [3]
        self.token.view(-1).copy_(values[0:1])
        self.position.view(-1).copy_(values[1:2])
        self.column.copy_(values[2:3])
        torch.le(self._columns, self.column, out=self.mask.view(-1))  # True: columns [0, column]
        self.write_row.copy_(self.rows.index_select(0, self.column))

    def compute(self) -> torch.Tensor:
        """The forward of the filled inputs -> float32 logits ``[1, V]`` (the new keys/values
        written at the column's storage row)."""
        backend = self.backend
        hidden = backend.lean(self.token, self.position, self.mask, _SlotColumn(backend.cache, self.rows, self.write_row))
        return apply_head(backend.architecture, backend.lean.head(backend.lm_head, hidden[0])).float()  # [1, V]


class DecodeGraphs:
    """One CUDA graph of :class:`FixedDecode` for every slot, recorded on first use."""

    def __init__(self, backend: Any):
        self.fixed = FixedDecode(backend)
        self.graph: Any = None  # torch.cuda.CUDAGraph once recorded
        self.output: torch.Tensor | None = None  # the graph's logits [1, V]
        self.failed = False  # the graph could not be recorded: eager from then on

    def run(self, row: RowWork) -> torch.Tensor | None:
        """The logits ``[1, V]`` of a one-token decode ``row`` (:meth:`FixedDecode.covers`), by replay;
        None once a graph could not be recorded (the caller runs the eager forward)."""
        if self.failed:
            return None
        self.fixed.set_inputs(row)
        if self.graph is None and not self._record():
            return None
        self.graph.replay()
        return self.output.clone()

    def _record(self) -> bool:
        """Warm up on a side stream (what capture needs), then record the graph -> whether it
        was recorded. The warm-up writes the same keys/values at the same column as the forward that
        follows. A failure is logged and turns the graphs off for good: a device that is really
        broken fails the eager forward next, where it is told apart (:mod:`actors.model.device_health`)."""
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.fixed.compute()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.output = self.fixed.compute()
        except Exception as error:  # noqa: BLE001 - the eager forward serves this row and every later one
            self.failed = True
            logger.error("%s: recording the decode CUDA graph failed (%s: %s); decode forwards run eagerly from now on",
                         self.fixed.backend.name, type(error).__name__, error)
            return False
        self.graph = graph
        logger.info("%s: recorded the decode CUDA graph", self.fixed.backend.name)
        return True


def decode_graphs(backend: Any, enabled: bool) -> DecodeGraphs | None:
    """The backend's :class:`DecodeGraphs` when ``enabled`` (``engine.cuda_graphs``) and it can run
    them; None otherwise, with a log saying why where it was asked for (on a CPU: a warning)."""
    if not enabled:
        return None
    if torch.device(backend.device).type != "cuda":
        logger.warning("%s: engine.cuda_graphs is on but the model runs on %s; CUDA graphs need a CUDA device, so "
                       "the forward runs eagerly", backend.name, backend.device)
        return None
    if backend.lean is None or backend.positions is not None or backend.architecture.has_sliding_layers:
        logger.warning("%s: engine.cuda_graphs is on but the model is off the lean path or has sliding-window "
                       "layers; the forward runs eagerly", backend.name)
        return None
    logger.info("%s: one-token decode forwards of a lone row replay CUDA graphs (engine.cuda_graphs)", backend.name)
    return DecodeGraphs(backend)
