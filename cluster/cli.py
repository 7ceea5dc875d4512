"""The ``specserve`` command line.

Subcommands are registered by functions in :data:`SUBCOMMANDS`; each takes the argparse
subparsers object, adds its parser and sets ``handler`` (a function ``args -> exit code``)
with ``parser.set_defaults(handler=...)``. Add a subcommand by writing such a function and
appending it to :data:`SUBCOMMANDS`.

``specserve generate --config deploy/default.yaml --prompt TEXT --max-tokens N [--strategy S]
[--method M] [--gamma G|auto] [--num-drafts K] [--temperature T] [--seed S] [--json]`` runs one
request on a model group started for it (local Ray unless ``RAY_ADDRESS`` is set). Text streams
to stdout as it is accepted; with ``--json`` stdout gets one JSON object (``text``,
``token_ids``, ``finish_reason``, ``stats``) and progress goes to the log (stderr).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import uuid
from collections.abc import Callable
from typing import Any, get_args

from actors.request_schema import EnsembleKind, Strategy

logger = logging.getLogger("specserve")


def _gamma(text: str) -> int | str:
    """``--gamma``: an integer or ``auto``."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f'expected an integer or "auto", got {text!r}') from None


def _comma_list(kind: Callable[[str], Any]) -> Callable[[str], list]:
    def parse(text: str) -> list:
        try:
            return [kind(part) for part in text.split(",") if part.strip()]
        except ValueError as error:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list: {error}") from None

    return parse


