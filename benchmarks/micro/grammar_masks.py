"""Structured outputs: what a grammar mask costs, and what speculation still pays under one.

Sections (medians, one torch thread):

1. **Mask time per position** along a JSON document of a small schema, on the embedded
   vocabulary (4,096 tokens) and on a 151,936-token vocabulary (the size of
   ``benchmarks.peers.real_shape``'s Qwen2.5 shape; built here from the embedded tokenizer's tokens and
   the most frequent substrings of the Python standard library's source, nothing downloaded):
   the engines (llguidance's mask of one position; outlines-core's index built for the schema's
   regex, then its mask) and the served path (:func:`verifiers.grammar.mask_logits`: the matcher
   moved to each row's context, its mask, the additive bias on float32 logits; one row, and the
   gamma + 1 = 5 rows of a verified block, the clone of the logits included).
2. **The engine alone** (the production Coordinator and ModelWorkers in this process, the
   embedded family): ar and sd (block, gamma 4) at 1 and 16 concurrent requests, with the JSON
   schema and without a constraint, in interleaved rounds: tokens/s, sd / ar, block efficiency.

    python -m benchmarks.micro.grammar_masks
    python -m benchmarks.micro.grammar_masks --rounds 3 --max-tokens 48 --out /tmp/grammar.md
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import pathlib
import statistics
import sys
import time

import torch

from actors.request_schema import GenerationRequest, SamplingParams, StructuredOutput
from verifiers.grammar import compile_constraint, engine_vocabulary, mask_logits, register_vocabulary

COMMAND = "python -m benchmarks.micro.grammar_masks"
LARGE_VOCAB = 151_936
GAMMA = 4
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "maxLength": 40},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "active"],
    "additionalProperties": False,
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "engines"],
            "active": True}


def large_vocabulary_tokens(base: list[bytes], size: int) -> list[bytes]:
    """``base`` then the most frequent substrings (2..10 bytes) of the standard library's source
    until ``size`` tokens: a byte-level vocabulary of a real tokenizer's size and shape."""
    import sysconfig

    counts: collections.Counter[bytes] = collections.Counter()
    for path in sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:400]:
        data = path.read_bytes()[:60_000]
        for width in range(2, 11):
            counts.update(data[i:i + width] for i in range(0, len(data) - width, width // 2 + 1))
    seen = set(base)
    tokens = list(base)
    for piece, _ in counts.most_common():
        if len(tokens) >= size:
            break
        if piece not in seen:
            seen.add(piece)
            tokens.append(piece)
    for value in range(256):  # every byte spelled (byte fallback), then padding pieces if short
        if len(tokens) < size and bytes([value]) not in seen:
            seen.add(bytes([value]))
            tokens.append(bytes([value]))
    while len(tokens) < size:
        tokens.append(b"\xff<pad%d>" % len(tokens))
    return tokens[:size]


def embedded_tokens() -> tuple[list[bytes], int, str]:
    """(the embedded tokenizer's tokens as bytes, its EOS id, its path)."""
    from actors.tokenizer import load_tokenizer
    from models import embedded_model_path

    path = str(embedded_model_path("target"))
    tokenizer = load_tokenizer(path)
    vocabulary = engine_vocabulary(path)
    tokens = [vocabulary.decode_bytes([i]) if not vocabulary.is_special_token(i) else b"\xff<special%d>" % i
              for i in range(vocabulary.vocab_size)]
    return tokens, int(tokenizer.eos_token_id), path


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def llguidance_positions(vocabulary: str, text: str) -> tuple[list[float], int]:
    """Seconds of each position's mask along ``text``'s tokens (the engine alone), and the count."""
    from llguidance import LLMatcher

    tokenizer = engine_vocabulary(vocabulary)
    grammar = compile_constraint("json_schema", SCHEMA, vocabulary).grammar
    matcher = LLMatcher(tokenizer, grammar, log_level=0)
    ids = tokenizer.tokenize_str(text)
    bitmask = torch.zeros((tokenizer.vocab_size + 31) // 32, dtype=torch.int32)
    samples = []
    for token in ids:
        started = time.perf_counter()
        matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)
        samples.append(time.perf_counter() - started)
        if not matcher.consume_token(token):
            raise RuntimeError(f"the document does not follow the schema: {matcher.get_error()}")
    return samples, len(ids)


def outlines_positions(tokens: list[bytes], eos: int, text_ids: list[int]) -> tuple[float, list[float]]:
    """outlines-core: (seconds to build the schema's index, seconds of each position's mask)."""
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    mapping: dict[bytes, list[int]] = collections.defaultdict(list)
    for index, token in enumerate(tokens):
        if index != eos and not token.startswith(b"\xff"):
            mapping[token].append(index)
    vocabulary = Vocabulary(eos, dict(mapping))
    started = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(SCHEMA)), vocabulary)
    build_s = time.perf_counter() - started
    guide = Guide(index)
    mask = torch.zeros((len(tokens) + 31) // 32, dtype=torch.int32)
    samples = []
    for token in text_ids:
        started = time.perf_counter()
        guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
        samples.append(time.perf_counter() - started)
        guide.advance(token)
    return build_s, samples


def served_positions(vocabulary: str, ids: list[int], vocab: int, rows: int) -> list[float]:
    """Seconds of the served mask (:func:`verifiers.grammar.mask_logits` on float32 logits) per step
    of ``rows`` rows (a verified block's positions), along ``ids``."""
    constraint = compile_constraint("json_schema", SCHEMA, vocabulary, request=f"bench-{vocabulary}-{rows}")
    logits = torch.randn(rows, vocab)  # [rows, V]
    samples = []
    for position in range(len(ids) - rows):
        contexts = [ids[:position + j] for j in range(rows)]
        started = time.perf_counter()
        mask_logits(logits.clone(), constraint, contexts)  # [rows, V]
        samples.append(time.perf_counter() - started)
    return samples


def mask_section(skip_outlines: bool) -> list[str]:
    text = json.dumps(DOCUMENT, separators=(",", ":"))
    base, eos, path = embedded_tokens()
    register_vocabulary("bench-151936", large_vocabulary_tokens(base, LARGE_VOCAB), eos)
    lines = ["| vocabulary | positions | llguidance mask (us) | outlines-core index build (s) | outlines-core mask (us) "
             "| served, 1 row (us) | served, block of 5 rows (us) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, vocabulary, tokens in (("embedded, 4,096", path, base),
                                     ("151,936", "bench-151936", None)):
        tokens = tokens if tokens is not None else large_vocabulary_tokens(base, LARGE_VOCAB)
        engine_samples, count = llguidance_positions(vocabulary, text)
        ids = engine_vocabulary(vocabulary).tokenize_str(text)
        if skip_outlines:
            build, outlines = "-", "-"
        else:
            build_s, outline_samples = outlines_positions(tokens, eos, ids)
            build, outlines = f"{build_s:.2f}", f"{_median_us(outline_samples):.0f}"
        one = served_positions(vocabulary, ids, len(tokens), 1)
        block = served_positions(vocabulary, ids, len(tokens), GAMMA + 1)
        lines.append(f"| {name} | {count} | {_median_us(engine_samples):.0f} | {build} | {outlines} "
                     f"| {_median_us(one):.0f} | {_median_us(block):.0f} |")
    return lines


def _runner():
    from benchmarks.served.runners import LocalRunner
    from cluster.config import parse_app_args

    return LocalRunner(parse_app_args({
        "models": {"target": {"path": "embedded:target", "role": "target", "dtype": "float32"},
                   "draft": {"path": "embedded:draft", "role": "draft", "dtype": "float32"}},
        "defaults": {"strategy": "sd", "method": "block", "gamma": GAMMA},
        "resources": {"torch_threads": 1},
        "limits": {"max_concurrent_requests": 16},
        "engine": {"goodput_gamma": False},
    }), temperature=1.0)


async def _one(runner, strategy: str, constrained: bool, seed: int, max_tokens: int) -> tuple[int, int]:
    """(tokens, target calls) of one request."""
    speculation = {"strategy": strategy} | ({"method": "block", "gamma": GAMMA} if strategy == "sd" else {})
    structured = StructuredOutput(kind="json_schema", spec=SCHEMA, field="bench") if constrained else None
    request = GenerationRequest(
        request_id=f"grammar-{strategy}-{constrained}-{seed}", prompt='person = {"name": ',
        sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed, ignore_eos=not constrained,
                                structured=structured),
        speculation=speculation)
    tokens, calls = 0, 0
    async for chunk in runner.coordinator.generate(request):
        if chunk.error:
            raise RuntimeError(f"{strategy} request failed: {chunk.error}")
        tokens += len(chunk.token_ids)
        if chunk.stats is not None:
            calls = chunk.stats.target_calls
    return tokens, calls


