"""The served side of a serving-load run: ``specserve serve`` in a subprocess, the peak memory of its
model workers (``VmHWM`` of their processes, found in ``/proc``) and their busy fractions (from
``GET /metrics``), and the copies of a Serve YAML with one engine setting forced."""

from __future__ import annotations

import copy
import logging
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
from typing import Any

import yaml

from cluster.serving.local_ports import free_local_ports

logger = logging.getLogger(__name__)

REPO = pathlib.Path(__file__).resolve().parents[2]
HEALTH_POLL_S = 1.0
STOP_TIMEOUT_S = 120.0
MAX_ERROR_CHARS = 300


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
