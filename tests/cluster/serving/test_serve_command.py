"""`cluster/serving/serve_command.py` and the start-up defaults it relies on (`cluster/serving/bringup.py`):
Serve's proxy gets a longer readiness timeout on a local Ray (a starved machine made Serve kill
its proxy at the 5 s default), and a proxy that fails to start ends `specserve serve` with a
message naming the setting."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from cluster.serving.bringup import (
    SERVE_PROXY_READY_TIMEOUT_ENV,
    SERVE_PROXY_READY_TIMEOUT_S,
    WORKER_NICENESS_ENV,
    set_serving_defaults,
    set_slow_start_defaults,
)
from cluster.serving.serve_command import proxy_start_failure

REPO = pathlib.Path(__file__).resolve().parents[3]


def test_slow_start_default_is_set_only_when_absent():
    environ: dict[str, str] = {}
    set_slow_start_defaults(environ)
    assert float(environ[SERVE_PROXY_READY_TIMEOUT_ENV]) == SERVE_PROXY_READY_TIMEOUT_S > 5.0
    environ = {SERVE_PROXY_READY_TIMEOUT_ENV: "2.5"}
    set_slow_start_defaults(environ)
    assert environ[SERVE_PROXY_READY_TIMEOUT_ENV] == "2.5"


def test_worker_niceness_default_is_set_only_when_absent():
    environ: dict[str, str] = {}
    set_serving_defaults(environ)
    assert environ[WORKER_NICENESS_ENV] == "0"
    environ = {WORKER_NICENESS_ENV: "15"}
    set_serving_defaults(environ)
    assert environ[WORKER_NICENESS_ENV] == "15"


#: A fresh interpreter starting its own local Ray through init_ray: an actor's niceness and the driver's.
_NICENESS_PROBE = """
import os, ray
from cluster.serving.bringup import init_ray
init_ray(num_cpus=1)
@ray.remote(num_cpus=0)
class Probe:
    def niceness(self):
        return os.nice(0)
print(ray.get(Probe.remote().niceness.remote()), os.nice(0))
ray.shutdown()
"""


@pytest.mark.slow
def test_a_local_ray_runs_its_workers_at_the_drivers_niceness():
    """Ray starts actors at niceness 15 by default; a local Ray that init_ray starts runs them at
    the driver's, and an explicit RAY_worker_niceness wins (19: the lowest priority, whether Ray adds
    it or sets it). A Ray of its own in a subprocess."""
    environ = {key: value for key, value in os.environ.items() if key not in (WORKER_NICENESS_ENV, "RAY_ADDRESS")}
    for setting in (None, "19"):
        env = environ if setting is None else {**environ, WORKER_NICENESS_ENV: setting}
        result = subprocess.run([sys.executable, "-c", _NICENESS_PROBE], env=env, capture_output=True, text=True,
                                timeout=180, cwd=REPO)
        assert result.returncode == 0, result.stderr[-2000:]
        actor, driver = (int(value) for value in result.stdout.split()[-2:])
        assert actor == (driver if setting is None else 19)


def test_a_proxy_start_failure_names_the_setting(monkeypatch):
    """The error `deploy` raises (and `specserve serve` logs, exit code 1) when `serve.start`
    fails with a Ray error: Ray's first line and the readiness timeout now in force."""
    from ray.exceptions import GetTimeoutError

    monkeypatch.setenv(SERVE_PROXY_READY_TIMEOUT_ENV, "7")
    message = proxy_start_failure(GetTimeoutError("Get timed out: some object(s) not ready.\nmore detail"))
    assert message.startswith("Ray Serve's HTTP/gRPC proxy did not start (GetTimeoutError: Get timed out")
    assert "more detail" not in message
    assert f"raise {SERVE_PROXY_READY_TIMEOUT_ENV} (now 7 s)" in message
    monkeypatch.delenv(SERVE_PROXY_READY_TIMEOUT_ENV)
    assert "(now Ray's default of 5 s)" in proxy_start_failure(GetTimeoutError(""))


