"""EAGLE-3 draft heads: the checkpoint format vLLM and SGLang read, and the chains they propose.

An EAGLE-3 head (Li et al., "EAGLE-3: Scaling up Inference Acceleration of Large Language Models
via Training-Time Test", arXiv:2503.01840) is ONE decoder layer that reads the target's own hidden
states: the inputs of three of the target's layers (low, mid, high) at a position, concatenated
``[3 * target_hidden]`` and projected by ``fc`` to the head's width, together with the embedding of
the next token. The layer's attention takes both, concatenated ``[2 * hidden]``; its output
(before the final norm) is the feature of the next position, so a chain continues on the head's
own features where the target has not run yet.

Format read (a directory with ``config.json`` and ``model.safetensors``, as published for
vLLM's ``llama_eagle3.py`` and SGLang's ``llama_eagle3.py``):

* config keys: ``architectures`` (one of :data:`EAGLE3_ARCHITECTURES`), ``hidden_size``,
  ``intermediate_size``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim`` (default
  ``hidden_size / heads``), ``rms_norm_eps``, ``rope_theta`` (or ``rope_parameters.rope_theta``),
  ``vocab_size`` (the target's), ``draft_vocab_size`` (default ``vocab_size``),
  ``target_hidden_size`` (default ``hidden_size``), ``eagle_aux_hidden_state_layer_ids`` (or
  under ``eagle_config``: the target layers whose INPUT is read, i.e. transformers'
  ``hidden_states[i]``; default vLLM's ``(2, L // 2, L - 3)`` for an ``L``-layer target);
* tensors: ``fc.weight`` ``[hidden, 3 * target_hidden]``; ``midlayer.input_layernorm.weight``,
  ``midlayer.hidden_norm.weight``, ``midlayer.post_attention_layernorm.weight`` ``[hidden]``;
  ``midlayer.self_attn.{q,k,v}_proj.weight`` ``[heads * head_dim, 2 * hidden]``,
  ``midlayer.self_attn.o_proj.weight``; ``midlayer.mlp.{gate,up,down}_proj.weight``;
  ``norm.weight``; ``lm_head.weight`` ``[draft_vocab, hidden]``; ``d2t`` ``[draft_vocab]`` int64
  (target id = draft id + ``d2t[draft id]``); ``t2d`` ``[vocab]`` bool (read, not needed);
  ``embed_tokens.weight`` ``[vocab, hidden]`` when present, else the target's input embeddings
  (as vLLM shares them).

A head whose ``target_hidden_size`` or ``vocab_size`` is not its target's, or whose layer ids are
not the target's layers, is refused at load naming both (:class:`Eagle3Error`).

The chain law (:meth:`Eagle3Head.chain_logits`): after committed tokens ``c_0 .. c_{n-1}`` whose
target aux states ``a_0 .. a_{n-2}`` are known (the target's forward over them), head position
``j`` (1 <= j < n) reads ``(embed(c_j), fc(a_{j-1}))``; chain step ``k`` reads
``(embed(d_{k-1}), f_{n+k-2})``, ``f`` the head's own pre-norm output one position back
(``d_{-1} = c_{n-1}``, whose feature is the target's). Each output's row is over the TARGET
vocabulary: the draft vocabulary's logits scattered through ``d2t``, ``-inf`` (probability 0)
elsewhere. The rows are a function of the committed tokens and the chain alone, so every rule that
takes a draft model verifies them and the output law stays the target's.

Served as a draft model in its target's worker by :mod:`actors.model.eagle3_serving`: the target's
lean decoder keeps the inputs of the aux layers per (slot, column) in its paged cache, and the
head's backend runs :meth:`Eagle3Head.layer`'s computation over its own cache on them.
"""

from __future__ import annotations

import json
import math
import pathlib
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

#: The ``architectures`` names of EAGLE-3 Llama heads (EAGLE's, vLLM's spelling).
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


class Eagle3Error(ValueError):
    """An EAGLE-3 head that cannot serve its target (format, hidden size, vocabulary, layers)."""


