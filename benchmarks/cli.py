"""The ``bench`` subcommand of the ``specserve`` CLI.

    specserve bench [--config deploy/default.yaml] [--quick] --out DIR
    specserve bench --mode serve-load [--concurrency 1,4,16,32] [--strategies ar,sd,multi_draft,se]
                    [--overlap on,off] [--prefix-caching on|off] [--bare-limit on|off] --out DIR

The default mode (``suite``) runs the benchmark suite (``benchmarks.served.suite``) over the committed
prompt set and writes ``results.json``, ``results.md`` and PNG plots under ``DIR``. The
``serve-load`` mode (``benchmarks.served.serve_load``) starts ``specserve serve`` and measures it under
concurrent streaming HTTP clients. Progress goes to stderr (a tqdm bar and log lines); the paths
of the written files are logged at the end.
"""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import shlex
import sys

logger = logging.getLogger(__name__)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def gamma_list(text: str) -> tuple[int | str, ...]:
    """``2,4,8,auto``: draft lengths, each an integer or ``auto`` (adaptive, chosen per request)."""
    from actors.request_schema import check_gamma

    values: list[int | str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            values.append(check_gamma("auto" if part.lower() == "auto" else int(part)))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated draft lengths (integers or auto), got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one draft length, got {text!r}")
    return tuple(dict.fromkeys(values))


OVERLAP_WORDS = {"on": True, "off": False, "true": True, "false": False}


def overlap_list(text: str) -> tuple[bool, ...]:
    """``on,off`` (or ``off``, ``on``): the overlap settings to run, in run order (off first)."""
    words = [part.strip().lower() for part in text.split(",") if part.strip()]
    unknown = [w for w in words if w not in OVERLAP_WORDS]
    if unknown or not words:
        raise argparse.ArgumentTypeError(f"expected on, off or on,off; got {text!r}")
    return tuple(sorted({OVERLAP_WORDS[w] for w in words}))


def _mode_list(text: str) -> tuple[str, ...]:
    modes = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [m for m in modes if m not in ("ray", "local", "hf")]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(f"modes must be a comma-separated subset of ray,local,hf; got {text!r}")
    return modes


def _strategy_list(text: str) -> tuple[str, ...]:
    from benchmarks.served.suite import STRATEGIES

    names = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"strategies must be a comma-separated subset of {','.join(STRATEGIES)}; got {text!r}")
    return names


DESCRIPTION = ("Run every decoding strategy, on separate Ray actors and in one process, and "
               "transformers assisted generation on the same models and prompts, interleaved by prompt; "
               "write results.json, results.md and plots under --out.")


def build_bench_parser() -> argparse.ArgumentParser:
    """The parser of ``specserve bench`` on its own (what ``main`` parses)."""
    return add_bench_arguments(argparse.ArgumentParser(prog="specserve bench", description=DESCRIPTION))


