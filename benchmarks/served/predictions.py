"""Predicted outputs and prompt lookup against ``ar``: the model-free proposers on the embedded family.

The embedded models do not copy from their context, so the mechanism is measured with
predictions whose quality is known. A first ``ar`` run at temperature 0 gives the target's own
completion of the prompt; then, interleaved round by round on the same model group (Ray actors,
the production path), every case decodes the same request at temperature 0:

* ``ar``: the baseline;
* ``prediction/exact``: the first run's completion as the prediction;
* ``prediction/edited``: that completion with ``--edited-lines`` of its lines changed;
* ``prediction/unrelated``: an unrelated text (``benchmarks/served/prose.txt``);
* ``ngram/<case>``: prompt lookup (``speculation.proposer: "ngram"``) with the case's text
  prepended to the prompt, so the lookup has what the prediction had;
* ``draft``: the deployment's draft model (sd, the same rule).

Reports the median tokens/s (and its ratio to ``ar``'s of the same rounds), block efficiency and
accepted prediction tokens per case, as a Markdown table::

    python -m benchmarks.served.predictions --config deploy/default.yaml --max-tokens 200 --rounds 3
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from actors.request_schema import GenerationRequest, SamplingParams

PROMPT = "import argparse\nimport os\n\n\ndef main(argv=None):\n"
PROSE = pathlib.Path(__file__).with_name("prose.txt")


@dataclass
class Case:
    name: str
    prompt: str
    speculation: dict[str, Any]
    prediction: str | None = None
    tokens_per_s: list[float] = field(default_factory=list)
    block_efficiency: list[float] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    proposed: list[int] = field(default_factory=list)


def edited(text: str, lines: int) -> str:
    """``text`` with ``lines`` of its non-empty lines (spread over it) replaced by another line."""
    rows = text.split("\n")
    candidates = [i for i, row in enumerate(rows) if row.strip()]
    step = max(1, len(candidates) // (lines + 1))
    for index in candidates[step::step][:lines]:
        indent = rows[index][: len(rows[index]) - len(rows[index].lstrip())]
        rows[index] = f"{indent}value = compute(value, {index})  # changed"
    return "\n".join(rows)


def run_case(coordinator: Any, case: Case, max_tokens: int, gamma: int) -> tuple[list[int], Any]:
    import ray

    request = GenerationRequest(
        request_id=f"predictions-{case.name}-{time.monotonic_ns()}", prompt=case.prompt,
        sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        speculation={"gamma": gamma, **case.speculation}, prediction=case.prediction,
    )
    tokens: list[int] = []
    final = None
    for ref in coordinator.generate.options(num_returns="streaming").remote(request):
        chunk = ray.get(ref)
        if chunk.error:
            raise RuntimeError(f"{case.name}: {chunk.error}")
        tokens.extend(chunk.token_ids)
        final = chunk
    return tokens, final.stats


def cases(first_output: str, edited_lines: int) -> list[Case]:
    texts = {"exact": first_output, "edited": edited(first_output, edited_lines),
             "unrelated": PROSE.read_text()[: len(first_output)]}
    built = [Case("ar", PROMPT, {"strategy": "ar"}),
             Case("draft", PROMPT, {"strategy": "sd", "method": "block"})]
    for name, text in texts.items():
        built.append(Case(f"prediction/{name}", PROMPT, {"strategy": "sd", "method": "block"}, prediction=text))
    for name, text in texts.items():
        built.append(Case(f"ngram/{name}", f"{text}\n\n{PROMPT}", {"strategy": "sd", "method": "block",
                                                                   "proposer": "ngram"}))
    built.append(Case("ngram+ar-prompt", f"{texts['exact']}\n\n{PROMPT}", {"strategy": "ar"}))
    return built


def table(built: list[Case]) -> str:
    ar = statistics.median(built[0].tokens_per_s)
    ar_long = statistics.median(built[-1].tokens_per_s)
    lines = ["| case | tokens/s (median) | x ar | block efficiency | accepted / proposed (model-free) |",
             "| --- | --- | --- | --- | --- |"]
    for case in built:
        rate = statistics.median(case.tokens_per_s)
        base = ar_long if case.name.startswith("ngram") else ar
        proposed = statistics.median(case.proposed) if case.proposed else 0
        lines.append(f"| {case.name} | {rate:.1f} | {rate / base:.2f} | {statistics.median(case.block_efficiency):.2f} | "
                     f"{statistics.median(case.accepted) if case.accepted else 0:.0f} / {proposed:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="deploy/default.yaml")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gamma", type=int, default=8)
    parser.add_argument("--edited-lines", type=int, default=3)
    args = parser.parse_args(argv)

    from cluster.serving.bringup import init_ray, start_model_group
    from cluster.config import load_app_args

    init_ray()
    group = start_model_group(load_app_args(args.config))
    try:
        tokenizer_first = Case("first", PROMPT, {"strategy": "ar"})
        tokens, _ = run_case(group.coordinator, tokenizer_first, args.max_tokens, args.gamma)
        from actors.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(load_app_args(args.config).freeze().tokenizer_path)
        first_output = tokenizer.decode(tokens, skip_special_tokens=True)
        built = cases(first_output, args.edited_lines)
        for _ in range(args.rounds):  # interleaved: every case once per round
            for case in built:
                _, stats = run_case(group.coordinator, case, args.max_tokens, args.gamma)
                case.tokens_per_s.append(stats.tokens_per_second)
                case.block_efficiency.append(stats.block_efficiency)
                case.accepted.append(sum(stats.accepted_proposed.values()))
                case.proposed.append(sum(stats.proposed_tokens.values()))
        print(f"{args.max_tokens} tokens, temperature 0, gamma {args.gamma}, {args.rounds} rounds, "
              f"{args.edited_lines} lines edited; ngram cases (and ngram+ar-prompt, their baseline) prepend the "
              "case's text to the prompt")
        print(table(built))
    finally:
        group.shutdown()


if __name__ == "__main__":
    main()
