"""`cluster/serve_command.py` and the start-up defaults it relies on (`cluster/bringup.py`):
Serve's proxy gets a longer readiness timeout on a local Ray (a starved machine made Serve kill
its proxy at the 5 s default), and a proxy that fails to start ends `specserve serve` with a
message naming the setting."""

from __future__ import annotations

from cluster.bringup import SERVE_PROXY_READY_TIMEOUT_ENV, SERVE_PROXY_READY_TIMEOUT_S, set_slow_start_defaults
from cluster.serve_command import proxy_start_failure


def test_slow_start_default_is_set_only_when_absent():
    environ: dict[str, str] = {}
    set_slow_start_defaults(environ)
    assert float(environ[SERVE_PROXY_READY_TIMEOUT_ENV]) == SERVE_PROXY_READY_TIMEOUT_S > 5.0
    environ = {SERVE_PROXY_READY_TIMEOUT_ENV: "2.5"}
    set_slow_start_defaults(environ)
    assert environ[SERVE_PROXY_READY_TIMEOUT_ENV] == "2.5"


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
