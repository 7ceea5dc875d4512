"""``specserve bench --mode serve-load``: the real HTTP server under concurrent streaming clients.

The server is started the way users start it, ``specserve serve --config YAML`` in a
subprocess with its own local Ray (``RAY_ADDRESS`` makes it join a cluster instead; then the
worker memory is not measured), HTTP and gRPC on free ports of 127.0.0.1. Once ``GET /health``
answers 200, every *level* (one strategy at one concurrency c) runs: one warm-up request, then
c closed-loop clients (asyncio tasks over one httpx client) that each send a streaming
``POST /v1/completions`` request, wait for its ``[DONE]`` and send the next, until the level's
requests are used up. Request i of every level uses prompt ``i mod P`` of the committed prompt
set (text, tokenized by the server), seed ``seed + i``, ``max_tokens`` with ``ignore_eos``,
the given temperature with no top-k / top-p, ``return_token_ids`` (to count the tokens of
each chunk) and the ``speculation`` object of the strategy (plus ``Authorization: Bearer`` when
the application has an API key). Everything is timed on the client
side (see :mod:`benchmarks.serve_load_report` for the definitions). Before each level the
peak-RSS counters of the server's model-worker processes (the Ray actors whose process title
is ``ray::<worker_class>``, found among the server subprocess's descendants in ``/proc``) are
reset; after it their ``VmHWM`` is read. Right before and right after each level's timed part
the server's ``GET /metrics`` is scraped; the growth of each worker's cumulative
``specserve_worker_forward_seconds_total`` and ``specserve_worker_step_seconds_total`` over
the level's wall time is the worker's *busy fraction* in forward passes and in step calls. Then
the server is stopped (SIGINT, as Ctrl-C).

With ``overlap`` set (``--overlap on,off``), the whole set of levels runs once per setting of
the scheduler's two-cohort overlap, overlap off first: for each, a copy of the YAML with the
application's ``args.engine.overlap`` set is written into the output directory and a server is
started on it (and stopped after its levels). Every level records the setting it ran with.

With ``bare_limit`` on (``--bare-limit on``, the default), once every server has stopped, the
bare-model limit of every level is measured in the benchmark process (transformers' own forward
of the models at the level's shapes; defined in :mod:`benchmarks.bare_limit`) and reported next
to the served tokens/s as ``bare limit tok/s`` and ``served / limit``.

Strategies: ``ar``; ``sd`` (block verification, gamma 4); ``multi_draft`` (SpecTr, K = 2,
gamma 4); ``ensemble`` (the standard weighted ensemble of the target and the first member
model) and ``se`` (the speculative ensemble of the same, token verification, every member
proposing 1 token).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import itertools
import json
import logging
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from benchmarks.bare_limit import LevelShape, bare_limits, context_midway, median_prompt_tokens
from benchmarks.prompts import PROMPTS_PATH, Prompt, load_prompts
from benchmarks.serve_load_report import (
    LevelRun,
    RequestRecord,
    ServeLoadResults,
    busy_text,
    write_json,
    write_results,
)
from cluster.serving.local_ports import free_local_ports

logger = logging.getLogger(__name__)

REPO = pathlib.Path(__file__).resolve().parent.parent
SERVE_LOAD_STRATEGIES = ("ar", "sd", "multi_draft", "ensemble", "se")
HEALTH_POLL_S = 1.0
STOP_TIMEOUT_S = 120.0
MAX_ERROR_CHARS = 300


class ServeLoadSettings(BaseModel):
    """Everything that defines a serving-load run (recorded in results.json)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    concurrency: tuple[int, ...] = Field((1, 4, 16, 32), min_length=1, description="Concurrent clients per level.")
    strategies: tuple[str, ...] = Field(("ar", "sd", "multi_draft", "se"), min_length=1,
                                        description=f"Subset of {SERVE_LOAD_STRATEGIES}.")
    max_tokens: int = Field(48, ge=1, description="Tokens per request (EOS ignored).")
    requests_per_level: int | None = Field(
        None, ge=1, description="Measured requests per level; None: max(32, 4 x concurrency).")
    warmup_tokens: int = Field(16, ge=1, description="Tokens of the untimed warm-up request of each level.")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature (no top-k / top-p).")
    seed: int = Field(0, ge=0, description="Request i of a level uses seed + i.")
    num_prompts: int | None = Field(None, ge=1, description="Use the first N prompts of the set; None: all.")
    sd_method: str = "block"
    sd_gamma: int = Field(4, ge=1)
    sd_gammas: tuple[int | Literal["auto"], ...] = Field(
        (), description="sd cases, one per block length (an int, or auto: gamma \"auto\" up to gamma_max); "
        "empty: one case of sd_gamma.")
    gamma_max: int = Field(8, ge=1, description="Largest block of the sd auto case.")
    multi_draft_method: str = "spectr"
    num_drafts: int = Field(2, ge=1)
    multi_draft_gamma: int = Field(4, ge=1)
    se_method: str = "token"
    se_gamma: int | Literal["auto"] = Field(
        1, description='Proposal length of the alternate se\'s non-first member (the first proposes 1), or "auto": '
        "gamma auto (gammas 1 each, plain ensemble steps where the measured goodput says proposals do not pay).")
    se_proposers: tuple[str, ...] = Field(
        ("alternate",), min_length=1,
        description='se cases, one per proposer: "alternate" (the members in turn, gammas [1, se_gamma]) or a model '
        "of the config (a draft or a member: blocks of se_draft_gamma verified against the ensemble law).")
    se_draft_method: str = Field("block", description="Verification rule of se with a model proposer.")
    se_draft_gamma: int | Literal["auto"] = Field(
        4, description='Block length of se with a model proposer, or "auto" (up to gamma_max).')
    request_timeout_s: float = Field(300.0, gt=0, description="Bound on one request, end to end.")
    level_timeout_s: float = Field(1200.0, gt=0, description="No request of a level starts after this long.")
    start_timeout_s: float = Field(600.0, gt=0, description="Bound on the server's start-up (until /health is 200).")
    worker_class: str = Field(
        "ModelWorker,DeviceWorker",
        description="Ray actor classes of the model workers (process titles), comma-separated: a model's own "
        "worker, and the worker that hosts the models placed on one device.")
    overlap: tuple[bool, ...] | None = Field(
        None, description="Run every level once per setting of args.engine.overlap (a server per setting, off "
        "first); None: one pass with the YAML as it is.")
    prefix_caching: bool | None = Field(
        None, description="Force args.engine.prefix_caching on or off (a copy of the YAML in the output directory); "
        "None: the YAML as it is.")
    direct_http: bool = Field(False, description="Send the requests to the replica's own HTTP server (`specserve serve "
                              "--direct-http-port`, Serve's proxy skipped) instead of the proxy.")
    bare_limit: bool = Field(True, description="Measure each level's bare-model limit (benchmarks.bare_limit) after "
                             "the servers stop and report served tokens/s against it.")
    bare_repeats: int = Field(7, ge=1, description="Timed forwards per shape of the bare-model limit (median).")

    @model_validator(mode="after")
    def _known(self) -> ServeLoadSettings:
        unknown = [s for s in self.strategies if s not in SERVE_LOAD_STRATEGIES]
        if unknown:
            raise ValueError(f"strategies: {unknown} cannot run in serve-load mode; expected a subset of "
                             f"{SERVE_LOAD_STRATEGIES}")
        if any(c < 1 for c in self.concurrency):
            raise ValueError(f"concurrency: every level needs at least one client, got {self.concurrency}")
        if self.overlap is not None and (not self.overlap or len(set(self.overlap)) != len(self.overlap)):
            raise ValueError(f"overlap: one or two distinct settings, got {self.overlap}")
        return self

    def overlap_passes(self) -> list[bool | None]:
        """The server passes: None (the YAML as it is) or each overlap setting, off first."""
        return [None] if self.overlap is None else sorted(self.overlap)

    def requests_for(self, concurrency: int) -> int:
        return self.requests_per_level or max(32, 4 * concurrency)