def default_aux_layers(num_target_layers: int) -> tuple[int, int, int]:
    """vLLM's default aux layers of an ``L``-layer target: ``(2, L // 2, L - 3)``."""
    return (2, num_target_layers // 2, num_target_layers - 3)


@dataclass(frozen=True)
class Eagle3Config:
    """The config keys an EAGLE-3 head is built from (see the module docstring)."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...]
    max_position_embeddings: int = 2048

    @classmethod
    def from_dict(cls, config: dict[str, Any], num_target_layers: int, where: str = "eagle3") -> Eagle3Config:
        """Read ``config.json``'s keys; :class:`Eagle3Error` naming ``where`` for a non-EAGLE-3 head."""
        architectures = list(config.get("architectures") or [])
        if not set(architectures) & set(EAGLE3_ARCHITECTURES):
            raise Eagle3Error(f"{where}: architectures {architectures} is not an EAGLE-3 head (expected one of "
                              f"{list(EAGLE3_ARCHITECTURES)})")
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        rope = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta") or 10000.0
        aux = config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get(
            "eagle_aux_hidden_state_layer_ids")
        return cls(
            hidden_size=hidden, intermediate_size=int(config["intermediate_size"]), num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads), rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope), vocab_size=int(config["vocab_size"]),
            draft_vocab_size=int(config.get("draft_vocab_size") or config["vocab_size"]),
            target_hidden_size=int(config.get("target_hidden_size") or hidden),
            aux_layers=tuple(int(i) for i in aux) if aux else default_aux_layers(num_target_layers),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        )

    def to_dict(self) -> dict[str, Any]:
        """``config.json`` in the published format (what :meth:`from_dict` reads back)."""
        fields = asdict(self)
        return {
            "architectures": [EAGLE3_ARCHITECTURES[0]], "model_type": "llama", "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim, "num_hidden_layers": 1,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta, "hidden_act": "silu",
            "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size, "max_position_embeddings": fields["max_position_embeddings"],
            "eagle_aux_hidden_state_layer_ids": list(self.aux_layers), "tie_word_embeddings": False,
        }


def check_target(config: Eagle3Config, target_config: Any, head: str, target: str) -> None:
    """Refuse a head for another target: its ``target_hidden_size`` / ``vocab_size`` / aux layers
    against the target's ``hidden_size`` / ``vocab_size`` / ``num_hidden_layers``, naming both."""
    hidden, vocab = int(target_config.hidden_size), int(target_config.vocab_size)
    layers = int(target_config.num_hidden_layers)
    if config.target_hidden_size != hidden:
        raise Eagle3Error(f"eagle3 head {head}: target_hidden_size {config.target_hidden_size} does not match "
                          f"target {target}'s hidden_size {hidden}")
    if config.vocab_size != vocab:
        raise Eagle3Error(f"eagle3 head {head}: vocab_size {config.vocab_size} does not match target {target}'s "
                          f"vocab_size {vocab}")
    if len(config.aux_layers) != 3 or not all(0 <= i < layers for i in config.aux_layers):
        raise Eagle3Error(f"eagle3 head {head}: eagle_aux_hidden_state_layer_ids {list(config.aux_layers)} are not "
                          f"three of target {target}'s {layers} layers")


class _RMSNorm(torch.nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., size]`` normalized in float32, returned in ``x``'s dtype."""
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype)


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's rotary embedding: ``x [B, heads, L, d]`` at ``positions [B, L]``."""
    dim = x.shape[-1]
    inverse = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=x.device) / dim))  # [d/2]
    angles = positions[..., None].double() * inverse  # [B, L, d/2]
    angles = torch.cat((angles, angles), dim=-1)[:, None]  # [B, 1, L, d]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    half = dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class _Attention(torch.nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        inner, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.q_proj = torch.nn.Linear(2 * config.hidden_size, inner, bias=False)
        self.k_proj = torch.nn.Linear(2 * config.hidden_size, kv, bias=False)
        self.v_proj = torch.nn.Linear(2 * config.hidden_size, kv, bias=False)
        self.o_proj = torch.nn.Linear(inner, config.hidden_size, bias=False)
        self.config = config

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor] | None,
                mask: torch.Tensor | None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """``x [B, L, 2H]``; ``cache`` keys/values ``[B, kv_heads, T, d]`` before these positions;
        ``mask`` ``[B or 1, 1, L, T + L]`` bool (None: causal over the new positions, all of the
        cache) -> (``[B, L, H]``, the cache with these positions appended)."""
        c = self.config
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, c.num_heads, c.head_dim).transpose(1, 2)  # [B, h, L, d]
        k = self.k_proj(x).view(batch, length, c.num_kv_heads, c.head_dim).transpose(1, 2)  # [B, kvh, L, d]
        v = self.v_proj(x).view(batch, length, c.num_kv_heads, c.head_dim).transpose(1, 2)  # [B, kvh, L, d]
        q, k = _rotate(q, positions, c.rope_theta), _rotate(k, positions, c.rope_theta)
        if cache is not None:
            k, v = torch.cat((cache[0], k), dim=2), torch.cat((cache[1], v), dim=2)  # [B, kvh, T + L, d]
        if mask is None:
            total = k.shape[2]
            mask = torch.ones(length, total, dtype=torch.bool, device=x.device).tril(total - length)[None, None]
        groups = c.num_heads // c.num_kv_heads
        keys, values = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)  # [B, h, L, d]
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1)), (k, v)


