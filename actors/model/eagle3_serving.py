"""An EAGLE-3 head served as a draft model, in its target's worker.

A model entry whose checkpoint is an EAGLE-3 head (``config.json``'s ``architectures``, see
:mod:`actors.model.eagle3`) is a draft like any other to the rest of the group: it has its own
:class:`actors.worker.engine.WorkerEngine`, sessions and random streams, and every rule that takes
a draft verifies what it samples. Its backend is :class:`Eagle3Backend`, which needs its target in
the same process (a :class:`actors.worker.device_worker.DeviceWorker` hosting both, or the
in-process runner): bring-up hands it the models loaded before it (:func:`hosting`), and a head
with no target there is refused naming ``resources.placement``.

What it reads: the target's backend keeps the inputs of the head's aux layers per (slot, column)
next to its keys/values (:meth:`actors.model.backends.SlotBackend.keep_aux`: the lean decoder writes
them, the paged cache moves them with the columns). A committed token at position ``p >= 1`` of a
head session reads ``fc`` of the target's aux states at position ``p - 1`` of the same request (the
target session of the same id): the linear part of the target's slot, or the verified chain that
agrees with the committed tokens, found read-only as the target's next ``sync`` will keep it. A
drafted token (position past the committed context) reads the head's own pre-norm output at the
column before it in its chain. Position 0 (a one-token prompt) reads zeros and no later position
sees it; the head session never keeps a drafted chain (``Session.keep_chains``): the accepted
tokens are fed again, reading the target's states, as :meth:`actors.model.eagle3.Eagle3Head.chain_logits`
defines. Where the target has not run a committed position yet (a prompt's first step, a session
that was preempted) the target's own forward runs the committed tokens in a slot of its prefix
cache, parked there after, so that the target session that opens next on them reuses them
(:meth:`Eagle3Backend._prefill_target`; counted in :attr:`Eagle3Backend.recomputed_positions`). The
rows are a function of the committed tokens and the chain alone, so the output law stays the target's
(``tests/actors/model/test_eagle3_serving.py`` checks the served rows against ``chain_logits``).
"""

from __future__ import annotations

import contextlib
import contextvars
import heapq
import json
import logging
import pathlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from actors.model.batch import RowWork, RunAttend, is_causal_run, linear_row
from actors.model.eagle3 import EAGLE3_ARCHITECTURES, Eagle3Error, load_head
from actors.model.lean_decoder import _ONEDNN, ONEDNN_DTYPES, _gemm_fn, _linear

logger = logging.getLogger(__name__)

#: The models loaded so far in this process's worker (name -> ModelWorker): an EAGLE-3 head's target.
_HOSTED: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("eagle3_hosted", default=None)


def is_eagle3_checkpoint(path: str) -> bool:
    """Whether ``path`` is a local directory whose ``config.json`` names an EAGLE-3 architecture."""
    config = pathlib.Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        architectures = json.loads(config.read_text()).get("architectures") or []
    except (OSError, ValueError):
        return False
    return bool(set(architectures) & set(EAGLE3_ARCHITECTURES))


@contextlib.contextmanager
def hosting(models: dict[str, Any]) -> Iterator[None]:
    """While loading a worker's models: ``models`` (name -> ModelWorker, filled as they load) is
    where an EAGLE-3 head finds its target."""
    token = _HOSTED.set(models)
    try:
        yield
    finally:
        _HOSTED.reset(token)


def hosted_target(name: str, path: str) -> Any:
    """The target ModelWorker loaded in this worker before the head ``name``; :class:`Eagle3Error`
    naming the field when there is none."""
    models = _HOSTED.get() or {}
    targets = [worker for worker in models.values() if getattr(worker.spec, "role", None) == "target"]
    if len(targets) != 1:
        raise Eagle3Error(f"models.{name}: an EAGLE-3 head ({path}) runs in its target's worker, which hosts "
                          f"{'no target' if not targets else 'several targets'} here: place models.{name} with the target "
                          f"(resources.placement: the same device id, or auto)")
    return targets[0]


