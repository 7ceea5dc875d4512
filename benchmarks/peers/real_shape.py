"""A model shaped like Qwen2.5 on this CPU (not a test): KV memory against its budget, grouped
attention, verification at V = 151,936, the served step's time split and long-prompt latency.

Random weights, nothing downloaded: a target and a draft of the Qwen2 family with Qwen2.5's
vocabulary (151,936 embedding rows: the small tokenizer's ids plus padding, as Qwen2.5 pads past
its tokenizer), 7:1 grouped-query attention, a 32,768-token context and hidden sizes small
enough for this CPU (:data:`TARGET_SHAPE`, :data:`DRAFT_SHAPE`). Random weights make the
acceptance rate meaningless (both models are nearly uniform over the vocabulary); the costs are
what this measures. Sections (medians of ``--repeats``, one torch thread, cases interleaved):

1. **KV memory:** bytes per token and per slot, the blocks ``--kv-cache-memory`` holds at
   ``max_model_len`` = the model's 32,768, and the worker's resident memory after loading.
2. **Grouped attention:** the target's forward with the grouped keys/values read in place
   (``actors.model.grouped_attention``) against transformers' sdpa, which repeats them per layer.
3. **Verification at V = 151,936:** one block-verification call (gamma 4, float64 rows) next to
   the target forward that scored the block.
4. **The engine alone** (no Ray, no HTTP; the production Coordinator and ModelWorkers in this
   process): ar and sd (block, gamma 4) tokens/s for one client, block efficiency, and where
   the wall time went (target forwards, draft forwards, the rest).
5. **Long prompts:** time to the first token of one request alone for prompts of
   ``--prompt-lengths`` tokens (ar).

Section 4's time split is the responses' own (``RequestStats``).

    python -m benchmarks.peers.real_shape
    python -m benchmarks.peers.real_shape --repeats 3 --prompt-lengths 1024,4096 --out /tmp/real-shape.md
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from actors.request_schema import GenerationRequest, RequestStats, SamplingParams
from actors.model.backends import SlotBackend
from actors.model.batch import linear_row
from actors.model.grouped_attention import GROUPED_SDPA
from benchmarks.served.runners import LocalRunner
from benchmarks.micro.verify_micro import make_inputs
from cluster.config import parse_app_args
from models import embedded_model_path
from verifiers.registry import get_verifier

logger = logging.getLogger("benchmarks.peers.real_shape")

COMMAND = "python -m benchmarks.peers.real_shape"
VOCAB = 151_936  # Qwen2.5's embedding rows
CONTEXT = 32_768
COMMON_SHAPE = dict(vocab_size=VOCAB, max_position_embeddings=CONTEXT, tie_word_embeddings=True, rope_theta=1e6)
#: 14 query heads over 2 key/value heads (7:1, as Qwen2.5-0.5B), head size 32.
TARGET_SHAPE = dict(hidden_size=448, intermediate_size=1216, num_hidden_layers=6, num_attention_heads=14,
                    num_key_value_heads=2)
#: 7 query heads over 1 key/value head (7:1), head size 32.
DRAFT_SHAPE = dict(hidden_size=224, intermediate_size=608, num_hidden_layers=2, num_attention_heads=7,
                   num_key_value_heads=1)
GAMMA = 4


def build_checkpoints(root: pathlib.Path, every_id: bool = False) -> dict[str, pathlib.Path]:
    """Save the random target and draft with the embedded tokenizer (or, with ``every_id``, a
    word-level one naming all 151,936 ids, so that rows span the whole vocabulary) under ``root``."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = every_id_tokenizer() if every_id else AutoTokenizer.from_pretrained(embedded_model_path("target"))
    paths = {}
    for name, shape, seed in (("target", TARGET_SHAPE, 0), ("draft", DRAFT_SHAPE, 1)):
        config = Qwen2Config(**COMMON_SHAPE, **shape, bos_token_id=tokenizer.bos_token_id,
                             eos_token_id=tokenizer.eos_token_id)
        torch.manual_seed(seed)
        paths[name] = root / f"qwen2.5-shaped-{name}"
        Qwen2ForCausalLM(config).save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
    return paths


