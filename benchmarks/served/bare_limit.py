"""The bare-model limit of a serve-load level: what the models alone could give at its shapes.

For each level (a strategy at concurrency c) the limit is the tokens per second the level's
forward passes would allow if nothing but those forwards ran: transformers' own forward of
each model (``model(input_ids, past_key_values=DynamicCache, use_cache=True)``) on batches of
the level's shapes, timed in this one process with the model workers' torch threads
(``resources.torch_threads``, 1 by default), at a representative context of
``L = median prompt tokens + max_tokens // 2`` cached tokens per row (the prompts the level
sends, tokenized by the target's tokenizer; halfway through the completion). A forward
``m: r x n`` is one forward of model ``m`` on ``r`` rows of ``n`` new tokens each after ``L``
cached ones; ``t(m: r x n)`` its median time over ``repeats`` timed calls (logits for every
new token, the cache cropped back to ``L`` after each).

Per strategy, one *iteration* of the level's batch (every one of its c requests advances once):

* ``ar``: one ``target: c x 1``; c tokens. Limit = c / t(target: c x 1).
* ``sd`` (gamma g): g forwards ``draft: c x 1`` and one ``target: c x (g + 1)``; c x E
  tokens, E the level's measured block efficiency (tokens per target call, from the server's
  speculation stats). Limit = c E / (g t(draft: c x 1) + t(target: c x (g + 1))).
* ``multi_draft`` (K drafts, gamma g): g forwards ``draft: cK x 1`` and one
  ``target: cK x (g + 1)`` (every draft a row of its own); c x E tokens.
* ``ensemble`` (target and the first member): one ``target: c x 1`` and one
  ``member: c x 1``; c tokens.
* ``se`` (target and the first member, proposal lengths 1 and g): one forward of each member,
  ``c x (max(1, g) + 1)`` (each member scores the queue and proposes in one forward); c x E tokens.

The limit ignores sampling, verification, scheduling, HTTP and Ray: ``served / limit`` is the
fraction of the models' own speed the server delivers.

The served figure also pays each request's prompt: its forward on every model the strategy
feeds (``prefill_forwards``: ``m: 1 x P`` from an empty cache, P the median prompt tokens), which
is model time too. The *limit with the prompt* adds it: a level of c requests of ``N`` tokens
each takes ``c t_prompt + ((N - 1) c / T) t_iteration`` (the prompt's forward gives the first
token, T tokens per iteration), so it is ``c N`` tokens over that time; ``served / limit with
prompt`` is then the fraction of a token's time the server spends in the models' own work. A level without a measured block
efficiency where its strategy needs one gets no limit. ``benchmarks.micro.forward_micro`` times the
same forward next to the engine's own.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

logger = logging.getLogger(__name__)

NEEDS_BLOCK_EFFICIENCY = ("sd", "multi_draft", "se")


@dataclass(frozen=True)
class Forward:
    """``count`` forwards per iteration of model ``model`` on ``rows`` x ``tokens`` new tokens,
    after ``cached`` tokens per row (None: the level's representative context)."""

    model: str
    rows: int
    tokens: int
    count: int = 1
    cached: int | None = None

    @property
    def shape(self) -> str:
        after = "" if self.cached is None else f" after {self.cached}"
        return f"{self.model}: {self.rows} x {self.tokens}{after}"


@dataclass(frozen=True)
class LevelShape:
    """What a level's bare limit needs besides the forward times."""

    strategy: str
    concurrency: int
    gamma: int = 4  # sd, multi_draft: draft tokens per iteration; se: the non-first member's proposal length
    num_drafts: int = 2  # multi_draft


def level_forwards(shape: LevelShape, roles: dict[str, str]) -> list[Forward]:
    """The forwards of one iteration of the level (see the module docstring)."""
    c, g = shape.concurrency, shape.gamma
    target = _named(roles, "target", shape.strategy)
    if shape.strategy == "ar":
        return [Forward(target, c, 1)]
    if shape.strategy in ("sd", "multi_draft"):
        draft = _named(roles, "draft", shape.strategy)
        rows = c * (shape.num_drafts if shape.strategy == "multi_draft" else 1)
        return [Forward(draft, rows, 1, g), Forward(target, rows, g + 1)]
    if shape.strategy in ("ensemble", "se"):
        member = _named(roles, "member", shape.strategy)
        new = 1 if shape.strategy == "ensemble" else max(1, g) + 1
        return [Forward(target, c, new), Forward(member, c, new)]
    raise ValueError(f"strategy: no bare-model limit is defined for {shape.strategy!r}")


def prefill_forwards(shape: LevelShape, roles: dict[str, str], prompt_tokens: int) -> list[Forward]:
    """One request's prompt forwards: ``m: 1 x prompt_tokens`` from an empty cache on every model
    the level's iterations use (each model holds the request's context)."""
    if prompt_tokens < 1:
        raise ValueError(f"prompt_tokens: at least one, got {prompt_tokens}")
    models = dict.fromkeys(f.model for f in level_forwards(shape, roles))
    return [Forward(model, 1, prompt_tokens, cached=0) for model in models]


def _named(roles: dict[str, str], role: str, strategy: str) -> str:
    names = [name for name, r in roles.items() if r == role]
    if not names:
        raise ValueError(f"{strategy} needs a model with role {role!r}; the config has roles {roles}")
    return names[0]


def tokens_per_iteration(shape: LevelShape, block_efficiency: float | None) -> float | None:
    """c for ar and ensemble; c x E for the strategies that verify blocks (None without E)."""
    if shape.strategy not in NEEDS_BLOCK_EFFICIENCY:
        return float(shape.concurrency)
    if block_efficiency is None or block_efficiency <= 0:
        return None
    return shape.concurrency * block_efficiency


def limit_record(shape: LevelShape, forwards: list[Forward], forward_ms: dict[str, float],
                 block_efficiency: float | None, context: int, *, prompt: list[Forward] | None = None,
                 max_tokens: int | None = None) -> dict[str, Any]:
    """The level's bare limit and how it was computed (stored with the level in results.json);
    with the ``prompt`` forwards of one request and the completion length ``max_tokens``, also
    the limit with the prompt (module docstring)."""
    iteration_ms = sum(f.count * forward_ms[f.shape] for f in forwards)
    tokens = tokens_per_iteration(shape, block_efficiency)
    limit = None if tokens is None or iteration_ms <= 0 else tokens / (iteration_ms / 1000.0)
    record = {
        "limit_tokens_per_second": limit,
        "tokens_per_iteration": tokens,
        "iteration_ms": iteration_ms,
        "block_efficiency": block_efficiency if shape.strategy in NEEDS_BLOCK_EFFICIENCY else None,
        "context": context,
        "forwards": [asdict(f) | {"ms": forward_ms[f.shape]} for f in forwards],
    }
    if prompt and max_tokens:
        prompt_ms = sum(forward_ms[f.shape] for f in prompt)
        c = shape.concurrency
        level_ms = None if tokens is None else c * prompt_ms + (max_tokens - 1) * c / tokens * iteration_ms
        record |= {
            "prompt_ms": prompt_ms,
            "prompt_forwards": [asdict(f) | {"ms": forward_ms[f.shape]} for f in prompt],
            "max_tokens": max_tokens,
            "limit_with_prompt_tokens_per_second": (None if not level_ms else c * max_tokens / (level_ms / 1000.0)),
        }
    return record


class ForwardTimer:
    """Times ``model: rows x tokens`` forwards of the named models over a DynamicCache."""

    def __init__(self, model_paths: dict[str, str], *, context: int, repeats: int = 7, threads: int = 1):
        if context < 1:
            raise ValueError(f"context: at least one cached token, got {context}")
        if repeats < 1:
            raise ValueError(f"repeats: at least one timed forward, got {repeats}")
        self.model_paths = model_paths
        self.context = context
        self.repeats = repeats
        self.threads = threads
        self._models: dict[str, Any] = {}
        self._ms: dict[str, float] = {}

    def _model(self, name: str):
        if name not in self._models:
            import torch
            from transformers import AutoModelForCausalLM

            if name not in self.model_paths:
                raise ValueError(f"model: {name!r} is not in the config's models {sorted(self.model_paths)}")
            self._models[name] = AutoModelForCausalLM.from_pretrained(
                self.model_paths[name], dtype=torch.float32).eval()
        return self._models[name]

    def time_all(self, forwards: list[Forward]) -> dict[str, float]:
        """Median ms of every distinct shape (each timed once per process), by ``Forward.shape``."""
        import torch

        previous = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            for forward in forwards:
                if forward.shape not in self._ms:
                    cached = self.context if forward.cached is None else forward.cached
                    run = dynamic_cache_forward(self._model(forward.model), forward.rows, cached, forward.tokens,
                                                logits_to_keep=0)
                    run()  # warm-up
                    self._ms[forward.shape] = statistics.median(_elapsed_ms(run) for _ in range(self.repeats))
                    logger.info("bare forward %s at context %d: %.1f ms", forward.shape, cached,
                                self._ms[forward.shape])
        finally:
            torch.set_num_threads(previous)
        return {f.shape: self._ms[f.shape] for f in forwards}


def dynamic_cache_forward(model, rows: int, context: int, new: int, *, logits_to_keep: int = 1):
    """A callable running transformers' own forward of ``rows x new`` tokens after ``context``
    cached ones per row (equal lengths, no masks), cropping the cache back each time (context 0:
    a prompt's forward, on a fresh cache each time). ``logits_to_keep`` 0 keeps the logits of
    every new token (a verification needs them all)."""
    import torch
    from transformers import DynamicCache

    generator = torch.Generator().manual_seed(rows * 100 + new)
    vocab = int(model.config.vocab_size)
    cache = DynamicCache(config=model.config)
    if context > 0:
        with torch.inference_mode():
            model(input_ids=torch.randint(1, vocab, (rows, context), generator=generator),  # [rows, context]
                  past_key_values=cache, use_cache=True, logits_to_keep=1)
    new_ids = torch.randint(1, vocab, (rows, new), generator=generator)  # [rows, new]

    @torch.inference_mode()
    def run() -> object:
        if context == 0:
            return model(input_ids=new_ids, past_key_values=DynamicCache(config=model.config), use_cache=True,
                         logits_to_keep=logits_to_keep)
        out = model(input_ids=new_ids, past_key_values=cache, use_cache=True, logits_to_keep=logits_to_keep)
        cache.crop(-new)  # back to the context (a positive argument is refused)
        return out

    return run


def _elapsed_ms(run) -> float:
    started = time.perf_counter()
    run()
    return 1e3 * (time.perf_counter() - started)


def median_prompt_tokens(tokenizer_path: str, prompt_texts: list[str]) -> int:
    """Median prompt length in tokens (the target's tokenizer)."""
    from transformers import AutoTokenizer

    if not prompt_texts:
        raise ValueError("prompts: the bare-model limit needs at least one prompt")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    return int(statistics.median(len(tokenizer(text)["input_ids"]) for text in prompt_texts))


def context_midway(prompt_tokens: int, max_tokens: int) -> int:
    """The cached context halfway through a completion: ``prompt_tokens + max_tokens // 2``."""
    return prompt_tokens + max_tokens // 2


def representative_context(tokenizer_path: str, prompt_texts: list[str], max_tokens: int) -> int:
    """Median prompt length in tokens (the target's tokenizer) + ``max_tokens // 2``."""
    return context_midway(median_prompt_tokens(tokenizer_path, prompt_texts), max_tokens)


def bare_limits(shapes: list[LevelShape], block_efficiencies: list[float | None], roles: dict[str, str],
                model_paths: dict[str, str], *, context: int, repeats: int = 7,
                threads: int = 1, prompt_tokens: int | None = None,
                max_tokens: int | None = None) -> list[dict[str, Any]]:
    """One :func:`limit_record` per level (``shapes[i]`` with ``block_efficiencies[i]``); with
    ``prompt_tokens`` and ``max_tokens``, each with its limit with the prompt."""
    if len(shapes) != len(block_efficiencies):
        raise ValueError("block_efficiencies: one per level")
    timer = ForwardTimer(model_paths, context=context, repeats=repeats, threads=threads)
    plans = [level_forwards(shape, roles) for shape in shapes]
    prompts = [prefill_forwards(shape, roles, prompt_tokens) if prompt_tokens else [] for shape in shapes]
    forward_ms = timer.time_all([f for plan in plans + prompts for f in plan])
    return [limit_record(shape, plan, forward_ms, efficiency, context, prompt=prompt, max_tokens=max_tokens)
            for shape, plan, prompt, efficiency in zip(shapes, plans, prompts, block_efficiencies)]