@dataclass(frozen=True)
class LoadCase:
    strategy: str
    label: str
    speculation: dict[str, Any]


def serve_load_cases(settings: ServeLoadSettings, roles: dict[str, str]) -> list[LoadCase]:
    """The speculation object of each strategy, in the order of ``settings.strategies``."""
    target = [name for name, role in roles.items() if role == "target"]
    members = [name for name, role in roles.items() if role == "member"]
    has_draft = "draft" in roles.values()
    cases = []
    for strategy in settings.strategies:
        if strategy in ("sd", "multi_draft") and not has_draft:
            raise ValueError(f"{strategy} needs a draft model; the config has roles {roles}")
        if strategy in ("ensemble", "se") and not (target and members):
            raise ValueError(f"{strategy} needs the target and a member model; the config has roles {roles}")
        if strategy == "ar":
            cases.append(LoadCase("ar", "ar", {"strategy": "ar"}))
        elif strategy == "sd":
            for gamma in settings.sd_gammas or (settings.sd_gamma,):
                speculation = {"strategy": "sd", "method": settings.sd_method, "gamma": gamma}
                if gamma == "auto":
                    speculation["gamma_max"] = settings.gamma_max
                cases.append(LoadCase("sd", f"sd/{settings.sd_method}/g{gamma}", speculation))
        elif strategy == "multi_draft":
            cases.append(LoadCase(
                "multi_draft", f"multi_draft/{settings.multi_draft_method}/k{settings.num_drafts}/g{settings.multi_draft_gamma}",
                {"strategy": "multi_draft", "method": settings.multi_draft_method, "num_drafts": settings.num_drafts,
                 "gamma": settings.multi_draft_gamma},
            ))
        else:
            pair = [target[0], members[0]]
            ensemble = {"ensemble": "weighted", "members": pair, "weights": [0.5, 0.5]}
            if strategy == "ensemble":
                cases.append(LoadCase("ensemble", "ensemble/weighted/n2", {"strategy": "ensemble", **ensemble}))
            else:
                cases.extend(_se_case(settings, proposer, ensemble) for proposer in settings.se_proposers)
    return cases