def every_id_tokenizer() -> Any:
    """A word-level tokenizer whose 151,936 tokens are ``t0`` ... (``t0`` also the end of sequence)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    model = Tokenizer(WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    model.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=model, unk_token="t0", eos_token="t0", bos_token="t0",
                                   pad_token="t0")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def _median_ms(samples: list[float]) -> float:
    return 1e3 * statistics.median(samples)


def memory_section(path: pathlib.Path, kv_cache_memory: int) -> tuple[list[str], SlotBackend]:
    """Section 1; returns its lines and the loaded target (slots of the whole context)."""
    before = _rss_bytes()
    backend = SlotBackend.load(str(path), dtype="float32", max_slots=8, kv_cache_memory=kv_cache_memory)
    after = _rss_bytes()
    config = backend.model.config
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads) * 4
    lines = [
        "| KV bytes per token | slot (32,768 + scratch columns) | budget | blocks x tokens | resident after load |",
        "|---:|---:|---:|---:|---:|",
        f"| {per_token:,} | {backend.slot_bytes / 2**20:,.1f} MiB | {kv_cache_memory / 2**30:.2f} GiB | "
        f"{backend.cache.num_blocks:,} x {backend.cache.block_size} | {(after - before) / 2**20:,.0f} MiB |",
    ]
    return lines, backend


def _forward_case(backend: SlotBackend, rows: int, context: int, new: int) -> Callable[[], object]:
    """A forward of ``new`` tokens on each of ``rows`` slots after ``context`` cached tokens."""
    generator = torch.Generator().manual_seed(rows * 1000 + new)
    slots = [backend.allocate() for _ in range(rows)]
    for slot in slots:
        tokens = torch.randint(1, 4000, (context,), generator=generator).tolist()
        backend.forward([linear_row(slot, 0, tokens, 0, [context - 1])])
    work = [linear_row(slot, context, torch.randint(1, 4000, (new,), generator=generator).tolist(), context,
                       list(range(new))) for slot in slots]

    def run() -> object:
        return backend.forward(work)

    run.slots = slots  # type: ignore[attr-defined]
    return run


def attention_section(backend: SlotBackend, shapes: list[tuple[int, int, int]], repeats: int
                      ) -> tuple[list[str], float]:
    """Section 2; returns its lines and the grouped 1 x (gamma + 1) forward's ms at the first
    shape's context (for section 3)."""
    lines = ["| rows x new tokens | context | grouped, in place (ms) | sdpa repeating K/V (ms) | ratio |",
             "|---|---:|---:|---:|---:|"]
    verify_ms = float("nan")
    for rows, context, new in shapes:
        run = _forward_case(backend, rows, context, new)
        timings: dict[str, list[float]] = {GROUPED_SDPA: [], "sdpa": []}
        for _ in range(repeats + 1):
            for implementation in timings:
                backend.model.set_attn_implementation(implementation)
                started = time.perf_counter()
                run()
                timings[implementation].append(time.perf_counter() - started)
        backend.model.set_attn_implementation(GROUPED_SDPA)
        grouped, repeated = (_median_ms(timings[name][1:]) for name in (GROUPED_SDPA, "sdpa"))
        if (rows, new) == (1, GAMMA + 1) and verify_ms != verify_ms:
            verify_ms = grouped
        lines.append(f"| {rows} x {new} | {context:,} | {grouped:.1f} | {repeated:.1f} | {repeated / grouped:.2f}x |")
        for slot in run.slots:  # type: ignore[attr-defined]
            backend.free(slot)
    return lines, verify_ms


def verification_section(forward_ms: float, repeats: int) -> list[str]:
    """Section 3: one block verification call at V = 151,936 (batch 1, gamma 4)."""
    spec = get_verifier("block")
    inputs = make_inputs(1, 1, GAMMA, VOCAB, False, seed=0)
    generator = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        spec.verify(*inputs, generator=generator)
        samples.append(time.perf_counter() - started)
    verify = _median_ms(samples[1:])
    return ["| block verification, 1 x gamma 4, V = 151,936 (ms) | target forward 1 x 5 (ms) | verification / forward |",
            "|---:|---:|---:|",
            f"| {verify:.2f} | {forward_ms:.1f} | {verify / forward_ms:.2f} |"]


def _group_args(paths: dict[str, pathlib.Path], kv_cache_memory: int) -> Any:
    return parse_app_args({
        "models": {"target": {"path": str(paths["target"]), "role": "target", "dtype": "float32"},
                   "draft": {"path": str(paths["draft"]), "role": "draft", "dtype": "float32"}},
        "defaults": {"strategy": "sd", "method": "block", "gamma": GAMMA},
        "resources": {"torch_threads": 1},
        "limits": {"max_concurrent_requests": 4},
        "engine": {"kv_cache_memory": kv_cache_memory, "max_model_len": CONTEXT, "goodput_gamma": False},
    })


