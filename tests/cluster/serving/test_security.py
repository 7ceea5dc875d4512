"""API key: configuration (YAML, environment), header / metadata parsing, constant-time check,
start-up warnings (no Ray needed; the served checks are in test_app_security.py)."""

from __future__ import annotations

import logging

import pytest

from cluster.config import API_KEY_ENV, ConfigError, parse_app_args, resolve_api_key
from cluster.serving.errors import Unauthenticated
from cluster.serving.security import bearer_token, key_matches, presented_key, require_key
from cluster.serving.serve_command import api_key_warnings, resolve_addresses

KEY = "k3y-0123456789abcdef"


def _args(**security) -> dict:
    args = {"models": {"target": {"path": "embedded:target", "role": "target"}}, "defaults": {"strategy": "ar"}}
    if security:
        args["security"] = security
    return args


def test_yaml_key_wins_over_the_environment_which_is_used_when_the_yaml_has_none():
    assert resolve_api_key(parse_app_args(_args(api_key=KEY)), {API_KEY_ENV: "other-key-0123456789"}) == KEY
    assert resolve_api_key(parse_app_args(_args()), {API_KEY_ENV: "other-key-0123456789"}) == "other-key-0123456789"
    assert resolve_api_key(parse_app_args(_args()), {}) is None
    assert resolve_api_key(parse_app_args(_args()), {API_KEY_ENV: ""}) is None  # empty: unset


@pytest.mark.parametrize("bad", ["short", "x" * 257, "has space in the key 123", "ключ-0123456789abcdef"])
def test_malformed_keys_are_rejected_without_echoing_them(bad):
    with pytest.raises(ConfigError) as caught:
        parse_app_args(_args(api_key=bad))
    assert "security.api_key" in str(caught.value)
    assert bad not in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        resolve_api_key(parse_app_args(_args()), {API_KEY_ENV: bad})
    assert API_KEY_ENV in str(caught.value) and bad not in str(caught.value)


def test_the_key_is_not_in_the_args_repr():
    assert KEY not in repr(parse_app_args(_args(api_key=KEY)))


def test_unknown_security_field_is_rejected():
    with pytest.raises(ConfigError, match="security.token"):
        parse_app_args(_args(token="x"))


def test_bearer_and_x_api_key_parsing():
    assert bearer_token(f"Bearer {KEY}") == KEY
    assert bearer_token(f"bearer   {KEY}  ") == KEY
    assert bearer_token(f"Basic {KEY}") is None
    assert bearer_token("Bearer") is None and bearer_token("") is None and bearer_token(None) is None
    assert presented_key({"Authorization": f"Bearer {KEY}"}) == KEY
    assert presented_key([("x-api-key", KEY)]) == KEY  # gRPC metadata pairs
    assert presented_key([("authorization", f"Bearer {KEY}"), ("x-api-key", "other")]) == KEY
    assert presented_key([("authorization", "Basic abc"), ("x-api-key", KEY)]) == KEY
    assert presented_key([("application", "specserve")]) is None
    assert presented_key([("x-api-key-bin", b"\x00")]) is None


def test_key_comparison():
    assert key_matches(KEY, KEY)
    assert not key_matches(KEY, KEY[:-1])
    assert not key_matches(KEY, KEY + "x")
    assert not key_matches(KEY, None)
    assert not key_matches(KEY, "ключ")  # non-ASCII input compares (as bytes) instead of raising


def test_require_key():
    require_key(None, {})  # no key configured: open
    require_key(KEY, {"authorization": f"Bearer {KEY}"})
    for headers in ({}, {"authorization": "Bearer wrong-key-0123456789"}, {"x-api-key": ""}):
        with pytest.raises(Unauthenticated) as caught:
            require_key(KEY, headers)
        assert KEY not in str(caught.value)


def _document(*apps) -> dict:
    return {"applications": [{"name": name, "import_path": "cluster.app:build_app", "args": args} for name, args in apps]}


def test_start_up_warns_about_every_application_without_a_key():
    document = _document(("open", _args()), ("keyed", _args(api_key=KEY)))
    addresses = resolve_addresses(document, grpc_port=9123)
    (warning,) = api_key_warnings(document, addresses, joining_cluster=False, environ={})
    assert "'open'" in warning and "'keyed'" not in warning
    assert "every interface" in warning and "[::]:9123" in warning
    assert api_key_warnings(document, addresses, joining_cluster=False, environ={API_KEY_ENV: KEY}) == []


def test_start_up_warns_when_the_environment_key_may_not_reach_a_running_cluster():
    document = _document(("app", _args()))
    addresses = resolve_addresses(document)
    assert api_key_warnings(document, addresses, joining_cluster=False, environ={API_KEY_ENV: KEY}) == []
    (warning,) = api_key_warnings(document, addresses, joining_cluster=True, environ={API_KEY_ENV: KEY})
    assert API_KEY_ENV in warning and KEY not in warning
    with pytest.raises(ConfigError):
        api_key_warnings(document, addresses, joining_cluster=False, environ={API_KEY_ENV: "short"})


def test_serve_command_logs_the_warning_before_starting_ray(tmp_path, monkeypatch, caplog):
    """`specserve serve` warns (and a malformed SPECSERVE_API_KEY stops it) before Ray starts."""
    import yaml

    from cluster.serving import serve_command

    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump(_document(("app", _args()))))
    monkeypatch.setenv(API_KEY_ENV, "short")
    with caplog.at_level(logging.ERROR, logger="cluster.serving.serve_command"):
        assert serve_command.run_serve(str(config), block=False) == 2
    assert API_KEY_ENV in caplog.text and "short" not in caplog.text.replace(API_KEY_ENV, "")

    started = []
    monkeypatch.delenv(API_KEY_ENV)
    monkeypatch.setattr("cluster.serving.bringup.init_ray", lambda: started.append(True) or (_ for _ in ()).throw(SystemExit))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cluster.serving.serve_command"), pytest.raises(SystemExit):
        serve_command.run_serve(str(config), block=False)
    assert started and "no API key for application 'app'" in caplog.text