def add_generate_command(subparsers: Any) -> None:
    """``specserve generate``: one request, streamed to stdout."""
    parser = subparsers.add_parser("generate", help="generate text for one prompt with a chosen strategy")
    parser.add_argument("--config", default="deploy/default.yaml", help="Ray Serve YAML with the specserve args")
    parser.add_argument("--app-name", default=None, help="application in the YAML (default: the only one)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-ids", type=_comma_list(int), help="prompt token ids, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=64, help="maximum generated tokens")
    parser.add_argument("--strategy", choices=list(get_args(Strategy)), help="decoding strategy")
    parser.add_argument("--method", help="verification rule (token|block|greedy_block, spectr|sequential_gbv|spectr_gbv)")
    parser.add_argument("--gamma", type=_gamma, help='draft block length, or "auto": each block chosen from the acceptance so far')
    parser.add_argument("--gamma-max", type=int, help='largest block of --gamma auto')
    parser.add_argument("--num-drafts", type=int, help="K drafts (multi_draft)")
    parser.add_argument("--ensemble", choices=list(get_args(EnsembleKind)), help="ensemble function (ensemble, se)")
    parser.add_argument("--members", type=_comma_list(str), help="ensemble members, comma-separated")
    parser.add_argument("--weights", type=_comma_list(float), help="ensemble weights, comma-separated")
    parser.add_argument("--mu", type=float, help="contrastive strength")
    parser.add_argument("--gammas", type=_comma_list(int), help="per-member proposal lengths (se)")
    parser.add_argument("--proposer", help='se: "alternate" or the model that drafts for the ensemble')
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    parser.add_argument("--seed", type=int, help="request seed (default: random)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    parser.add_argument("--all-models", action="store_true", help="start every model of the config, not only those used")
    parser.set_defaults(handler=run_generate)


#: Subcommand registrars, in help order. Each adds one subparser and sets ``handler``.
SUBCOMMANDS: list[Callable[[Any], None]] = [add_generate_command]

from cluster.serving.serve_command import add_serve_subcommand  # noqa: E402 - registered next to its peers

SUBCOMMANDS.append(add_serve_subcommand)


def add_bench_command(subparsers: argparse._SubParsersAction) -> None:
    """Register ``specserve bench``; ``benchmarks.cli`` parses its arguments and is imported only when it runs.

    The product does not import its benchmarks: this parser takes every word after ``bench`` as it is
    (no prefix characters, so ``--help`` is a word too) and hands them to ``benchmarks.cli.main``.
    """
    parser = subparsers.add_parser("bench", help="Benchmark every strategy side by side (specserve bench --help).",
                                   add_help=False, prefix_chars="\0")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER)
    parser.set_defaults(handler=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    from benchmarks.cli import main as bench_main

    return bench_main(args.bench_args)


SUBCOMMANDS.append(add_bench_command)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description="Ray-distributed lossless speculative decoding")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in SUBCOMMANDS:
        register(subparsers)
    return parser


def _build_request(args: argparse.Namespace):
    from actors.request_schema import GenerationRequest

    speculation = {
        key: value
        for key, value in {
            "strategy": args.strategy, "method": args.method, "gamma": args.gamma, "gamma_max": args.gamma_max,
            "num_drafts": args.num_drafts, "ensemble": args.ensemble, "members": args.members, "weights": args.weights,
            "mu": args.mu, "gammas": args.gammas, "proposer": args.proposer,
        }.items()
        if value is not None
    }
    sampling = {
        "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "max_tokens": args.max_tokens,
        "stop": args.stop, "ignore_eos": args.ignore_eos, "seed": args.seed,
    }
    fields = {"request_id": f"cli-{uuid.uuid4().hex[:8]}", "prompt": args.prompt, "prompt_ids": args.prompt_ids,
              "sampling": sampling, "speculation": speculation}
    return GenerationRequest.parse(fields)  # a bad value: InvalidRequestError naming the field


def _only_used_models(config, request):
    """The group restricted to the models this request's plan uses (faster start-up), with the
    request's speculation fully resolved so the smaller group decodes exactly the same plan."""
    from actors.coordination.plan import resolve_plan

    plan = resolve_plan(request.speculation, config.defaults, config.roles)
    models = tuple(model for model in config.models if model.name in plan.models)
    speculation = request.speculation.model_copy(update={
        "strategy": plan.strategy, "method": plan.method, "num_drafts": plan.num_drafts, "ensemble": plan.ensemble,
        # an adaptive plan stays adaptive (its gamma is only the largest block)
        "gamma": "auto" if plan.adaptive is not None else plan.gamma,
        "gamma_max": plan.adaptive.gamma_max if plan.adaptive is not None else request.speculation.gamma_max,
        "members": list(plan.members) or None,
        "weights": list(plan.weights) if plan.weights else None, "mu": plan.mu, "gammas": list(plan.gammas) or None,
        "proposer": plan.proposer,
    })
    defaults = config.defaults.model_copy(update={"strategy": plan.strategy, "method": plan.method, "members": plan.members or None,
                                                  "weights": plan.weights, "gammas": plan.gammas or None})
    return config.model_copy(update={"models": models, "defaults": defaults}), request.model_copy(update={"speculation": speculation})


def run_generate(args: argparse.Namespace) -> int:
    from actors.request_schema import InvalidRequestError
    from cluster.serving.bringup import init_ray, start_model_group
    from cluster.config import ConfigError, load_app_args

    try:
        config = load_app_args(args.config, args.app_name).freeze()
        request = _build_request(args)
        if not args.all_models:
            config, request = _only_used_models(config, request)
    except (ConfigError, InvalidRequestError, ValueError) as error:
        logger.error("%s", error)
        return 2
    init_ray(log_to_driver=not args.json)
    logger.info("starting models %s", [m.name for m in config.models])
    group = start_model_group(config)
    try:
        return _stream(group, request, as_json=args.json)
    finally:
        group.shutdown()


def _stream(group, request, *, as_json: bool) -> int:
    import ray

    from actors.request_schema import InvalidRequestError

    token_ids: list[int] = []
    text: list[str] = []
    final = None
    try:
        for ref in group.coordinator.generate.options(num_returns="streaming").remote(request):
            chunk = ray.get(ref)
            token_ids.extend(chunk.token_ids)
            text.append(chunk.text)
            if not as_json and chunk.text:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
            if chunk.finished:
                final = chunk
    except InvalidRequestError as error:  # Ray re-raises the coordinator's error as this type too
        logger.error("invalid request: %s", error)
        return 2
    if final is None or final.error:
        logger.error("generation failed: %s", None if final is None else final.error)
        return 1
    stats = final.stats.model_dump() if final.stats else {}
    if as_json:
        json.dump({"text": "".join(text), "token_ids": token_ids, "finish_reason": final.finish_reason, "stats": stats},
                  sys.stdout)
        sys.stdout.write("\n")
    else:
        sys.stdout.write("\n")
        logger.info("finish_reason=%s stats=%s", final.finish_reason, json.dumps(stats))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