async def _together(requests) -> list[tuple[int, int]]:
    return await asyncio.gather(*requests)


def engine_section(rounds: int, max_tokens: int) -> list[str]:
    runner = _runner()
    results: dict[tuple, list[tuple[float, float]]] = collections.defaultdict(list)
    try:
        for round_index in range(rounds + 1):  # round 0 warms up
            for clients in (1, 16):
                for constrained in (False, True):
                    for strategy in ("ar", "sd"):
                        started = time.perf_counter()
                        outcomes = runner.loop.run_until_complete(_together(
                            _one(runner, strategy, constrained, 1000 * round_index + i, max_tokens)
                            for i in range(clients)))
                        wall = time.perf_counter() - started
                        tokens = sum(t for t, _ in outcomes)
                        calls = sum(c for _, c in outcomes)
                        if round_index:
                            results[(clients, constrained, strategy)].append((tokens / wall, tokens / max(calls, 1)))
    finally:
        runner.close()
    lines = ["| clients | constraint | ar tokens/s | sd tokens/s | sd / ar | sd block efficiency |",
             "|---:|---|---:|---:|---:|---:|"]
    for clients in (1, 16):
        for constrained in (False, True):
            ar = statistics.median(r for r, _ in results[(clients, constrained, "ar")])
            sd = statistics.median(r for r, _ in results[(clients, constrained, "sd")])
            efficiency = statistics.median(e for _, e in results[(clients, constrained, "sd")])
            lines.append(f"| {clients} | {'JSON schema' if constrained else 'none'} | {ar:.1f} | {sd:.1f} "
                         f"| {sd / ar:.2f} | {efficiency:.2f} |")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="Timed rounds of section 2 (after one warm-up).")
    parser.add_argument("--max-tokens", type=int, default=48, help="Section 2's tokens per request (at most).")
    parser.add_argument("--skip-outlines", action="store_true", help="Leave outlines-core out of section 1.")
    parser.add_argument("--skip-engine", action="store_true", help="Section 1 only.")
    parser.add_argument("--out", default=None, help="Also write the report here (markdown).")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    report = [f"Command: `{COMMAND} --rounds {args.rounds} --max-tokens {args.max_tokens}`; one torch thread.", "",
              "**1. Mask time per position (medians along a 45-60 token JSON document)**", ""]
    report += mask_section(args.skip_outlines)
    if not args.skip_engine:
        report += ["", "**2. The engine alone (embedded family), interleaved rounds, medians**", ""]
        report += engine_section(args.rounds, args.max_tokens)
    text = "\n".join(report) + "\n"
    sys.stdout.write(text)
    if args.out:
        pathlib.Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