def add_bench_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the arguments of ``specserve bench`` to ``parser`` and set its handler; returns ``parser``."""
    parser.add_argument("--mode", choices=("suite", "serve-load"), default="suite",
                        help="suite: every strategy side by side (default); serve-load: the HTTP server under "
                        "concurrent streaming clients.")
    parser.add_argument("--config", default="deploy/default.yaml", help="Ray Serve YAML whose application args name the models.")
    parser.add_argument("--app-name", default=None, help="Application of the YAML to use (when it holds several).")
    parser.add_argument("--out", type=pathlib.Path, required=True, help="Output directory.")
    parser.add_argument("--quick", action="store_true", help="Fewer prompts and tokens (same cases): a few minutes.")
    parser.add_argument("--modes", type=_mode_list, default=None, help="Subset of ray,local,hf (default: all).")
    parser.add_argument("--strategies", type=_strategy_list, default=None,
                        help="Subset of ar,sd,multi_draft,ensemble,se,peer (default: all; serve-load: "
                        "ar,sd,multi_draft,se, and no peer).")
    parser.add_argument("--num-prompts", type=int, default=None, help="Use the first N prompts.")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="Tokens generated per prompt (per request in serve-load, default 48).")
    parser.add_argument("--repeats", type=int, default=None, help="Passes over the prompt set.")
    parser.add_argument("--seed", type=int, default=None, help="Base seed.")
    parser.add_argument("--gammas", type=gamma_list, default=None,
                        help="Draft lengths of sd and the peer, e.g. 2,4,8; 'auto' adds sd cases with the adaptive "
                        "draft length (gamma: auto), e.g. 2,4,8,auto (serve-load too: one sd case each).")
    parser.add_argument("--gamma-max", type=int, default=None,
                        help="Largest block of the auto cases (default: the largest fixed gamma of the run, else the "
                        "deployment's default).")
    parser.add_argument("--max-prompt-tokens", type=int, default=None,
                        help="Keep only the last N tokens of each prompt (small-context models).")
    parser.add_argument("--prompts", type=pathlib.Path, default=None,
                        help="Prompt file (JSON lines: id, kind, source, text); default: the committed set.")
    parser.add_argument("--se-gammas", type=_int_list, default=None,
                        help="se variants: proposal length of the non-first members (the first proposes 1), e.g. 1,5.")
    parser.add_argument("--temperature", type=float, default=None, help="Sampling temperature (default 1).")
    parser.add_argument("--plot-prefix", default="", help="Prefix of the plot links in results.md (e.g. img/).")
    parser.add_argument("--record", default=None, metavar="CASE",
                        help="Also write the run into the results store as benchmarks/results/CASE.json and "
                        "regenerate docs/results.md.")
    load = parser.add_argument_group("serve-load mode")
    load.add_argument("--concurrency", type=_int_list, default=None,
                      help="Concurrent clients per level (default 1,4,16,32).")
    load.add_argument("--requests-per-level", type=int, default=None,
                      help="Measured requests per level (default: max(32, 4 x concurrency)).")
    load.add_argument("--request-timeout", type=float, default=None,
                      help="Bound on one request in seconds (default 300).")
    load.add_argument("--worker-class", default=None,
                      help="Ray actor classes of the model workers, comma-separated, for their peak memory "
                           "(default ModelWorker,DeviceWorker).")
    load.add_argument("--overlap", type=overlap_list, default=None,
                      help="on,off: run every level once per setting of the scheduler's overlap (args.engine.overlap; "
                      "a server per setting, overlap off first); on or off: one pass with it forced. Default: the "
                      "YAML as it is.")
    load.add_argument("--prefix-caching", choices=("on", "off"), default=None,
                      help="Force the workers' prefix caching (args.engine.prefix_caching) on or off. Default: the "
                      "YAML as it is (on unless it says otherwise).")
    load.add_argument("--se-proposers", type=lambda text: tuple(p.strip() for p in text.split(",") if p.strip()),
                      default=None, help='se cases, one per proposer: alternate and/or model names (default alternate).')
    load.add_argument("--se-gamma", type=lambda text: text if text == "auto" else int(text), default=None,
                      help="Proposal length of the alternate se's second member (the first proposes 1; default 1), "
                      "or auto (gamma auto).")
    load.add_argument("--se-draft-gamma", type=lambda text: text if text == "auto" else int(text), default=None,
                      help='Block length of se with a model proposer, or auto (default 4).')
    load.add_argument("--direct-http", choices=("on", "off"), default=None,
                      help="on: the clients call the replica's own HTTP server (`specserve serve --direct-http-port`), "
                      "skipping Serve's proxy (default off).")
    load.add_argument("--bare-limit", choices=("on", "off"), default=None,
                      help="Measure each level's bare-model limit (transformers' forward of the models at the level's "
                      "shapes, after the server stops) and report served tokens/s against it (default on).")
    parser.set_defaults(handler=run_bench_command)
    return parser


def settings_from_args(args: argparse.Namespace):
    from benchmarks.served.suite import QUICK_SETTINGS, BenchSettings

    values: dict = dict(QUICK_SETTINGS) if args.quick else {}
    overrides = {
        "modes": args.modes, "strategies": args.strategies, "num_prompts": args.num_prompts, "max_tokens": args.max_tokens,
        "repeats": args.repeats, "seed": args.seed, "gammas": args.gammas, "se_gammas": args.se_gammas, "temperature": args.temperature,
        "max_prompt_tokens": args.max_prompt_tokens, "gamma_max": args.gamma_max,
    }
    values.update({k: v for k, v in overrides.items() if v is not None})
    return BenchSettings(**values)


SUITE_ONLY_FLAGS = {"quick": "--quick", "modes": "--modes", "repeats": "--repeats",
                    "se_gammas": "--se-gammas", "max_prompt_tokens": "--max-prompt-tokens"}
SERVE_LOAD_ONLY_FLAGS = {"concurrency": "--concurrency", "requests_per_level": "--requests-per-level",
                         "request_timeout": "--request-timeout", "worker_class": "--worker-class",
                         "overlap": "--overlap", "prefix_caching": "--prefix-caching",
                         "bare_limit": "--bare-limit", "direct_http": "--direct-http", "se_proposers": "--se-proposers",
                         "se_gamma": "--se-gamma", "se_draft_gamma": "--se-draft-gamma"}


def _given(args: argparse.Namespace, flags: dict[str, str]) -> list[str]:
    return [flag for name, flag in flags.items() if getattr(args, name) not in (None, False)]


def serve_load_settings_from_args(args: argparse.Namespace):
    from benchmarks.served.load_cases import ServeLoadSettings

    overrides = {
        "concurrency": args.concurrency, "strategies": args.strategies, "max_tokens": args.max_tokens,
        "requests_per_level": args.requests_per_level, "seed": args.seed, "temperature": args.temperature,
        "num_prompts": args.num_prompts, "request_timeout_s": args.request_timeout, "worker_class": args.worker_class,
        "overlap": args.overlap,
        "prefix_caching": None if args.prefix_caching is None else args.prefix_caching == "on",
        "bare_limit": None if args.bare_limit is None else args.bare_limit == "on",
        "direct_http": None if args.direct_http is None else args.direct_http == "on",
        "sd_gammas": args.gammas, "gamma_max": args.gamma_max, "se_proposers": args.se_proposers,
        "se_gamma": args.se_gamma, "se_draft_gamma": args.se_draft_gamma,
    }
    return ServeLoadSettings(**{k: v for k, v in overrides.items() if v is not None})


def _command_line(fallback: str = "specserve bench") -> str:
    """The command as typed (when this process is the specserve CLI), else ``fallback``."""
    return "specserve " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if "bench" in sys.argv[1:] else fallback


def run_serve_load_command(args: argparse.Namespace) -> int:
    """``specserve bench --mode serve-load``."""
    from pydantic import ValidationError

    from benchmarks.served.prompts import PROMPTS_PATH
    from benchmarks.served.serve_load import run_serve_load
    from cluster.config import ConfigError

    wrong = _given(args, SUITE_ONLY_FLAGS)
    if wrong:
        logger.error("%s: not used by --mode serve-load", ", ".join(wrong))
        return 2
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    try:
        settings = serve_load_settings_from_args(args)
    except ValidationError as error:
        logger.error("%s", error)
        return 2
    try:
        results = run_serve_load(args.config, settings, args.out, app_name=args.app_name,
                                 command=_command_line("specserve bench --mode serve-load"),
                                 prompts_path=args.prompts or PROMPTS_PATH, plot_prefix=args.plot_prefix)
    except (ConfigError, ValueError) as error:
        logger.error("%s", error)
        return 2
    except RuntimeError as error:  # the server did not start or died
        logger.error("%s", error)
        return 1
    if args.record:
        from benchmarks.reports.tables import update
        from benchmarks.reports.writers import serve_load_record

        logger.info("recorded %s", update(serve_load_record(results, args.record)))
    failed = sum(s.failed for s in results.summaries)
    if failed:
        logger.warning("%d requests failed (see results.md and %s)", failed, args.out / "server.log")
    logger.info("results in %s", args.out)
    return 0 if any(s.completed for s in results.summaries) else 1


def run_bench_command(args: argparse.Namespace) -> int:
    """Handler of ``specserve bench``; returns the process exit code."""
    from benchmarks.served.prompts import PROMPTS_PATH
    from benchmarks.served.run import run_benchmark
    from cluster.config import load_app_args

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the benchmark never downloads anything
    if getattr(args, "mode", "suite") == "serve-load":
        return run_serve_load_command(args)
    wrong = _given(args, SERVE_LOAD_ONLY_FLAGS)
    if wrong:
        logger.error("%s: only used by --mode serve-load", ", ".join(wrong))
        return 2

    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        import transformers

        transformers.logging.set_verbosity_error()
    except ImportError:
        pass
    settings = settings_from_args(args)
    group_args = load_app_args(args.config, args.app_name)
    results = run_benchmark(group_args, settings, args.out, command=_command_line(), plot_prefix=args.plot_prefix,
                            prompts_path=args.prompts or PROMPTS_PATH)
    if args.record:
        from benchmarks.reports.tables import update
        from benchmarks.reports.writers import suite_record

        logger.info("recorded %s", update(suite_record(results.to_json(), args.record)))
    for check in results.checks:
        level = logging.WARNING if check.met is False else logging.INFO
        logger.log(level, "target %s: required %s, measured %s", check.name, check.required, check.measured)
    logger.info("results in %s", args.out)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``specserve bench ARGS`` (and ``python -m benchmarks.cli ARGS``): parse ``argv`` and run; the exit code."""
    args = build_bench_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,  # a no-op under specserve, which set it up
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