class Eagle3Backend:
    """The slot backend of an EAGLE-3 head (see the module doc): its one layer's keys/values and
    its pre-norm outputs per (slot, column), in dense per-slot tensors allocated on first use."""

    #: Sessions on this backend never keep a drafted chain (:attr:`actors.worker.sessions.Session.keep_chains`).
    keeps_chains = False
    forward_overhead_tokens = 8

    def __init__(self, head: Any, target: Any, name: str, quantization: str | None = None):
        self.head, self.target = head, target  # target: its ModelWorker (engine, backend, spec)
        self.name = name
        target_backend = target.engine.backend
        self.device = target_backend.device
        self.vocab_size = int(head.config.vocab_size)
        self.max_context = int(target_backend.max_context)
        self.capacity = int(target_backend.capacity)
        self.max_slots = int(target_backend.max_slots)
        config = head.config
        self._kv_shape = (config.num_kv_heads, self.capacity, config.head_dim)
        dtype_bytes = torch.empty((), dtype=self.dtype).element_size()
        self.slot_bytes = (2 * config.num_kv_heads * config.head_dim + config.hidden_size) * self.capacity * dtype_bytes
        self.forward_path = (f"an EAGLE-3 head over {target.spec.name}'s aux states (layers {list(config.aux_layers)}"
                             f"{', weight-only ' + quantization if quantization else ''})")
        self._gemms = _packed_gemms(head, self.device, quantization)
        self._cos, self._sin = _rotary_table(config, self.capacity, self.dtype, self.device)  # [capacity, d] each
        self._draft_ids = torch.arange(config.draft_vocab_size, device=self.device) + head.d2t  # [Vd]: target ids
        self._reset_slots()
        self.sessions: Any = None  # this head's SessionStore (attach_engine)
        self.recomputed_positions = 0  # committed positions whose target states were recomputed

    @classmethod
    def load(cls, spec: Any) -> Eagle3Backend:
        """The head of model entry ``spec`` over its target hosted in this process (:func:`hosting`),
        whose backend starts keeping the head's aux states; :class:`Eagle3Error` naming both when
        the head was made for another target, or naming the field when it cannot be served here."""
        target = hosted_target(spec.name, spec.path)
        backend = target.engine.backend
        model = backend.model
        head = load_head(spec.path, model, head_name=f"models.{spec.name} ({spec.path})",
                         target_name=f"models.{target.spec.name} ({target.spec.path})", dtype=model.dtype)
        try:
            backend.keep_aux(head.config.aux_layers)
        except ValueError as error:
            raise Eagle3Error(f"models.{spec.name}: an EAGLE-3 head needs its target's aux states: {error}") from None
        head.to(backend.device)
        logger.info("%s: an EAGLE-3 head over %s (aux layers %s, draft vocabulary %d)", spec.name, target.spec.name,
                    list(head.config.aux_layers), head.config.draft_vocab_size)
        return cls(head, target, spec.name, quantization=getattr(spec, "quantization", None))

    @property
    def dtype(self) -> torch.dtype:
        return self.head.fc.weight.dtype

    def attach_engine(self, engine: Any) -> None:
        """The head's own engine: its sessions tell a slot's committed context."""
        self.sessions = engine.sessions

    # -- slots ------------------------------------------------------------------------------
    def _reset_slots(self) -> None:
        self._free = list(range(self.max_slots))
        self._allocated: set[int] = set()
        self._storage: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def resize_slots(self, slots: int) -> None:
        """Hold ``slots`` slots from now on (no session open)."""
        if self._allocated:
            raise RuntimeError("resize_slots with sessions open")
        self.max_slots = int(slots)
        self._reset_slots()

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError(f"{self.name}: all {self.max_slots} slots are allocated")
        slot = heapq.heappop(self._free)
        self._allocated.add(slot)
        return slot

    def free(self, slot: int) -> None:
        self._allocated.discard(slot)
        heapq.heappush(self._free, slot)

    def free_slots(self) -> list[int]:
        return sorted(self._free)

    def held_columns(self, slot: int) -> int:
        """0: a head's columns are not shared with a new session (no prefix caching)."""
        return 0

    def copy_prefix(self, src_slot: int, dst_slot: int, length: int) -> None:
        """Nothing: no prefix is shared (:meth:`held_columns`)."""

    def truncate(self, slot: int, length: int) -> None:
        """Nothing to give back: a slot's storage is dense."""

    def _slot(self, slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Slot ``slot``'s keys, values ``[kv_heads, capacity, d]`` and pre-norm outputs ``[capacity, H]``."""
        if slot not in self._storage:
            keys = torch.zeros(self._kv_shape, dtype=self.dtype, device=self.device)
            features = torch.zeros((self.capacity, self.head.config.hidden_size), dtype=self.dtype, device=self.device)
            self._storage[slot] = (keys, torch.zeros_like(keys), features)
        return self._storage[slot]

    def copy_columns(self, slot: int, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy the keys/values and pre-norm outputs of columns ``src`` to ``dst``."""
        keys, values, features = self._slot(slot)
        source, target = list(src), list(dst)
        keys[:, target], values[:, target], features[target] = keys[:, source], values[:, source], features[source]

    # -- one forward ------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, rows: Sequence[RowWork]) -> list[torch.Tensor]:
        """Per row float32 logits ``[len(row.keep), V]`` over the target's vocabulary (``-inf``
        outside the draft vocabulary), in ``row.keep`` order."""
        return [self._row(row) for row in rows]

    def _row(self, row: RowWork) -> torch.Tensor:
        session = self.sessions.at_slot(row.slot) if self.sessions is not None else None
        if session is None:
            raise ValueError(f"{self.name}: no session on slot {row.slot}")
        committed = len(session.context)
        predecessors = [self._predecessor(row, i) if p >= committed else -1 for i, p in enumerate(row.positions)]
        features = self._committed_features(session, row)  # {token index: [H]}
        waves = self._waves(row, committed, predecessors)
        keys, values, stored = self._slot(row.slot)
        if len(waves) == 1 and len(features) == len(row):  # committed tokens only (the pending row): one forward
            out = self._layer(row, waves[0], torch.stack([features[i] for i in range(len(row))]), keys, values)  # [L, H]
            _write_columns(stored, row.columns, out)
            kept = out[list(row.keep)]  # [N_keep, H]
        else:
            prenorm = [None] * len(row)
            for wave in waves:
                wave_features = torch.stack([features[i] if i in features else stored[predecessors[i]] for i in wave])
                out = self._layer(row, wave, wave_features, keys, values)  # [Lw, H]
                _write_columns(stored, [row.columns[i] for i in wave], out)
                for i, value in zip(wave, out):
                    prenorm[i] = value
            kept = torch.stack([prenorm[i] for i in row.keep])  # [N_keep, H]
        draft = _linear(_norm(self.head.norm, kept), self._gemms["lm_head"], None).float()  # [N_keep, Vd]
        rows = draft.new_full((len(row.keep), self.vocab_size), float("-inf"))  # [N_keep, V]
        rows[:, self._draft_ids] = draft  # Eagle3Head.target_logits
        return rows

    @staticmethod
    def _predecessor(row: RowWork, index: int) -> int:
        """The column before token ``index``'s in what it sees (its chain's previous token, or the
        prefix's last column); -1 for none."""
        column = row.columns[index]
        seen = [c for c in row.attend[index] if c < column]
        return max(seen) if seen else row.prefix_length - 1

    def _waves(self, row: RowWork, committed: int, predecessors: list[int]) -> list[list[int]]:
        """Token indices in dependency order: a drafted token whose predecessor this row writes
        runs after it (a committed token reads the target's states: the first wave)."""
        written = {column: i for i, column in enumerate(row.columns)}
        level: dict[int, int] = {}
        for i, position in enumerate(row.positions):
            before = written.get(predecessors[i])
            level[i] = 0 if position < committed or before is None or before >= i else level[before] + 1
        return [[i for i in range(len(row)) if level[i] == wave] for wave in range(max(level.values()) + 1)]

    def _committed_features(self, session: Any, row: RowWork) -> dict[int, torch.Tensor]:
        """``fc`` of the target's aux states at ``p - 1`` for each committed token at position ``p``
        (zeros at position 0) -> {token index: ``[H]``}."""
        context = session.context
        wanted = {i: p for i, p in enumerate(row.positions) if p < len(context)}
        if not wanted:
            return {}
        before = sorted({p - 1 for p in wanted.values() if p >= 1})
        aux = self._target_aux(session.session_id, context, before)  # [len(before), 3 Ht]
        fused = _linear(aux.to(self.dtype), self._gemms["fc"], None) if before else None  # [len(before), H]
        index = {q: k for k, q in enumerate(before)}
        zeros = torch.zeros(self.head.config.hidden_size, dtype=self.dtype, device=self.device)
        return {i: fused[index[p - 1]] if p >= 1 else zeros for i, p in wanted.items()}

    def _target_aux(self, session_id: str, context: Sequence[int], positions: list[int]) -> torch.Tensor:
        """The target's aux states at committed ``positions`` of ``context`` -> ``[len, 3 Ht]``: read
        from its session's slot where it ran them, else its own forward over the context."""
        if not positions:
            return torch.empty(0)
        engine = self.target.engine
        with engine.sessions.lock:  # the target's slots as no step of it changes them
            target = engine.sessions.peek(session_id)
            columns = [_target_column(target, context, q) for q in positions]
            cache = engine.backend.cache
            if all(c is not None for c in columns) and all(c < cache.held_columns(target.slot) for c in columns):
                return cache.read_aux(target.slot, columns)
            self.recomputed_positions += len(positions)
            return self._prefill_target(engine, context[: max(positions) + 2])[positions]

    def _prefill_target(self, engine: Any, tokens: Sequence[int]) -> torch.Tensor:
        """The target's aux states ``[n - 1, 3 Ht]`` of ``tokens[:-1]`` (``n`` tokens), from its own
        forward in a slot of its prefix cache (what the cache holds of them reused), parked there
        afterwards: the target session that opens on these tokens next (a new request's first step)
        reuses those keys/values instead of computing them again (prefix caching)."""
        prefix = list(tokens[:-1])
        slot, reused = engine.prefix_cache.open(list(tokens))
        try:
            if reused < len(prefix):
                engine.backend.forward([linear_row(slot, reused, prefix[reused:], reused, keep=[len(prefix) - reused - 1])])
            return engine.backend.cache.read_aux(slot, range(len(prefix)))
        finally:
            engine.prefix_cache.release(slot, prefix)

    def _layer(self, row: RowWork, wave: list[int], features: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor) -> torch.Tensor:
        """The head's layer over tokens ``wave`` of ``row``: their keys/values written to their
        columns, attention over what each sees (never column 0 but from itself) -> pre-norm ``[Lw, H]``."""
        head, config = self.head, self.head.config
        layer = head.midlayer
        device = self.device
        tokens = torch.tensor([row.token_ids[i] for i in wave], device=device)  # [Lw]
        positions = torch.tensor([[row.positions[i] for i in wave]], device=device)  # [1, Lw]
        columns = [row.columns[i] for i in wave]
        embeds = _norm(layer.input_layernorm, head.embed_tokens(tokens).to(features.dtype))  # [Lw, H]
        x = torch.cat((embeds, _norm(layer.hidden_norm, features)), dim=-1)[None]  # [1, Lw, 2H]
        length, inner, kv = len(wave), config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        q, k, v = _linear(x, self._gemms["qkv"], None).split((inner, kv, kv), dim=-1)  # [1, Lw, h d | kvh d]
        q = q.reshape(1, length, config.num_heads, config.head_dim).transpose(1, 2)  # [1, h, Lw, d]
        k = k.reshape(1, length, config.num_kv_heads, config.head_dim).transpose(1, 2)  # [1, kvh, Lw, d]
        v = v.reshape(1, length, config.num_kv_heads, config.head_dim).transpose(1, 2)
        cos, sin = self._cos[positions[0]][None, None], self._sin[positions[0]][None, None]  # [1, 1, Lw, d]
        q, k = _rotate_with(q, cos, sin), _rotate_with(k, cos, sin)
        _write_columns(keys, columns, k[0], dim=1)
        _write_columns(values, columns, v[0], dim=1)
        total = max(row.end_column, max(columns) + 1)
        seen = _seen_run(row, wave[0]) if length == 1 else None
        if seen is not None:  # one token seeing one run of columns: attention over it, no mask
            out = F.scaled_dot_product_attention(q, keys[None, :, seen[0] : seen[1]], values[None, :, seen[0] : seen[1]],
                                                 enable_gqa=config.num_heads != config.num_kv_heads)  # [1, h, 1, d]
            return self._after_attention(out, features)
        if length == len(row) and is_causal_run(row):  # token i sees [0, c + i]: the causal block, column 0 left out
            mask = torch.ones((length, total), dtype=torch.bool, device=device).tril(total - length)  # [L, T]
            mask[int(row.columns[0] == 0):, 0] = False
            out = F.scaled_dot_product_attention(q, keys[None, :, :total], values[None, :, :total], attn_mask=mask[None, None],
                                                 enable_gqa=config.num_heads != config.num_kv_heads)  # [1, h, L, d]
            return self._after_attention(out, features)
        mask = torch.zeros((length, total), dtype=torch.bool)  # [Lw, T]
        for n, i in enumerate(wave):
            mask[n, : row.prefix_length] = True
            if isinstance(row.attend, RunAttend):
                first_start, first_end, second_start, second_end = row.attend.runs(i)
                mask[n, first_start:first_end] = True
                mask[n, second_start:second_end] = True
            else:
                mask[n, list(row.attend[i])] = True
            if row.columns[i] != 0:
                mask[n, 0] = False
        groups = config.num_heads // config.num_kv_heads
        seen_keys, seen_values = keys[None, :, :total], values[None, :, :total]  # [1, kvh, T, d]
        if groups > 1:
            seen_keys, seen_values = seen_keys.repeat_interleave(groups, dim=1), seen_values.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, seen_keys, seen_values, attn_mask=mask.to(device)[None, None])  # [1, h, Lw, d]
        return self._after_attention(out, features)

    def _after_attention(self, out: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """o_proj and the residual, then the MLP: ``out [1, h, Lw, d]``, ``features [Lw, H]`` -> pre-norm ``[Lw, H]``."""
        layer = self.head.midlayer
        hidden = features + _linear(out.transpose(1, 2).reshape(features.shape[0], -1), self._gemms["o_proj"], None)
        gate, up = _linear(_norm(layer.post_attention_layernorm, hidden), self._gemms["gate_up"], None).chunk(2, dim=-1)
        return hidden + _linear(F.silu(gate) * up, self._gemms["down_proj"], None)  # [Lw, H]


def _write_columns(storage: torch.Tensor, columns: Sequence[int], values: torch.Tensor, dim: int = 0) -> None:
    """``storage``'s ``columns`` along ``dim`` set to ``values`` (a slice where they are consecutive)."""
    columns = list(columns)
    if columns == list(range(columns[0], columns[0] + len(columns))):
        storage.narrow(dim, columns[0], len(columns)).copy_(values)
    else:
        storage.index_copy_(dim, torch.tensor(columns, device=storage.device), values)


def _seen_run(row: RowWork, index: int) -> tuple[int, int] | None:
    """The columns token ``index`` of ``row`` sees as one run ``[start, end)`` (column 0 left out
    but for the token at column 0), or None when they are not one run."""
    end = row.prefix_length
    if isinstance(row.attend, RunAttend):
        first_start, first_end, second_start, second_end = row.attend.runs(index)
        for start, stop in ((first_start, first_end), (second_start, second_end)):
            if stop > start:
                if start != end:
                    return None
                end = stop
    else:
        for column in row.attend[index]:
            if column != end:
                return None
            end += 1
    start = 0 if row.columns[index] == 0 else 1
    return (start, end) if end > start else None


def _norm(norm: Any, x: torch.Tensor) -> torch.Tensor:
    """The head's RMSNorm ``norm`` of ``x [..., H]`` (:class:`actors.model.eagle3._RMSNorm`): one
    ``F.rms_norm`` in float32, the module's own formula in other dtypes."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, x.shape[-1:], norm.weight, norm.eps)
    return norm(x)


def _rotary_table(config: Any, positions: int, dtype: torch.dtype, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos / sin of :func:`actors.model.eagle3._rotate` at positions ``0 .. positions - 1``, each
    ``[positions, d]`` (the same float64 angles, rounded to ``dtype``)."""
    dim = config.head_dim
    inverse = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim))  # [d/2]
    angles = torch.arange(positions, device=device).double()[:, None] * inverse  # [P, d/2]
    angles = torch.cat((angles, angles), dim=-1)  # [P, d]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_with(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`actors.model.eagle3._rotate` of ``x [B, heads, L, d]`` with its cos / sin ``[.., L, d]``."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _packed_gemms(head: Any, device: Any, quantization: str | None = None) -> dict[str, Any]:
    """The head's GEMM weights as the lean decoder runs them (:func:`actors.model.lean_decoder._linear`):
    q/k/v in one, gate/up in one, in oneDNN's layout where it has kernels for the dtype on this CPU;
    with ``quantization`` (``models.<head>.quantization``) weight-only int8 / int4 modules
    (:func:`actors.model.quantized.quantized_gemm`: a quarter to an eighth of the bytes a draft step reads)."""
    layer = head.midlayer
    if quantization is not None:
        from actors.model.quantized import QuantizationError, check_quantization

        try:
            check_quantization(quantization, head.fc.weight.dtype)
        except QuantizationError as error:
            raise Eagle3Error(f"EAGLE-3 head: {error}") from None
        if torch.device(device).type != "cpu":
            raise Eagle3Error(f"EAGLE-3 head: quantization {quantization!r} runs torch's CPU kernels; the head is on {device}")
    reorder = _ONEDNN and torch.device(device).type == "cpu" and head.fc.weight.dtype in ONEDNN_DTYPES
    linears = {"fc": [head.fc], "qkv": [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj],
               "o_proj": [layer.self_attn.o_proj], "gate_up": [layer.mlp.gate_proj, layer.mlp.up_proj],
               "down_proj": [layer.mlp.down_proj], "lm_head": [head.lm_head]}
    gemm = _gemm_fn(reorder, quantization)  # the lean decoder's: oneDNN's layout, or a quantized module
    return {name: gemm(torch.cat([linear.weight.detach() for linear in group]), None)[0] for name, group in linears.items()}


def _target_column(target: Any, context: Sequence[int], position: int) -> int | None:
    """The column of the target session ``target``'s slot holding committed ``position`` of
    ``context`` (its linear part, or the verified chain that agrees with ``context``), None where
    the target has not run it."""
    if target is None:
        return None
    if position < target.base:
        return position
    if not target.chains or target.base != target.chain_start:
        return None
    depth = position - target.base
    wanted = list(context[target.base : position + 1])
    for k, chain in enumerate(target.chains):
        if len(chain) > depth and list(chain[: depth + 1]) == wanted:
            return target.chain_start + k * target.chain_stride + depth
    return None
