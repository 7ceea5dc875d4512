"""`specserve serve` end to end, in a subprocess with its own Ray (the session Ray is untouched):
it starts Ray, deploys a Serve YAML, prints the addresses (and the CPU binding), serves HTTP and
gRPC (HTTP also straight from the replica, ``--direct-http-port``), and shuts down cleanly on
Ctrl-C (SIGINT)."""

from __future__ import annotations

import os
import pathlib
import queue
import signal
import subprocess
import sys
import threading
import time

import grpc
import httpx
import yaml

from cluster.serving.local_ports import free_local_ports
from protos import specserve_pb2, specserve_pb2_grpc

from tests.cluster.conftest import serve_document, specserve_application

REPO = pathlib.Path(__file__).resolve().parents[3]
START_TIMEOUT_S = 300
STOP_TIMEOUT_S = 90


def _reader(stream, lines: queue.Queue) -> None:
    for line in iter(stream.readline, ""):
        lines.put(line)
    lines.put(None)


def test_serve_command_serves_until_ctrl_c(tmp_path, tiny_checkpoints):
    args = {
        "models": {
            "target": {"path": str(tiny_checkpoints["target"]), "role": "target"},
            "draft": {"path": str(tiny_checkpoints["draft"]), "role": "draft"},
        },
        "defaults": {"strategy": "sd", "method": "block", "gamma": 4},
        "resources": {"cpus_per_model": 0.25, "torch_threads": 1, "cpu_affinity": "auto"},
    }
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump(serve_document([specserve_application("specserve", "/", args)])))
    http_port, grpc_port, direct_port = free_local_ports(3)
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    command = [sys.executable, "-m", "cluster.cli", "serve", "--config", str(config),
               "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--direct-http-port", str(direct_port)]
    process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    stdout_lines: queue.Queue = queue.Queue()
    stderr_lines: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(process.stdout, stdout_lines), daemon=True).start()
    threading.Thread(target=_reader, args=(process.stderr, stderr_lines), daemon=True).start()
    printed: list[str] = []
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not any(line.startswith("HTTP direct") for line in printed):
            assert process.poll() is None, f"serve exited early with {process.returncode}"
            try:
                line = stdout_lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no addresses printed after {START_TIMEOUT_S}s: {printed}") from None
            assert line is not None, f"stdout closed: {printed}"
            printed.append(line.strip())
        assert f"HTTP (OpenAI-compatible): http://127.0.0.1:{http_port}/v1" in printed
        assert f"gRPC (specserve.SpecServe): 127.0.0.1:{grpc_port}" in printed
        assert f"HTTP direct to the replica, skipping the proxy: http://127.0.0.1:{direct_port}/v1" in printed

        body = {"prompt": "def f(x):", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        completion = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions", json=body, timeout=120).json()
        assert completion["usage"]["completion_tokens"] == 5
        # --direct-http-port: the replica answers on its own port too, the same completion (greedy)
        direct = httpx.post(f"http://127.0.0.1:{direct_port}/v1/completions", json=body, timeout=120).json()
        assert direct["choices"][0]["text"] == completion["choices"][0]["text"]
        with httpx.stream("POST", f"http://127.0.0.1:{direct_port}/v1/completions", json={**body, "stream": True},
                          timeout=120) as streamed:
            events = [line for line in streamed.iter_lines() if line.startswith("data:")]
        assert streamed.status_code == 200 and events[-1] == "data: [DONE]" and len(events) >= 2
        refused = httpx.post(f"http://127.0.0.1:{direct_port}/v1/completions", json={**body, "max_tokens": -1})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            response = specserve_pb2_grpc.SpecServeStub(channel).Generate(
                specserve_pb2.GenerateRequest(prompt="def f(x):", sampling=specserve_pb2.SamplingOptions(max_tokens=5)),
                timeout=120,
            )
        assert len(response.token_ids) >= 1 and response.finished

        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=STOP_TIMEOUT_S) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    stderr = []
    try:
        while (line := stderr_lines.get(timeout=10)) is not None:
            stderr.append(line)
    except queue.Empty:  # a Ray child may still hold the pipe; what was logged is enough
        pass
    assert any("stopped" in line for line in stderr), "".join(stderr[-20:])
    # resources.cpu_affinity: auto (docs/serving.md, "CPU binding"): with a core to spare, the target's
    # worker reports a core of its own, the last one, and every other process runs on the rest.
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) >= 2:
        rest = ", ".join(str(core) for core in cores[:-1])
        assert f"cpu affinity: Ray, Serve and the coordinators on cores [{rest}]; workers' cores [{cores[-1]}]" in printed
        assert any("worker target (target)" in line and line.rstrip().endswith(f"on cores [{cores[-1]}]")
                   for line in stderr), "".join(line for line in stderr if "worker target" in line)
    # No API key configured: the start-up warning says gRPC listens on every interface.
    assert any("no API key for application 'specserve'" in line and "every interface" in line for line in stderr), (
        "".join(stderr[-20:])
    )