async def _generate(runner: LocalRunner, prompt_ids: list[int], strategy: str, max_tokens: int,
                    seed: int) -> tuple[int, float, RequestStats]:
    """(tokens, seconds to the first token, the response's own stats) of one request."""
    speculation = {"strategy": strategy} | ({"method": "block", "gamma": GAMMA} if strategy == "sd" else {})
    request = GenerationRequest(request_id=f"real-shape-{strategy}-{seed}-{len(prompt_ids)}", prompt_ids=prompt_ids,
                                sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed,
                                                        ignore_eos=True),
                                speculation=speculation)
    started, first, tokens, stats = time.perf_counter(), None, 0, None
    async for chunk in runner.coordinator.generate(request):
        if chunk.error:
            raise RuntimeError(f"{strategy} request failed: {chunk.error}")
        if first is None and chunk.token_ids:
            first = time.perf_counter() - started
        tokens += len(chunk.token_ids)
        stats = chunk.stats or stats
    return tokens, first or 0.0, stats


def engine_section(runner: LocalRunner, requests: int, max_tokens: int, prompt_tokens: int) -> list[str]:
    """Section 4: one client, ar then sd, on prompts of ``prompt_tokens`` random ids; the time split is the responses'
    own (``RequestStats``), summed over the requests, as shares of the wall time."""
    generator = torch.Generator().manual_seed(7)
    lines = ["| one client | tok/s | tokens per target call | draft | target | verification | coordination |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for strategy in ("ar", "sd"):
        tokens, wall, calls = 0, 0.0, 0
        split = dict.fromkeys(("time_draft_s", "time_target_s", "time_verify_s", "time_coordination_s"), 0.0)
        for seed in range(requests):
            prompt = torch.randint(1, 4000, (prompt_tokens,), generator=generator).tolist()
            started = time.perf_counter()
            count, _, stats = runner.loop.run_until_complete(_generate(runner, prompt, strategy, max_tokens, seed))
            wall += time.perf_counter() - started
            tokens, calls = tokens + count, calls + stats.target_calls
            for name in split:
                split[name] += getattr(stats, name)
        shares = " | ".join(f"{100 * value / wall:.0f}%" for value in split.values())
        lines.append(f"| {strategy} | {tokens / wall:.1f} | {tokens / max(1, calls):.2f} | {shares} |")
    return lines


def long_prompt_section(runner: LocalRunner, lengths: list[int]) -> list[str]:
    """Section 5: time to the first token of one ar request alone, per prompt length."""
    generator = torch.Generator().manual_seed(11)
    lines = ["| prompt tokens | time to first token (s) |", "|---:|---:|"]
    for length in lengths:
        prompt = torch.randint(1, 4000, (length,), generator=generator).tolist()
        _, first, _ = runner.loop.run_until_complete(_generate(runner, prompt, "ar", 1, length))
        lines.append(f"| {length:,} | {first:.2f} |")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="Timed repeats per case (median).")
    parser.add_argument("--kv-cache-memory", type=int, default=2 * 2**30,
                        help="Bytes of KV cache per worker (engine.kv_cache_memory).")
    parser.add_argument("--contexts", default="2048,4096", help="Cached tokens per row for the attention cases.")
    parser.add_argument("--prompt-lengths", default="1024,2048,4096,8192", help="Section 5's prompt lengths.")
    parser.add_argument("--requests", type=int, default=3, help="Section 4's requests per strategy.")
    parser.add_argument("--max-tokens", type=int, default=32, help="Section 4's tokens per request.")
    parser.add_argument("--engine-prompt", type=int, default=512, help="Section 4's prompt tokens.")
    parser.add_argument("--out", default=None, help="Also write the report here (markdown).")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    contexts = [int(value) for value in args.contexts.split(",")]
    shapes = [(rows, context, new) for context in contexts for rows, new in ((1, GAMMA + 1), (8, 1), (8, GAMMA + 1))]
    with tempfile.TemporaryDirectory(prefix="real-shape-") as root:
        paths = build_checkpoints(pathlib.Path(root))
        report = [f"Command: `{COMMAND} --repeats {args.repeats}`; one torch thread.", "",
                  "**1. KV memory (target)**", ""]
        lines, backend = memory_section(paths["target"], args.kv_cache_memory)
        report += lines + ["", "**2. Grouped attention (target forward)**", ""]
        lines, forward_ms = attention_section(backend, shapes, args.repeats)
        del backend
        report += lines + ["", "**3. Verification at V = 151,936**", ""]
        report += verification_section(forward_ms, args.repeats)
        runner = LocalRunner(_group_args(paths, args.kv_cache_memory), temperature=1.0)
        try:
            report += ["", f"**4. The engine alone, one client, {args.engine_prompt}-token prompts**", ""]
            report += engine_section(runner, args.requests, args.max_tokens, args.engine_prompt)
            report += ["", "**5. Long prompts alone (ar)**", ""]
            report += long_prompt_section(runner, [int(value) for value in args.prompt_lengths.split(",")])
        finally:
            runner.close()
    text = "\n".join(report) + "\n"
    print(text)
    if args.out:
        pathlib.Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
