"""Batched forward passes over paged KV caches, behind one small interface.

A backend owns the model and its :class:`actors.model.kv_cache.PagedKVCache`: it hands out cache
slots (``allocate`` / ``free``), moves cache entries inside a slot (``copy_columns``: keeping an
accepted draft) and runs ONE forward over the new tokens of many sessions (``forward`` over
:class:`actors.model.batch.RowWork` rows), returning logits only for the positions each row keeps.
The worker engine (:mod:`actors.worker.engine`) is written once against this interface;
:class:`SlotBackend` is the production implementation (a transformers causal LM loaded with
``from_pretrained``), and the tests plug in a backend whose logits are an exact function of the
tokens each position can see, which is what makes the distributed coordinator's output law
computable.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from actors.model.architectures import UnsupportedModelError, apply_head, resolve_architecture
from actors.model.batch import RowWork, build_batch, is_causal_run
from actors.model.decode_graphs import FixedDecode, decode_graphs
from actors.model.device_health import LeanFailures, raise_if_device_broken
from actors.model.grouped_attention import GROUPED_SDPA, use_grouped_attention
from actors.model.layer_masks import ColumnPositions, layer_masks
from actors.model.lean_decoder import build_lean_decoder

logger = logging.getLogger(__name__)

DEFAULT_MAX_CONTEXT = 2048

#: What one more forward costs, in padded token positions (how the engine splits a step's rows
#: into forwards: :func:`actors.worker.forward_plan.forward_groups`). CPU: measured on the embedded target,
#: one thread (a forward's fixed cost ~4.5 ms; a padded position 0.3-0.9 ms). CUDA: kernel
#: launches dominate small forwards and a padded position is nearly free; a guess, unmeasured.
FORWARD_OVERHEAD_TOKENS = {"cpu": 8, "cuda": 512}
#: The two lean forward paths whose failures are counted apart (:meth:`SlotBackend._lean_failed`).
ONE_ROW, BATCHED = "the one-row forward", "a batched forward"

#: Models this process loaded unquantized, by (checkpoint, revision, dtype, device): a weight-only
#: quantized copy of one (a draft that shares its target's worker) is built from its weights, the
#: checkpoint read once and the embeddings, norms and rotary tables held once.
_LOADED_MODELS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


class SlotBackend:
    """A transformers causal LM (``from_pretrained``) over a PagedKVCache, served exactly or refused.

    Each session owns a cache slot (:meth:`allocate` / :meth:`free`); :meth:`forward` runs the
    new tokens of many sessions (:class:`~actors.model.batch.RowWork` rows) in ONE model forward and
    computes logits only for the positions each row keeps. The model's config is resolved to an
    :class:`~actors.model.architectures.Architecture` first (refused with
    :class:`~actors.model.architectures.UnsupportedModelError` when the engine cannot reproduce its
    law): its layers get their own masks (sliding windows from the keys' positions,
    :mod:`actors.model.layer_masks`), it runs under the attention implementation its law needs (eager,
    with an additive float mask, where the model soft-caps attention scores) and its logits go
    through the model's own head (logit scaling, soft-capping: :func:`~actors.model.architectures.apply_head`).
    GQA models read their grouped keys/values in place (:mod:`actors.model.grouped_attention`).

    With ``lean_forward`` a Llama-shaped model (Llama, Mistral, Qwen2, Qwen3) runs the lean decoder
    forward (:mod:`actors.model.lean_decoder`: the same law, less work around the ops); other models,
    or with it off, run their own decoder module.

    A slot reaches ``max_context`` (capped by ``max_model_len``) plus ``scratch_columns`` columns in
    blocks of a pool as large as ``kv_cache_memory`` holds (:mod:`actors.model.kv_budget`), ``max_slots``
    whole slots when it is None.
    """

    def __init__(
        self, model: Any, device: str, max_context: int | None = None, *, max_slots: int = 64,
        scratch_columns: int = 64, name: str | None = None,
        max_model_len: int | None = None, kv_cache_memory: int | float | None = None, lean_forward: bool = True,
        cuda_graphs: bool = False, lean: tuple[Any, str] | None = None,
    ):
        from actors.model.kv_budget import context_limit, plan_kv_slots
        from actors.model.kv_cache import PagedKVCache

        name = name or str(getattr(model.config, "_name_or_path", "") or type(model).__name__)
        self.architecture = resolve_architecture(model.config, name)  # UnsupportedModelError: refused
        attn = getattr(model.config, "_attn_implementation", None)
        # A model another backend of this process serves already (a quantized copy's) is switched to grouped sdpa.
        switched = attn == GROUPED_SDPA and self.architecture.attn_implementation == "sdpa"
        if attn != self.architecture.attn_implementation and not switched:
            raise UnsupportedModelError(
                name, f"attn_implementation={attn!r}; this architecture is served with "
                      f"{self.architecture.attn_implementation!r} (load it with SlotBackend.load)")
        if scratch_columns < 0:
            raise ValueError(f"scratch_columns must be >= 0, got {scratch_columns}")
        # GQA models read their grouped keys/values in place (no per-layer repeat; same law).
        self.grouped_attention = use_grouped_attention(model) or switched
        self.model = model
        self.device = device
        self.vocab_size = int(model.config.vocab_size)
        # The context a request may use here: max_model_len, at most the model's own.
        self.max_context = context_limit(int(max_context or _config_context(model.config)), max_model_len, name)
        self.capacity = self.max_context + scratch_columns  # columns per slot
        # The KV cache's dtype: the model's, or a quantized copy's activations' (actors.model.quantized.ACTIVATION_DTYPES).
        self.kv_dtype = getattr(lean[0], "dtype", model.dtype) if lean else model.dtype
        # Slots: as many as the KV budget holds (actors.model.kv_budget); max_slots when there is none.
        self.max_slots, self.slot_bytes, num_blocks = plan_kv_slots(
            model.config, model=name, max_model_len=self.max_context, capacity=self.capacity, dtype=self.kv_dtype,
            device=device, kv_cache_memory=kv_cache_memory, default_slots=max_slots,
            sliding=self.architecture.has_sliding_layers,
        )
        self.forward_overhead_tokens = FORWARD_OVERHEAD_TOKENS.get(torch.device(device).type, FORWARD_OVERHEAD_TOKENS["cuda"])
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.name = name
        # The lean decoder (actors.model.lean_decoder) where asked for and covered; None: the model's own.
        # ``lean``: built by the caller (a quantized copy's, SlotBackend.load), with its path in words.
        self.lean, self.forward_path = lean or (build_lean_decoder(model, self.architecture, name) if lean_forward
                                                else (None, "its own decoder (engine.lean_forward is off)"))
        self.one_row_forward = True  # a forward of one causal row may take _forward_run (off once the lean path is dropped)
        self.lean_failures = LeanFailures()  # failed lean forwards (actors.model.device_health)
        # The block pool is allocated up front: the worker's memory is known at start-up.
        self.cache = PagedKVCache.from_config(model.config, capacity=self.capacity, max_slots=self.max_slots,
                                              num_blocks=num_blocks, dtype=self.kv_dtype, device=device)
        # Sliding-window layers mask by key position, which a column does not tell (chains).
        self.positions = (ColumnPositions(self.max_slots, self.capacity + 1, device)
                          if self.architecture.has_sliding_layers else None)
        # engine.cuda_graphs: one-token decodes of a lone row replay a CUDA graph (actors.model.decode_graphs)
        self.decode_graphs = decode_graphs(self, cuda_graphs)
        self.aux_layers: tuple[int, ...] = ()  # layers whose inputs the cache keeps (keep_aux)

    @classmethod
    def load(
        cls, path: str, *, dtype: str | None = "float32", revision: str | None = None, device: str = "cpu",
        max_context: int | None = None, max_slots: int = 64, scratch_columns: int = 64,
        max_model_len: int | None = None, kv_cache_memory: int | float | None = None, lean_forward: bool = True,
        quantization: str | None = None, cuda_graphs: bool = False,
    ) -> SlotBackend:
        """Load with ``AutoModelForCausalLM.from_pretrained`` (local dirs never touch the hub).
        ``dtype`` None: the checkpoint's own on a GPU, float32 on CPU (:func:`actors.model.kv_budget.resolve_dtype`);
        ``max_model_len`` / ``kv_cache_memory``: the context and the KV budget (:mod:`actors.model.kv_budget`);
        ``quantization``: a weight-only quantized copy (:mod:`actors.model.quantized`): the lean decoder over
        int8 / int4 GEMMs where the family has it (built from the weights of the same checkpoint when this
        process loaded it already, :data:`_LOADED_MODELS`: no second read), else its own decoder over
        quantized linears.
        ``cuda_graphs``: decode steps replay CUDA graphs (:mod:`actors.model.decode_graphs`)."""
        from transformers import AutoConfig, AutoModelForCausalLM

        from actors.model.kv_budget import resolve_dtype

        local = os.path.isdir(path)
        config = AutoConfig.from_pretrained(path, revision=revision, local_files_only=local)
        architecture = resolve_architecture(config, path)  # refused before any weight is read
        dtype = resolve_dtype(dtype, device, config)
        key = (os.path.realpath(path) if local else path, revision, dtype, device)
        options = dict(max_slots=max_slots, scratch_columns=scratch_columns, name=path, max_model_len=max_model_len,
                       kv_cache_memory=kv_cache_memory, lean_forward=lean_forward, cuda_graphs=cuda_graphs)
        loaded = _LOADED_MODELS.get(key) if quantization is not None and lean_forward else None
        if loaded is not None:
            lean = build_lean_decoder(loaded, architecture, f"{path} ({quantization} copy)", quantization)
            if lean[0] is not None:
                logger.info("%s: a weight-only %s copy built from the weights this process loaded", path, quantization)
                return cls(loaded, device, max_context, lean=lean, **options)
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=getattr(torch, dtype),
            revision=revision,
            local_files_only=local,
            attn_implementation=architecture.attn_implementation,
        )
        model.to(device).eval()
        logger.info("loaded %s (%s, %s, %s) on %s", path, type(model).__name__, dtype,
                    architecture.attn_implementation, device)
        lean = None
        if quantization is not None:
            lean = _quantized_copy(model, architecture, path, quantization, lean_forward)
        else:
            _LOADED_MODELS[key] = model
        return cls(model, device, max_context, lean=lean, **options)

    def resize_slots(self, slots: int) -> None:
        """Hold ``slots`` slots from now on (a new, empty cache): the worker that hosts several models
        sizes their one KV budget once all of them are loaded (:mod:`actors.worker.device_worker`)."""
        from actors.model.kv_cache import PagedKVCache

        if self.cache.allocated:
            raise RuntimeError("resize_slots with sessions open")
        self.max_slots = int(slots)
        reclaim = self.cache.reclaim
        self.cache = None  # the old storage is freed before the new one is allocated
        self.cache = PagedKVCache.from_config(self.model.config, capacity=self.capacity, max_slots=self.max_slots,
                                              dtype=self.kv_dtype, device=self.device)
        self.cache.reclaim = reclaim
        if self.aux_layers:
            self.keep_aux(self.aux_layers)
        self.positions = (ColumnPositions(self.max_slots, self.capacity + 1, self.device)
                          if self.architecture.has_sliding_layers else None)
        if self.decode_graphs is not None and not self.aux_layers:  # the graphs read the old storage's addresses
            self.decode_graphs = decode_graphs(self, True)

    def keep_aux(self, layers: Sequence[int]) -> None:
        """Keep the inputs of ``layers`` (an EAGLE-3 head's aux states, :mod:`actors.model.eagle3_serving`)
        per (slot, column) from now on, next to the keys/values; the lean decoder writes them, so a
        backend running its model's own decoder refuses (ValueError saying why)."""
        if self.lean is None:
            raise ValueError(f"{self.name} runs {self.forward_path}: only the lean decoder keeps the aux states an "
                             f"EAGLE-3 head reads (engine.lean_forward: true, a Llama-shaped target)")
        width = len(layers) * int(self.model.config.hidden_size)
        if not self.aux_layers:  # a slot's share of the worker's KV budget (actors.worker.device_worker)
            self.slot_bytes += self.capacity * width * self.cache.storage.element_size()
        self.aux_layers = tuple(int(i) for i in layers)
        self.lean.aux_layers = self.aux_layers
        self.decode_graphs = None  # a captured graph would not write them
        self.cache.enable_aux(width)

    def allocate(self) -> int:
        """A free cache slot for a new session."""
        return self.cache.allocate()

    def free(self, slot: int) -> None:
        """Give ``slot`` back."""
        self.cache.free(slot)

    def free_slots(self) -> list[int]:
        """Slots not handed out (their stale keys/values intact), lowest first."""
        return self.cache.free_slots()

    def copy_prefix(self, src_slot: int, dst_slot: int, length: int) -> None:
        """Copy every layer's keys/values of columns ``[0, length)`` from one slot to another."""
        self.cache.copy_prefix(src_slot, dst_slot, length)
        if self.positions is not None:
            self.positions.copy_prefix(src_slot, dst_slot, length)

    def truncate(self, slot: int, length: int) -> None:
        """Give back ``slot``'s KV blocks past its first ``length`` columns (rollback)."""
        self.cache.truncate(slot, length)

    def held_columns(self, slot: int) -> int:
        """The leading columns of ``slot`` that KV blocks still back."""
        return self.cache.held_columns(slot)

    def block_counts(self) -> dict[str, int]:
        """The KV block pool: ``{"total", "free", "used", "cached"}`` blocks."""
        return self.cache.block_counts()

    def copy_columns(self, slot: int, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy every layer's keys/values in ``slot`` from columns ``src`` to columns ``dst``."""
        self.cache.copy_columns(slot, src, dst)
        if self.positions is not None:
            self.positions.copy_columns(slot, src, dst)

    @torch.inference_mode()
    def forward(self, rows: Sequence[RowWork]) -> list[torch.Tensor]:
        """One model forward over ``rows`` -> per row float32 logits ``[len(row.keep), V]`` on
        ``self.device``, in ``row.keep`` order. Every row's new keys/values land in its slot. A
        device error other than out-of-memory raises
        :class:`~actors.model.device_health.DeviceBrokenError` (the worker restarts)."""
        if not rows:
            return []
        for row in rows:
            if not self.cache.is_allocated(row.slot):
                raise ValueError(f"RowWork.slot {row.slot} is not allocated")
        try:
            return self._forward(rows)
        except Exception as error:
            raise_if_device_broken(error, self.name)
            raise

    def _forward(self, rows: Sequence[RowWork]) -> list[torch.Tensor]:
        """:meth:`forward` of checked rows: one row alone where it may (:meth:`_runs_alone`), else batched."""
        if len(rows) == 1 and self._runs_alone(rows[0]):
            try:
                graphs = self.decode_graphs if self.decode_graphs is not None and FixedDecode.covers(rows[0]) else None
                logits = graphs.run(rows[0]) if graphs is not None else None
                logits = self._forward_run(rows[0]) if logits is None else logits
                self.lean_failures.succeeded(ONE_ROW)
                return [logits]
            except Exception as error:  # noqa: BLE001 - the batched path rewrites the same columns
                self._lean_failed(error, ONE_ROW)
        batch = build_batch(rows, capacity=self.capacity, device=self.device)
        key_positions = None
        if self.positions is not None:
            self.positions.record(batch.slots, batch.write_columns, batch.position_ids)
            key_positions = self.positions.key_positions(batch.slots, batch.kv_length)  # [B, T_kv]
        attention_mask = layer_masks(self.architecture, batch.attention_mask, batch.position_ids, key_positions,
                                     self.model.dtype)  # [B, 1, L, T_kv], or one per layer type
        self.cache.bind(batch.slots, batch.write_columns, batch.kv_length)
        try:
            hidden, lean = self._decoder_forward(batch.input_ids, batch.position_ids, attention_mask)  # [B, L, hidden]
        finally:
            self.cache.unbind()
        kept = hidden.reshape(-1, hidden.shape[-1]).index_select(0, batch.keep_index)  # [N_keep, hidden]
        head = self.lean.head(self.lm_head, kept) if lean else self.lm_head(kept)  # [N_keep, V]
        logits = apply_head(self.architecture, head).float()  # [N_keep, V]: the model's own head
        per_row: list[torch.Tensor] = [None] * len(rows)  # type: ignore[list-item]
        for index, row_logits in zip(batch.row_order, logits.split(batch.keep_counts)):
            per_row[index] = row_logits  # [len(keep), V]
        return per_row

    def _lean_failed(self, error: Exception, path: str) -> None:
        """A lean forward of ``path`` (:data:`ONE_ROW` or :data:`BATCHED`) raised ``error``: a broken
        device raises on; otherwise it is logged and counted, and after
        :data:`~actors.model.device_health.LEAN_FAILURES_IN_A_ROW` in a row that path is dropped for
        good (the one-row forward; for the batched one the lean decoder). The caller runs this
        forward again (the batched path; the model's own decoder)."""
        raise_if_device_broken(error, self.name)
        if not self.lean_failures.failed(path):
            logger.warning("%s: %s on the lean decoder failed (%s: %s; %d so far); this forward runs %s, the next tries "
                           "it again", self.name, path, type(error).__name__, error, self.lean_failures.total,
                           "batched" if path == ONE_ROW else "the model's own decoder")
            return
        logger.error("%s: %s on the lean decoder failed %d times in a row (%s: %s); %s from now on", self.name, path,
                     self.lean_failures.in_a_row[path], type(error).__name__, error,
                     "every forward runs batched" if path == ONE_ROW else "running the model's own decoder")
        self.one_row_forward = False
        if path == BATCHED:
            self.lean = None
            self.forward_path = f"its own decoder (the lean decoder failed: {type(error).__name__})"

    def _runs_alone(self, row: RowWork) -> bool:
        """Whether ``row``, the forward's only row, takes :meth:`_forward_run`: the lean decoder
        over a model with no sliding layers, and an ordinary causal row (:func:`is_causal_run`)."""
        return (self.one_row_forward and self.lean is not None and self.positions is None
                and not self.architecture.has_sliding_layers
                and row.columns[0] + len(row) <= self.capacity and is_causal_run(row))

    def _forward_run(self, row: RowWork) -> torch.Tensor:
        """:meth:`forward` of one causal row (:meth:`_runs_alone`) with nothing padded or gathered:
        its new keys/values copied into their columns, attention over the slot in place, no mask
        for one token (it sees every column up to its own) and the causal block at the end of the
        key columns for more -> float32 logits ``[len(row.keep), V]``. The same products as the
        batched path (``tests/actors/model/test_lean_decoder.py`` compares them); a lone request's
        decode and draft steps, where the ops around the GEMMs are most of a small model's
        forward (the embedded draft's 1 x 1: 0.5 ms batched, 0.3 ms here; ``python -m
        benchmarks.micro.forward_micro --model draft --rows 1``)."""
        start, length = row.columns[0], len(row)
        columns = start + length  # T_kv: every column of the slot up to the row's last
        tokens = torch.tensor((row.token_ids, row.positions), dtype=torch.long, device=self.device)  # [2, L]
        mask = None if length == 1 else torch.ones(
            (length, columns), dtype=torch.bool, device=self.device).tril(columns - length)[None, None]  # [1, 1, L, T_kv]
        self.cache.bind_run(row.slot, start, length)
        try:
            hidden = self.lean(tokens[:1], tokens[1:], mask, self.cache)  # [1, L, hidden]
        finally:
            self.cache.unbind()
        keep = row.keep
        first = keep[0] if keep else 0
        if keep == tuple(range(first, first + len(keep))):  # a run of positions (decode: the last; verify: all)
            kept = hidden[0, first : first + len(keep)]  # [N_keep, hidden]
        else:
            kept = hidden[0].index_select(0, torch.tensor(keep, dtype=torch.long, device=self.device))  # [N_keep, hidden]
        return apply_head(self.architecture, self.lean.head(self.lm_head, kept)).float()  # [N_keep, V]

    def _decoder_forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | dict[str, torch.Tensor],
    ) -> tuple[torch.Tensor, bool]:
        """The decoder over the bound cache: ``[B, L]`` ids and positions -> (``[B, L, hidden]``,
        whether the lean path ran): the lean path (:mod:`actors.model.lean_decoder`) where it was
        built, the model's own decoder where not or when it fails (:meth:`_lean_failed`)."""
        if self.lean is not None:
            try:
                hidden = self.lean(input_ids, position_ids, attention_mask, self.cache)
                self.lean_failures.succeeded(BATCHED)
                return hidden, True
            except Exception as error:  # the model's own decoder rewrites the same columns (or, a copy of its own dtype, raises)
                if self.kv_dtype != self.model.dtype:  # a copy caching in its own dtype: the model's decoder cannot
                    raise
                self._lean_failed(error, BATCHED)
        output = self.decoder(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                              past_key_values=self.cache, use_cache=True)
        return output.last_hidden_state, False


def _config_context(config: Any) -> int:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    logger.warning("model config names no context length; assuming %d", DEFAULT_MAX_CONTEXT)
    return DEFAULT_MAX_CONTEXT


def _quantized_copy(model: Any, architecture: Any, path: str, quantization: str, lean_forward: bool) -> tuple[Any, str]:
    """Quantize a freshly loaded ``model`` in place -> its lean decoder over int8 / int4 GEMMs (built
    from the float weights first) and its path in words; its own decoder over quantized linears
    where the lean decoder is off or does not cover it."""
    from actors.model.quantized import quantize_model

    lean, words = build_lean_decoder(model, architecture, path, quantization) if lean_forward else (None, "")
    own = quantize_model(model, quantization, path)  # the float linears replaced, and freed
    if lean is None:
        return None, own
    lean.drop_float_head()  # the model's head is quantized now: the lean path calls it
    return lean, words