def _document(server: dict | None = None, deployment: dict | None = None) -> dict:
    app = {"name": "specserve", "import_path": "cluster.app:build_app", "args": {"server": server or {}},
           "deployments": [{"name": "SpecServeIngress", **(deployment or {})}]}
    return {"applications": [app]}


def test_the_direct_http_port_comes_from_the_flag_then_the_yaml_and_is_off_by_default():
    from cluster.serving.serve_command import resolve_addresses

    assert resolve_addresses(_document()).direct_http_port is None
    assert resolve_addresses(_document({"direct_http_port": 8100})).direct_http_url == "http://127.0.0.1:8100"
    assert resolve_addresses(_document({"direct_http_port": 8100}), direct_http_port=8200).direct_http_port == 8200


def test_direct_http_takes_one_port_per_replica_the_ingress_may_run():
    """Serve's direct ingress reads its switch and port range from the environment of the Ray it
    starts; the range holds a port per replica (num_replicas, or autoscaling's max_replicas), and
    a stopped replica's port is reused at once (no quarantine)."""
    from cluster.serving.serve_command import (
        DIRECT_HTTP_PORTS_ENV,
        DIRECT_INGRESS_ENV,
        PORT_QUARANTINE_ENV,
        direct_http_environment,
        ingress_replicas,
        resolve_addresses,
    )

    assert ingress_replicas(_document()) == 1
    assert ingress_replicas(_document(deployment={"num_replicas": 3})) == 3
    assert ingress_replicas(_document(deployment={"autoscaling_config": {"min_replicas": 1, "max_replicas": 4}})) == 4
    assert ingress_replicas(_document(deployment={"num_replicas": "auto"})) == 100  # Serve's default for auto
    addresses = resolve_addresses(_document({"direct_http_port": 8100}))
    environment = direct_http_environment(addresses, replicas=3)
    assert environment == {DIRECT_INGRESS_ENV: "1", DIRECT_HTTP_PORTS_ENV[0]: "8100", DIRECT_HTTP_PORTS_ENV[1]: "8103",
                           PORT_QUARANTINE_ENV: "0"}  # Serve's range excludes its upper end: 8100, 8101, 8102
    assert direct_http_environment(resolve_addresses(_document()), replicas=3) == {}


def test_a_direct_http_range_over_the_proxy_ports_is_refused_naming_the_field():
    import pytest

    from cluster.config import ConfigError
    from cluster.serving.serve_command import direct_http_environment, resolve_addresses

    with pytest.raises(ConfigError, match=r"server.direct_http_port: the replicas' ports 7999..8000 include the http_port 8000"):
        direct_http_environment(resolve_addresses(_document({"direct_http_port": 7999})), replicas=2)
    with pytest.raises(ConfigError, match="grpc_port 9000"):
        direct_http_environment(resolve_addresses(_document({"direct_http_port": 9000})), replicas=1)
    with pytest.raises(ConfigError, match=r"must be a port in \[1, 65535\], got 0"):
        direct_http_environment(resolve_addresses(_document(), direct_http_port=0), replicas=1)
    with pytest.raises(ConfigError, match="past port 65535"):
        direct_http_environment(resolve_addresses(_document({"direct_http_port": 65535})), replicas=2)


def test_direct_http_is_refused_when_joining_a_running_cluster(monkeypatch, caplog):
    """Serve's processes read the switch when the cluster starts: a cluster already running cannot
    take it from here (exit code 2, the message says what to do)."""
    import logging
    import pathlib

    from cluster.serving import serve_command

    config = pathlib.Path(__file__).resolve().parents[3] / "deploy" / "default.yaml"
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # nothing is contacted: refused before Ray starts
    with caplog.at_level(logging.ERROR, logger="cluster.serving.serve_command"):
        assert serve_command.run_serve(str(config), direct_http_port=8100, block=False) == 2
    assert "server.direct_http_port: direct HTTP needs the Ray that `specserve serve` starts itself" in caplog.text
