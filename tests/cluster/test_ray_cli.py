"""Ray's own CLI path, end to end, in subprocesses: ``ray start --head``, ``serve deploy
deploy/default.yaml``, ``serve status``, requests over HTTP (the ``openai`` client) and gRPC (the
committed stubs), ``serve shutdown``, then the head is stopped.

The head runs in its own process group, on free ports, in a Ray temp directory of its own, so the
session's shared Ray instance (tests/conftest.py) is never touched: this test talks to its cluster
only through the ``serve`` CLI (the dashboard's REST API) and the HTTP / gRPC proxies, never
through this process's ``ray`` module, and it never runs ``ray stop`` (which would stop every Ray
on the machine). Every process the head starts carries a marker environment variable; teardown
stops the head's process group (SIGTERM, then SIGKILL) and checks that no marked process is left.

The deployed file is ``deploy/default.yaml`` itself (the embedded model family), rewritten only
for free HTTP / gRPC ports on 127.0.0.1.
"""

from __future__ import annotations

import os
import pathlib
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator

import grpc
import httpx
import pytest
import yaml

from cluster.serving.local_ports import free_local_ports
from protos import specserve_pb2, specserve_pb2_grpc

REPO = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_YAML = REPO / "deploy" / "default.yaml"
BIN = pathlib.Path(sys.executable).parent
APP = "specserve"
MARKER = "SPECSERVE_RAY_CLI_TEST"

#: Bounds for a loaded 2-core machine (the normal case is far below: about 10 s for the head,
#: 20-40 s for the application).
HEAD_START_TIMEOUT_S = 120.0
DEPLOY_TIMEOUT_S = 240.0
REQUEST_TIMEOUT_S = 120.0
SHUTDOWN_TIMEOUT_S = 90.0
CLI_TIMEOUT_S = 120.0
TERM_GRACE_S = 45.0  # a node drains for up to 30 s
KILL_GRACE_S = 15.0
MAX_TOKENS = 16
PROMPT = "def main("


# ------------------------------------------------------------------------------------ helpers


def _cli_env(ray_tmp: str, marker: str, token: str) -> dict[str, str]:
    """The environment of the head and of every CLI call: this process's, without any Ray
    variable (the session Ray's address must not reach the separate cluster, nor this cluster's
    reach the session), plus:

    - Ray's token authentication (on by default for ``ray start --head``) with a token of this
      test's own, so ``~/.ray/auth_token`` is neither read nor created;
    - offline model loading;
    - the repository on the path: the workers import ``cluster``, ``actors``, ``verifiers``,
      ``protos`` and ``models`` (the editable install covers it; the path makes the test
      independent of how the package was installed).
    """
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_") and key != "TMPDIR"}
    env.pop("SPECSERVE_API_KEY", None)
    env.update(
        RAY_TMPDIR=ray_tmp,
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=token,
        RAY_USAGE_STATS_ENABLED="0",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join(part for part in (str(REPO), env.get("PYTHONPATH", "")) if part),
    )
    env[MARKER] = marker
    return env


def _marked_processes(marker: str) -> dict[int, str]:
    """pid -> command line of every live (non-zombie) process whose environment has the marker
    (Linux ``/proc``; elsewhere only the process group is stopped)."""
    needle = f"{MARKER}={marker}".encode()
    found: dict[int, str] = {}
    if not pathlib.Path("/proc/self/environ").exists():
        return found
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError):  # gone meanwhile, or not ours to read
            continue
        if state != "Z":
            found[int(entry.name)] = command
    return found