def _se_case(settings: ServeLoadSettings, proposer: str, ensemble: dict[str, Any]) -> LoadCase:
    """se with ``proposer``: the alternate proposer (gammas [1, se_gamma]) or a model drafting
    blocks of ``se_draft_gamma`` for the ensemble law."""
    if proposer == "alternate":
        lengths = {"gamma": "auto"} if settings.se_gamma == "auto" else {"gammas": [1, settings.se_gamma]}
        return LoadCase("se", f"se/weighted/n2/g{settings.se_gamma}",
                        {"strategy": "se", "method": settings.se_method, "proposer": "alternate", **lengths, **ensemble})
    speculation = {"strategy": "se", "method": settings.se_draft_method, "proposer": proposer,
                   "gamma": settings.se_draft_gamma, **ensemble}
    if settings.se_draft_gamma == "auto":
        speculation["gamma_max"] = settings.gamma_max
    return LoadCase("se", f"se/{proposer}/weighted/n2/g{settings.se_draft_gamma}", speculation)


# ----------------------------------------------------------------------------- processes and memory

def _parent_pids() -> dict[int, int]:
    """pid -> parent pid of every process visible in /proc."""
    parents = {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # the command name (field 2) is in parentheses and may hold spaces; ppid is the 2nd field after it
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return parents


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, parent in _parent_pids().items():
        children.setdefault(parent, []).append(pid)
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _process_title(pid: int) -> str:
    try:
        raw = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def ray_actor_processes(root: int) -> dict[int, str]:
    """pid -> Ray actor class (``ray::Class`` or ``ray::Class.method`` titles) under ``root``."""
    actors = {}
    for pid in descendants(root):
        match = re.match(r"ray::([A-Za-z_][\w:]*)", _process_title(pid))
        if match and match.group(1) != "IDLE":
            actors[pid] = match.group(1)
    return actors


def _status_kib(pid: int, key: str) -> int | None:
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


class MemoryProbe:
    """Peak resident memory (VmHWM) of the server's model-worker processes, per level."""

    def __init__(self, server_pid: int | None, worker_class: str):
        self.server_pid = server_pid
        self.worker_class = worker_class
        self.pids: list[int] = []
        self.reset_ok = False

    def start_level(self) -> None:
        """Find the worker processes and reset their peak-RSS counters (Linux: clear_refs 5)."""
        if self.server_pid is None or not pathlib.Path("/proc").is_dir():
            self.pids = []
            return
        actors = ray_actor_processes(self.server_pid)
        classes = {name.strip() for name in self.worker_class.split(",")}
        self.pids = sorted(pid for pid, name in actors.items() if name in classes)
        self.reset_ok = bool(self.pids)
        for pid in self.pids:
            try:
                pathlib.Path(f"/proc/{pid}/clear_refs").write_text("5")
            except OSError:
                self.reset_ok = False

    def read(self) -> dict[str, Any] | None:
        if not self.pids:
            return None
        workers = {}
        for pid in self.pids:
            peak, current = _status_kib(pid, "VmHWM"), _status_kib(pid, "VmRSS")
            if peak is not None:
                workers[str(pid)] = {"peak_rss_bytes": peak * 1024, "rss_bytes": (current or 0) * 1024}
        return {"workers": workers, "worker_class": self.worker_class,
                "peak": "during the level" if self.reset_ok else "since the process started"}


WORKER_FORWARD_SECONDS = "specserve_worker_forward_seconds_total"
WORKER_STEP_SECONDS = "specserve_worker_step_seconds_total"


def worker_seconds(metrics_text: str, model_group: str | None = None) -> dict[str, dict[str, float]]:
    """Each worker's cumulative seconds in forward passes and in step calls, from a ``/metrics``
    text: ``{worker: {"forward_s": ..., "step_s": ...}}``. A worker is named by its ``worker``
    label, or ``worker@replica`` when the scrape covers several replicas (model groups); samples
    of another ``model_group`` than ``model_group`` (when given) are left out."""
    from prometheus_client.parser import text_string_to_metric_families

    fields = {WORKER_FORWARD_SECONDS: "forward_s", WORKER_STEP_SECONDS: "step_s"}
    found: dict[tuple[str, str], dict[str, float]] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            field_name = fields.get(sample.name)
            if field_name is None or "worker" not in sample.labels:
                continue
            if model_group is not None and sample.labels.get("model_group", model_group) != model_group:
                continue
            key = (sample.labels.get("replica", ""), sample.labels["worker"])
            found.setdefault(key, {})[field_name] = float(sample.value)
    replicas = {replica for replica, _ in found}
    return {(worker if len(replicas) <= 1 else f"{worker}@{replica}"): values
            for (replica, worker), values in sorted(found.items(), key=lambda item: (item[0][1], item[0][0]))}


def busy_fractions(before: dict[str, dict[str, float]] | None, after: dict[str, dict[str, float]] | None,
                   wall_s: float) -> dict[str, dict[str, float | None]] | None:
    """``{worker: {"forward_fraction", "step_fraction"}}``: growth of each counter over ``wall_s``.
    None without both scrapes; a fraction is None for a counter missing from either scrape or one
    that went down (the worker restarted during the level)."""
    if before is None or after is None or wall_s <= 0:
        return None
    fractions: dict[str, dict[str, float | None]] = {}
    for worker in sorted(set(before) & set(after)):
        row: dict[str, float | None] = {}
        for field_name, name in (("forward_s", "forward_fraction"), ("step_s", "step_fraction")):
            start, end = before[worker].get(field_name), after[worker].get(field_name)
            if start is None or end is None or end < start:
                if start is not None and end is not None:
                    logger.warning("%s of worker %s went down during the level (restarted?)", field_name, worker)
                row[name] = None
            else:
                row[name] = (end - start) / wall_s
        fractions[worker] = row
    return fractions


class MetricsProbe:
    """Scrapes the server's ``GET /metrics`` (through the client that carries the API key)."""

    def __init__(self, url: str, model_group: str | None):
        self.url = url
        self.model_group = model_group
        self._warned = False

    async def scrape(self, client) -> dict[str, dict[str, float]] | None:
        try:
            response = await client.get(self.url)
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {response.text[:MAX_ERROR_CHARS]}")
            return worker_seconds(response.text, self.model_group)
        except Exception as exc:  # noqa: BLE001 - the level's other figures stand without it
            if not self._warned:
                logger.warning("could not scrape %s (no busy fractions): %s: %s", self.url, type(exc).__name__, exc)
                self._warned = True
            return None


def engine_config(document: dict[str, Any], app_name: str | None, engine_settings: dict[str, Any],
                  where: str) -> dict[str, Any]:
    """A copy of a Serve config ``document`` whose application's ``args.engine`` has ``engine_settings``."""
    from cluster.config import select_application

    changed = copy.deepcopy(document)
    application = select_application(changed, app_name, where)
    args = application.get("args")
    if args is None:
        args = application["args"] = {}
    engine = args.get("engine")
    args["engine"] = {**(engine if isinstance(engine, dict) else {}), **engine_settings}
    return changed


def write_engine_config(config_path: pathlib.Path, app_name: str | None, setting: str, enabled: bool,
                        out_dir: pathlib.Path) -> pathlib.Path:
    """Write ``config_path`` with ``args.engine.<setting>`` = ``enabled`` into ``out_dir`` (named
    after the setting and its value, e.g. ``default.overlap-on.yaml``); its path."""
    from cluster.config import read_serve_config

    document = engine_config(read_serve_config(config_path), app_name, {setting: bool(enabled)}, str(config_path))
    flag = setting.replace("_", "-")
    path = out_dir / f"{config_path.stem}.{flag}-{'on' if enabled else 'off'}.yaml"
    header = (f"# {config_path} with args.engine.{setting}: {str(bool(enabled)).lower()} "
              f"(written by specserve bench --mode serve-load --{flag})\n")
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(header + yaml.safe_dump(document, sort_keys=False), encoding="utf-8")
    return path


class ServerProcess:
    """``specserve serve`` in a subprocess: started, waited for, stopped (output in ``log_path``)."""

    def __init__(self, config_path: pathlib.Path, log_path: pathlib.Path, start_timeout_s: float,
                 direct_http: bool = False):
        self.config_path = config_path.resolve()
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        # below the ephemeral range: Ray's listeners cannot take them
        self.http_port, self.grpc_port, direct_port = free_local_ports(3)
        self.direct_http_port = direct_port if direct_http else None
        self.process: subprocess.Popen | None = None
        self.start_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def client_url(self) -> str:
        """Where the clients send their requests: the replica's own HTTP server with direct HTTP, else the proxy."""
        return self.url if self.direct_http_port is None else f"http://127.0.0.1:{self.direct_http_port}"

    def command(self) -> list[str]:
        """The server's command line."""
        direct = [] if self.direct_http_port is None else ["--direct-http-port", str(self.direct_http_port)]
        return [sys.executable, "-m", "cluster.cli", "serve", "--config", str(self.config_path),
                "--host", "127.0.0.1", "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port), *direct]

    def environment(self) -> dict[str, str]:
        """The server's environment: this one, the repository on PYTHONPATH, offline hubs."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        return env

    def working_directory(self) -> pathlib.Path:
        return REPO

    def ready_line(self) -> str | None:
        """The line the server prints once every application and proxy is up (None: /health alone)."""
        return "specserve is serving"

    def _ready(self, client: Any, health: str) -> bool:
        """/health answers 200 and the server has said it is ready: /health answers as soon as the
        application runs, while `specserve serve` still waits for its proxies before it says so."""
        import httpx

        try:
            if client.get(health).status_code != 200:
                return False
        except httpx.HTTPError:  # not listening yet
            return False
        line = self.ready_line()
        return line is None or line in self.log_path.read_text(errors="replace")

    def start(self, route_prefix: str) -> None:
        import httpx

        command = self.command()
        logger.info("starting the server: %s (log: %s)", " ".join(command[1:]), self.log_path)
        started = time.perf_counter()
        with open(self.log_path, "ab") as log:
            # Its own session: a Ctrl-C in the terminal reaches the benchmark, which stops the server.
            self.process = subprocess.Popen(command, cwd=self.working_directory(), env=self.environment(), stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        health = self.url + route_prefix.rstrip("/") + "/health"
        deadline = started + self.start_timeout_s
        with httpx.Client(timeout=10.0, trust_env=False) as client:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"the server exited with code {self.process.returncode} while starting:\n"
                                       f"{self.log_tail()}")
                if self._ready(client, health):
                    break
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"the server did not answer {health} within {self.start_timeout_s:.0f} s:\n"
                                       f"{self.log_tail()}")
                time.sleep(HEALTH_POLL_S)
        self.start_s = time.perf_counter() - started
        logger.info("server healthy at %s after %.1f s", self.url, self.start_s)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGINT (the server shuts Serve and its Ray down); then SIGKILL it and what it started, if needed."""
        process = self.process
        if process is None or process.poll() is not None:
            return
        started = descendants(process.pid) if pathlib.Path("/proc").is_dir() else []
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("the server did not stop within %.0f s; killing it and its processes", STOP_TIMEOUT_S)
            process.kill()
            process.wait(timeout=30)
        for pid in started:  # only processes the server started, and only if still alive
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            except PermissionError:
                pass
        logger.info("server stopped")


# ----------------------------------------------------------------------------- clients

@dataclass(frozen=True)
class LevelPlan:
    case: LoadCase
    concurrency: int
    requests: int
    overlap: bool | None = None  # the server's args.engine.overlap (None: not known)


class LoadClient:
    """Streams completions from the server and times them."""

    def __init__(self, base_url: str, model: str, settings: ServeLoadSettings, prompts: list[Prompt],
                 api_key: str | None = None):
        self.url = base_url + "/v1/completions"
        self.metrics = MetricsProbe(base_url + "/metrics", model)
        self.model = model
        self.settings = settings
        self.prompts = prompts
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def body(self, case: LoadCase, index: int, max_tokens: int) -> dict[str, Any]:
        prompt = self.prompts[index % len(self.prompts)]
        return {
            "model": self.model, "prompt": prompt.text, "max_tokens": max_tokens,
            "temperature": self.settings.temperature, "top_p": 1.0, "top_k": 0,
            "seed": self.settings.seed + max(index, 0), "ignore_eos": True, "stream": True,
            "return_token_ids": True, "speculation": case.speculation,
        }

    async def request(self, client, case: LoadCase, concurrency: int, index: int, level_start: float,
                      max_tokens: int, overlap: bool | None = None) -> RequestRecord:
        prompt = self.prompts[index % len(self.prompts)]
        body = self.body(case, index, max_tokens)
        times: list[float] = []
        tokens: list[int] = []
        final: dict[str, Any] = {}
        error: str | None = None
        done = False
        sent = time.perf_counter()

        async def consume() -> None:
            nonlocal error, done
            async with client.stream("POST", self.url, json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    error = f"HTTP {response.status_code}: {text}"
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    arrived = time.perf_counter()
                    payload = line[len("data:"):].strip()
                    if payload == "[DONE]":
                        done = True
                        return
                    event = json.loads(payload)
                    if "error" in event:
                        error = f"stream error: {json.dumps(event['error'])}"
                        continue
                    count = 0
                    for choice in event.get("choices") or []:
                        if "token_ids" in choice:
                            count += len(choice["token_ids"])
                        elif choice.get("text"):
                            count += 1  # a server without token ids: one per non-empty chunk
                    if count:
                        times.append(arrived - sent)
                        tokens.append(count)
                    if event.get("usage"):
                        final.update(usage=event["usage"], speculation=event.get("speculation") or {})

        try:
            await asyncio.wait_for(consume(), timeout=self.settings.request_timeout_s)
        except asyncio.TimeoutError:
            error = f"timed out after {self.settings.request_timeout_s:.0f} s"
        except Exception as exc:  # noqa: BLE001 - every failure is recorded and counted
            error = f"{type(exc).__name__}: {exc}"
        if error is None and not done:
            error = "stream ended without [DONE]"
        speculation = final.get("speculation") or {}
        return RequestRecord(
            label=case.label, concurrency=concurrency, index=index, prompt_id=prompt.id,
            seed=body["seed"], ok=error is None, error=None if error is None else error[:MAX_ERROR_CHARS],
            sent_s=sent - level_start, e2e_s=time.perf_counter() - sent, chunk_times_s=times, chunk_tokens=tokens,
            usage_completion_tokens=(final.get("usage") or {}).get("completion_tokens"),
            target_calls=speculation.get("target_calls"), overlap=overlap,
            drafted_tokens=_drafted_tokens(speculation),
        )

    async def run_level(self, plan: LevelPlan, memory: MemoryProbe) -> tuple[LevelRun, list[RequestRecord]]:
        import httpx

        settings = self.settings
        limits = httpx.Limits(max_connections=plan.concurrency + 1, max_keepalive_connections=plan.concurrency + 1)
        timeout = httpx.Timeout(settings.request_timeout_s, connect=30.0)
        async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False, headers=self.headers) as client:
            warm_started = time.perf_counter()
            warm = await self.request(client, plan.case, plan.concurrency, -1, warm_started,
                                      min(settings.warmup_tokens, settings.max_tokens), plan.overlap)
            warmup_s = time.perf_counter() - warm_started
            if not warm.ok:
                logger.warning("%s warm-up failed: %s", plan.case.label, warm.error)
            memory.start_level()
            seconds_before = await self.metrics.scrape(client)
            records: list[RequestRecord] = []
            counter = itertools.count()
            started = time.perf_counter()
            deadline = started + settings.level_timeout_s

            async def closed_loop() -> None:
                while True:
                    index = next(counter)
                    if index >= plan.requests or time.perf_counter() > deadline:
                        return
                    records.append(await self.request(client, plan.case, plan.concurrency, index, started,
                                                      settings.max_tokens, plan.overlap))

            await asyncio.gather(*(closed_loop() for _ in range(plan.concurrency)))
            wall_s = time.perf_counter() - started
            seconds_after = await self.metrics.scrape(client)
        records.sort(key=lambda r: r.index)
        run = LevelRun(label=plan.case.label, strategy=plan.case.strategy, concurrency=plan.concurrency,
                       requests=plan.requests, wall_s=wall_s, warmup_ok=warm.ok, warmup_s=warmup_s,
                       memory=memory.read(), load_average=_load_avg(), overlap=plan.overlap,
                       busy=busy_fractions(seconds_before, seconds_after, wall_s))
        return run, records


# ----------------------------------------------------------------------------- the run

def _load_avg() -> str:
    try:
        return " ".join(f"{value:.2f}" for value in os.getloadavg())
    except OSError:
        return "n/a"


def run_serve_load(
    config_path: pathlib.Path | str,
    settings: ServeLoadSettings,
    out_dir: pathlib.Path,
    *,
    app_name: str | None = None,
    command: str = "specserve bench --mode serve-load",
    prompts_path: pathlib.Path = PROMPTS_PATH,
    plot_prefix: str = "",
) -> ServeLoadResults:
    """Start the server, run every level, stop the server (once per overlap pass), write the
    results under ``out_dir``."""
    from benchmarks.run import environment_info
    from cluster.config import load_app_args, read_serve_config, select_application

    started = time.perf_counter()
    load_start = _load_avg()
    config_path = pathlib.Path(config_path)
    if settings.prefix_caching is not None:
        config_path = write_engine_config(config_path, app_name, "prefix_caching", settings.prefix_caching, out_dir)
    application = select_application(read_serve_config(config_path), app_name, str(config_path))
    group = load_app_args(config_path, app_name).freeze()
    cases = serve_load_cases(settings, group.roles)
    prompts = load_prompts(prompts_path, settings.num_prompts)
    passes = settings.overlap_passes()
    per_pass = [(case, c, settings.requests_for(c)) for c in settings.concurrency for case in cases]
    logger.info("%d levels (%s at concurrency %s)%s, %d requests of %d tokens",
                len(per_pass) * len(passes), ", ".join(c.label for c in cases), ",".join(map(str, settings.concurrency)),
                "" if passes == [None] else " with overlap " + ", then ".join(_on_off(o) for o in passes),
                sum(n for _, _, n in per_pass) * len(passes), settings.max_tokens)
    out_dir.mkdir(parents=True, exist_ok=True)
    route_prefix = application.get("route_prefix") or "/"
    model = application.get("name") or "specserve"
    environment: dict[str, Any] = environment_info() | {
        "config": str(config_path), "app": model, "num_prompts": len(prompts),
        "models": {m.name: {"path": m.path, "role": m.role} for m in group.models},
        "max_concurrent_requests": group.max_concurrent_requests, "max_queued_requests": group.max_queued_requests,
        "load_average_start": load_start,
    }
    results = ServeLoadResults(settings=settings.model_dump(mode="json"), environment=environment, command=command,
                               levels=[], records=[])
    for overlap in passes:
        if overlap is None:
            # "auto" is settled by the server against its cluster's GPUs: not known here.
            configured = getattr(group, "overlap", None)
            pass_config, effective = config_path, configured if isinstance(configured, bool) else None
        else:
            pass_config, effective = write_engine_config(config_path, app_name, "overlap", overlap, out_dir), overlap
        server = ServerProcess(pass_config, out_dir / "server.log", settings.start_timeout_s, settings.direct_http)
        plans = [LevelPlan(case, c, n, effective) for case, c, n in per_pass]
        try:
            server.start(route_prefix)
            environment.setdefault("server_start_s", server.start_s)
            environment.setdefault("clients_call", "the replica's own HTTP server (direct HTTP)"
                                   if server.direct_http_port is not None else "Serve's HTTP proxy")
            if overlap is not None:
                environment.setdefault("server_passes", []).append(
                    {"overlap": overlap, "config": str(pass_config), "server_start_s": server.start_s})
            client = LoadClient(server.client_url + route_prefix.rstrip("/"), model, settings, prompts, _api_key(application))
            memory = MemoryProbe(server.process.pid if server.process else None, settings.worker_class)
            for plan in plans:
                if server.process is not None and server.process.poll() is not None:
                    raise RuntimeError(f"the server exited with code {server.process.returncode}:\n{server.log_tail()}")
                run, records = asyncio.run(client.run_level(plan, memory))
                results.levels.append(run)
                results.records.extend(records)
                summary = results.summarize().summaries[-1]
                logger.info("%s at %d%s: %d ok, %d failed, %.1f tok/s, TTFT p50 %s ms, ITL p50 %s ms, "
                            "workers peak %s MiB, busy (forward / step) %s",
                            plan.case.label, plan.concurrency, "" if overlap is None else f", overlap {_on_off(overlap)}",
                            summary.completed, summary.failed, summary.tokens_per_second, _ms(summary.ttft_median_s),
                            _ms(summary.itl_median_s),
                            "n/a" if summary.worker_peak_rss_mib_total is None else f"{summary.worker_peak_rss_mib_total:.0f}",
                            busy_text(summary.busy))
                write_json(results, out_dir)  # what is measured so far survives an interruption
        finally:
            server.stop()
    if settings.bare_limit and results.levels:
        add_bare_limits(results, settings, group, prompts)
    environment.update(load_average_end=_load_avg(), wall_time_s=time.perf_counter() - started)
    results.summarize()
    write_results(results, out_dir, plot_prefix=plot_prefix)
    return results


def _drafted_tokens(speculation: dict[str, Any]) -> int | None:
    """Tokens drafted over a request's iterations (its stats' ``draft_lengths``), or None."""
    lengths = speculation.get("draft_lengths")
    return int(sum(lengths)) if isinstance(lengths, list) and lengths else None


def level_shape(settings: ServeLoadSettings, strategy: str, concurrency: int, label: str = "",
                mean_block: float | None = None) -> LevelShape:
    """The shapes of a level's iteration (its strategy's gamma as this run sends it; an sd case
    of gamma auto, whose blocks vary, gets the shapes of its measured mean block, rounded, when
    the server reported it, else those of ``sd_gamma``)."""
    se_gamma = 1 if settings.se_gamma == "auto" else settings.se_gamma
    gamma = {"sd": settings.sd_gamma, "multi_draft": settings.multi_draft_gamma, "se": se_gamma}.get(strategy, 1)
    block = label.rsplit("/g", 1)[-1]
    if strategy == "sd" and block.isdigit():
        gamma = int(block)
    elif strategy == "sd" and block == "auto" and mean_block:
        gamma = max(1, round(mean_block))
    return LevelShape(strategy, concurrency, gamma=gamma, num_drafts=settings.num_drafts)


def add_bare_limits(results: ServeLoadResults, settings: ServeLoadSettings, group: Any, prompts: list[Prompt]) -> None:
    """Measure the bare-model limit of every level of ``results`` (benchmarks.bare_limit) and
    store it with the level (results.json keeps it; the summaries report it)."""
    results.summarize()
    roles = dict(group.roles)
    paths = {m.name: m.path for m in group.models}
    tokenizer = group.tokenizer_path or paths[_first_role(roles, "target")]
    prompt_tokens = median_prompt_tokens(tokenizer, [p.text for p in prompts])
    context = context_midway(prompt_tokens, settings.max_tokens)
    threads = max(m.torch_threads for m in group.models)
    logger.info("bare-model limit: %d levels at context %d, %d torch thread(s)", len(results.levels), context, threads)
    shapes = [level_shape(settings, run.strategy, run.concurrency, run.label, summary.mean_block)
              for run, summary in zip(results.levels, results.summaries)]
    efficiencies = [s.block_efficiency for s in results.summaries]
    records = bare_limits(shapes, efficiencies, roles, paths, context=context, repeats=settings.bare_repeats,
                          threads=threads, prompt_tokens=prompt_tokens, max_tokens=settings.max_tokens)
    results.levels = [dataclasses.replace(run, bare=record) for run, record in zip(results.levels, records)]
    results.environment["bare_limit"] = {"context": context, "prompt_tokens": prompt_tokens, "torch_threads": threads,
                                         "repeats": settings.bare_repeats}


def _first_role(roles: dict[str, str], role: str) -> str:
    return next(name for name, r in roles.items() if r == role)


def _on_off(overlap: bool | None) -> str:
    return "n/a" if overlap is None else ("on" if overlap else "off")


def _api_key(application: dict[str, Any]) -> str | None:
    """The key the server will ask for, if any: the application's ``args.security.api_key``, else
    ``SPECSERVE_API_KEY`` (the server subprocess inherits this environment). Never recorded."""
    security = (application.get("args") or {}).get("security") or {}
    return security.get("api_key") or os.environ.get("SPECSERVE_API_KEY") or None


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1000:.0f}"