class _MLP(torch.nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.gate_proj = torch.nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = torch.nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = torch.nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(torch.nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.input_layernorm = _RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = _RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = _Attention(config)
        self.post_attention_layernorm = _RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = _MLP(config)


class Eagle3Head(torch.nn.Module):
    """One EAGLE-3 head (module names are the checkpoint's tensor names)."""

    def __init__(self, config: Eagle3Config, embed_tokens: torch.nn.Embedding | None = None):
        super().__init__()
        self.config = config
        self.embed_tokens = embed_tokens or torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.fc = torch.nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = _MidLayer(config)
        self.norm = _RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = torch.nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))

    def layer(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
              cache: tuple[torch.Tensor, torch.Tensor] | None = None, mask: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The midlayer: ``tokens [B, L]``, ``features [B, L, H]`` (fused target states or the
        head's own), ``positions [B, L]`` -> (pre-norm outputs ``[B, L, H]``, the extended cache)."""
        layer = self.midlayer
        embeds = layer.input_layernorm(self.embed_tokens(tokens).to(features.dtype))  # [B, L, H]
        x = torch.cat((embeds, layer.hidden_norm(features)), dim=-1)  # [B, L, 2H]
        attended, cache = layer.self_attn(x, positions, cache, mask)
        hidden = features + attended  # [B, L, H]: the residual is the feature
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden)), cache

    def draft_logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """Logits over the DRAFT vocabulary ``[..., Vd]`` from pre-norm outputs ``[..., H]``."""
        return self.lm_head(self.norm(prenorm))

    def target_logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """Logits over the TARGET vocabulary ``[..., V]``: the draft vocabulary's at ``id + d2t[id]``,
        ``-inf`` elsewhere (probability 0)."""
        draft = self.draft_logits(prenorm)  # [..., Vd]
        ids = torch.arange(self.config.draft_vocab_size, device=draft.device) + self.d2t  # [Vd]
        rows = draft.new_full((*draft.shape[:-1], self.config.vocab_size), float("-inf"))
        rows[..., ids] = draft
        return rows

    def prefill(self, tokens: torch.Tensor, aux: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The committed context: ``tokens [n]`` (n >= 2) and the target's aux states ``aux [n - 1, 3Ht]``
        of positions ``0 .. n-2`` -> (the last position's pre-norm output ``[H]``, the cache of
        head positions ``1 .. n-1``)."""
        if tokens.shape[0] < 2 or aux.shape[0] != tokens.shape[0] - 1:
            raise ValueError(f"prefill wants n >= 2 tokens and n - 1 aux rows, got {tokens.shape[0]} and {aux.shape[0]}")
        features = self.fc(aux.to(self.fc.weight.dtype))[None]  # [1, n-1, H]
        positions = torch.arange(1, tokens.shape[0], device=tokens.device)[None]  # [1, n-1]
        prenorm, cache = self.layer(tokens[None, 1:], features, positions)
        return prenorm[0, -1], cache

    def extend(self, token: torch.Tensor, feature: torch.Tensor, position: int,
               cache: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One chain step for ``B`` chains: ``token [B]``, ``feature [B, H]`` (the previous
        position's output) at ``position`` -> (pre-norm output ``[B, H]``, the extended cache)."""
        positions = torch.full((token.shape[0], 1), position, device=token.device)
        prenorm, cache = self.layer(token[:, None], feature[:, None], positions, cache)
        return prenorm[:, 0], cache

    @torch.no_grad()
    def chain_logits(self, tokens: torch.Tensor, aux: torch.Tensor, chain: torch.Tensor) -> torch.Tensor:
        """Target-vocabulary logits ``[V]`` of the token after ``tokens`` (committed, ``[n]``) and
        ``chain`` (``[k]`` drafted), recomputed from scratch: the law the served proposer keeps."""
        prenorm, cache = self.prefill(tokens, aux)
        for k, token in enumerate(chain.tolist()):
            step = torch.tensor([token], device=tokens.device)
            out, cache = self.extend(step, prenorm[None], tokens.shape[0] + k, cache)
            prenorm = out[0]
        return self.target_logits(prenorm)


def target_aux_states(target: Any, tokens: torch.Tensor, layers: tuple[int, ...]) -> torch.Tensor:
    """The aux states of a transformers causal LM: the inputs of ``layers`` (``output_hidden_states``
    index ``i`` is layer ``i``'s input) over ``tokens [B, L]`` -> ``[B, L, 3 * hidden]``."""
    out = target.model(input_ids=tokens, output_hidden_states=True)
    return torch.cat([out.hidden_states[i] for i in layers], dim=-1)


def save_head(head: Eagle3Head, directory: str | pathlib.Path, *, dtype: torch.dtype = torch.float16,
              with_embeddings: bool = False) -> pathlib.Path:
    """Write ``config.json`` and ``model.safetensors`` in the published format (``embed_tokens``
    only with ``with_embeddings``: by default the target's are shared)."""
    from safetensors.torch import save_file

    out = pathlib.Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().contiguous() for name, tensor in head.state_dict().items()
             if with_embeddings or not name.startswith("embed_tokens.")}
    state = {name: tensor.to(dtype) if tensor.is_floating_point() else tensor for name, tensor in state.items()}
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(head.config.to_dict(), indent=2, sort_keys=True) + "\n")
    return out