def _tail(path: pathlib.Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as error:
        return f"<{path}: {error}>"


class RayHead:
    """``ray start --head --block`` in its own process group, on free ports."""

    def __init__(self, workdir: pathlib.Path):
        # Unix socket paths are limited to ~100 characters: a short temp dir directly under /tmp.
        self.ray_tmp = tempfile.mkdtemp(prefix="ssrc-", dir="/tmp")
        self.marker = uuid.uuid4().hex
        self.token = secrets.token_hex(32)
        self.env = _cli_env(self.ray_tmp, self.marker, self.token)
        self.log_path = workdir / "ray-head.log"
        # Every port of the head at once: two ports Ray is given must never be the same.
        self.head_ports = free_local_ports(9)
        self.dashboard_port = self.head_ports[0]
        self.dashboard_url = f"http://127.0.0.1:{self.dashboard_port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        options = ("--dashboard-port", "--port", "--ray-client-server-port", "--dashboard-agent-listen-port",
                   "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port",
                   "--node-manager-port", "--object-manager-port")
        ports = dict(zip(options, self.head_ports))
        command = [str(BIN / "ray"), "start", "--head", "--block",
                   "--include-dashboard=true", "--dashboard-host", "127.0.0.1", "--num-cpus", "4",
                   "--num-gpus", "0", "--temp-dir", self.ray_tmp, "--disable-usage-stats",
                   *(str(item) for option, port in ports.items() for item in (option, port))]
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(command, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)

    def wait_for_dashboard(self) -> None:
        """Until the dashboard's Serve REST API answers (what ``serve deploy`` talks to)."""
        deadline = time.monotonic() + HEAD_START_TIMEOUT_S
        while True:
            assert self.process.poll() is None, f"ray start exited with {self.process.returncode}:\n{self.logs()}"
            try:
                reply = httpx.get(f"{self.dashboard_url}/api/serve/applications/",
                                  headers={"Authorization": f"Bearer {self.token}"}, timeout=10)
                if reply.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (
                f"the dashboard did not answer within {HEAD_START_TIMEOUT_S:.0f} s:\n{self.logs()}")
            time.sleep(0.5)

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """A ``serve`` CLI call against this head's dashboard."""
        command = [str(BIN / "serve"), *args, "--address", self.dashboard_url]
        try:
            result = subprocess.run(command, cwd=REPO, env=self.env, capture_output=True, text=True,
                                    timeout=CLI_TIMEOUT_S, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as error:
            raise AssertionError(
                f"{' '.join(command[1:])} did not return within {CLI_TIMEOUT_S:.0f} s:\n{error.stdout}\n"
                f"{error.stderr}\n{self.logs()}") from None
        if check:
            assert result.returncode == 0, (
                f"{' '.join(command[1:])} exited with {result.returncode}:\n{result.stdout}\n{result.stderr}")
        return result

    def status(self) -> tuple[dict, str]:
        """``serve status`` parsed (its YAML output), and the text."""
        text = self.cli("status").stdout
        return yaml.safe_load(text) or {}, text

    def logs(self) -> str:
        """The head's output and the tails of the Serve logs (controller, proxies, replicas)."""
        parts = [f"--- ray start --head output ({self.log_path}):\n{_tail(self.log_path)}"]
        serve_logs = pathlib.Path(self.ray_tmp) / "session_latest" / "logs" / "serve"
        for path in sorted(serve_logs.glob("*.log")) if serve_logs.is_dir() else []:
            parts.append(f"--- {path.name}:\n{_tail(path, 25)}")
        return "\n".join(parts)

    def _gone_within(self, seconds: float) -> bool:
        """Wait until ``ray start`` has exited and no process of this head is left."""
        deadline = time.monotonic() + seconds
        while self.process.poll() is None or _marked_processes(self.marker):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.25)
        return True

    def _signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.process.pid, signum)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        """Stop the head and everything it started; asserts that nothing survived.

        1. SIGTERM to ``ray start`` itself: it drains the node and stops its processes in order
           (about 3 s). Signalling the whole group at once would stop the GCS under the drain,
           which then waits out its full 30 s.
        2. Whatever is left after the grace period: SIGTERM to the process group, then SIGKILL to
           the group and to every marked process (Ray's workers run in process groups of their own).
        """
        if self.process is None:
            shutil.rmtree(self.ray_tmp, ignore_errors=True)
            return
        try:
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGTERM)
            if not self._gone_within(TERM_GRACE_S):
                self._signal_group(signal.SIGTERM)
                if not self._gone_within(KILL_GRACE_S):
                    self._signal_group(signal.SIGKILL)
                    for pid in _marked_processes(self.marker):
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    self._gone_within(KILL_GRACE_S)
            survivors = _marked_processes(self.marker)
            assert self.process.poll() is not None and not survivors, (
                f"processes started by the Ray head survived its teardown: {survivors}")
        finally:
            shutil.rmtree(self.ray_tmp, ignore_errors=True)


@pytest.fixture
def ray_head(tmp_path) -> Iterator[RayHead]:
    head = RayHead(tmp_path)
    try:
        head.start()
        head.wait_for_dashboard()
        yield head
    finally:
        head.stop()


def _port_answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return True
    except OSError:
        return False


def _default_yaml_on(path: pathlib.Path, http_port: int, grpc_port: int) -> None:
    """deploy/default.yaml with only the proxies' host and ports changed."""
    document = yaml.safe_load(DEFAULT_YAML.read_text())
    document["http_options"] = {**(document.get("http_options") or {}), "host": "127.0.0.1", "port": http_port}
    document["grpc_options"] = {**(document.get("grpc_options") or {}), "port": grpc_port}
    path.write_text(yaml.safe_dump(document, sort_keys=False))


# --------------------------------------------------------------------------------------- test


@pytest.mark.slow
def test_ray_start_serve_deploy_status_requests_shutdown(ray_head, tmp_path):
    started = time.monotonic()
    http_port, grpc_port = free_local_ports(2)
    config = tmp_path / "default.yaml"
    _default_yaml_on(config, http_port, grpc_port)

    # serve deploy: the dashboard's REST API takes the file; the controller deploys it.
    ray_head.cli("deploy", str(config))
    deadline = time.monotonic() + DEPLOY_TIMEOUT_S
    while True:
        status, text = ray_head.status()
        app = (status.get("applications") or {}).get(APP) or {}
        assert app.get("status") not in ("DEPLOY_FAILED", "UNHEALTHY"), f"{APP} failed:\n{text}\n{ray_head.logs()}"
        if app.get("status") == "RUNNING":
            break
        assert time.monotonic() < deadline, (
            f"{APP} not RUNNING after {DEPLOY_TIMEOUT_S:.0f} s; serve status:\n{text}\n{ray_head.logs()}")
        time.sleep(1.0)
    deployments = app.get("deployments") or {}
    assert (deployments.get("SpecServeIngress") or {}).get("status") == "HEALTHY", text
    deployed_s = time.monotonic() - started

    # HTTP: the OpenAI client, the deployment's defaults (sd, block verification, gamma 4).
    from openai import OpenAI

    http_url = f"http://127.0.0.1:{http_port}"
    assert httpx.get(f"{http_url}/health", timeout=REQUEST_TIMEOUT_S).json() == {"status": "ok", "model": APP}
    client = OpenAI(base_url=f"{http_url}/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0)
    completion = client.completions.create(model=APP, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body={"ignore_eos": True})
    choice = completion.choices[0]
    assert completion.model == APP and choice.finish_reason == "length" and choice.text, completion
    usage = completion.usage
    assert usage.completion_tokens == MAX_TOKENS and usage.prompt_tokens >= 1, usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens, usage
    speculation = completion.model_extra["speculation"]
    assert (speculation["strategy"], speculation["method"]) == ("sd", "block"), speculation
    assert speculation["block_efficiency"] == pytest.approx(MAX_TOKENS / speculation["target_calls"]), speculation
    assert len(speculation["accepted_lengths"]) == speculation["model_calls"]["target"] == speculation["target_calls"]

    # gRPC: the committed stubs through Serve's gRPC proxy, the same prompt greedily.
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        grpc.channel_ready_future(channel).result(timeout=REQUEST_TIMEOUT_S)
        response = specserve_pb2_grpc.SpecServeStub(channel).Generate(
            specserve_pb2.GenerateRequest(
                prompt=PROMPT,
                sampling=specserve_pb2.SamplingOptions(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
            ),
            metadata=(("application", APP),),
            timeout=REQUEST_TIMEOUT_S,
        )
    assert response.finished and response.finish_reason == "length" and response.model == APP, response
    assert len(response.token_ids) == response.usage.completion_tokens == MAX_TOKENS, response
    assert response.usage.prompt_tokens == usage.prompt_tokens, response.usage
    assert response.usage.total_tokens == response.usage.prompt_tokens + MAX_TOKENS, response.usage
    assert response.text == choice.text, (response.text, choice.text)  # greedy: both protocols agree
    assert response.speculation.strategy == "sd" and response.speculation.target_calls >= 1, response.speculation

    # serve shutdown: the application goes away and the HTTP proxy stops answering.
    ray_head.cli("shutdown", "-y")
    deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
    while True:
        status, text = ray_head.status()
        gone = APP not in (status.get("applications") or {})
        if gone and not _port_answers(http_port):
            break
        assert time.monotonic() < deadline, (
            f"after serve shutdown, after {SHUTDOWN_TIMEOUT_S:.0f} s: application listed: {not gone}, "
            f"HTTP port answers: {_port_answers(http_port)}; serve status:\n{text}\n{ray_head.logs()}")
        time.sleep(1.0)
    print(f"\nray CLI path: deployed in {deployed_s:.1f} s, everything in {time.monotonic() - started:.1f} s")