def load_head(directory: str | pathlib.Path, target: Any, *, head_name: str | None = None,
              target_name: str = "target", dtype: torch.dtype = torch.float32) -> Eagle3Head:
    """Load the head in ``directory`` for ``target`` (a transformers causal LM whose input
    embeddings are shared when the head has none, copied when ``dtype`` is not theirs); refused (:class:`Eagle3Error`) when it is not
    an EAGLE-3 head or was made for another target."""
    from safetensors.torch import load_file

    path = pathlib.Path(directory)
    name = head_name or str(path)
    try:
        raw = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise Eagle3Error(f"eagle3 head {name}: no config.json") from None
    config = Eagle3Config.from_dict(raw, int(target.config.num_hidden_layers), f"eagle3 head {name}")
    check_target(config, target.config, name, target_name)
    state = load_file(str(path / "model.safetensors"))
    shared = None if "embed_tokens.weight" in state else target.get_input_embeddings()
    if shared is not None and shared.weight.dtype != dtype:  # a copy in the head's dtype; the target's stays
        shared = torch.nn.Embedding.from_pretrained(shared.weight.detach().to(dtype), freeze=True)
    head = Eagle3Head(config, shared)
    try:
        missing, unexpected = head.load_state_dict(state, strict=False)
    except RuntimeError as error:  # a tensor of another shape
        raise Eagle3Error(f"eagle3 head {name}: {error}") from None
    missing = [m for m in missing if not (shared is not None and m.startswith("embed_tokens."))]
    if missing or unexpected:
        raise Eagle3Error(f"eagle3 head {name}: missing tensors {missing}, unexpected tensors {unexpected}")
    if math.prod(head.d2t.shape) != config.draft_vocab_size:
        raise Eagle3Error(f"eagle3 head {name}: d2t has {head.d2t.numel()} entries, draft_vocab_size is "
                          f"{config.draft_vocab_size}")
    return head.to(dtype).eval().requires_grad_(False)
