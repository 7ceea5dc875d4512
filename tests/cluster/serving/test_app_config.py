"""deploy/*.yaml, build_app and the `specserve serve` option handling (no Ray needed)."""

from __future__ import annotations

import pathlib

import pytest
from ray.serve.schema import ServeDeploySchema

from cluster.serving.ingress import (
    DEPLOYMENT_NAME,
    GRPC_SERVICER_FUNCTION,
    GRPC_SERVICER_REGISTRATION,
    INGRESS_CPUS,
    build_app,
    replica_bundles,
)
from cluster.config import ConfigError, load_app_args, parse_app_args, read_serve_config
from cluster.serving.serve_command import resolve_addresses, validate_document, with_addresses

REPO = pathlib.Path(__file__).resolve().parents[3]
DEPLOY_FILES = sorted((REPO / "deploy").glob("*.yaml"))


def test_the_expected_deploy_files_exist():
    assert {path.name for path in DEPLOY_FILES} >= {
        "default.yaml",
        "ensemble.yaml",
        "multi_draft.yaml",
        "gpu-cluster.example.yaml",
    }


@pytest.mark.parametrize("path", DEPLOY_FILES, ids=lambda path: path.name)
def test_deploy_file_is_a_valid_serve_config_with_valid_args(path):
    document = read_serve_config(path)
    schema = ServeDeploySchema.model_validate(document)  # what `serve run` / `serve deploy` accept
    assert schema.grpc_options.grpc_servicer_functions == [GRPC_SERVICER_REGISTRATION]
    for app in document["applications"]:
        assert app["import_path"] == "cluster.app:build_app"
        assert [deployment["name"] for deployment in app["deployments"]] == [DEPLOYMENT_NAME]
        args = load_app_args(path, app["name"])
        application = build_app(app["args"])
        deployment = application._bound_deployment
        options = deployment.ray_actor_options
        assert options["num_cpus"] == INGRESS_CPUS
        assert deployment._replica_config.placement_group_bundles == replica_bundles(args.freeze())
        assert deployment._replica_config.placement_group_strategy == "PACK"


def test_default_yaml_is_sd_with_block_verification_on_the_embedded_family():
    document = read_serve_config(REPO / "deploy/default.yaml")
    args = load_app_args(REPO / "deploy/default.yaml")
    assert (args.defaults.strategy, args.defaults.method) == ("sd", "block")
    assert all(model.path.startswith("embedded:") for model in args.models.values())
    assert (document["http_options"]["host"], document["http_options"]["port"]) == ("127.0.0.1", 8000)
    assert document["grpc_options"]["port"] == 9000


def test_ensemble_yaml_has_two_and_three_member_speculative_ensembles():
    path = REPO / "deploy/ensemble.yaml"
    sizes = {}
    for app in read_serve_config(path)["applications"]:
        args = load_app_args(path, app["name"])
        assert args.defaults.strategy == "se"
        sizes[app["name"]] = len(args.defaults.members)
    assert sorted(sizes.values()) == [2, 3]


def test_multi_draft_yaml_uses_several_drafts():
    args = load_app_args(REPO / "deploy/multi_draft.yaml")
    assert args.defaults.strategy == "multi_draft" and args.defaults.num_drafts >= 2


def test_gpu_cluster_example_has_one_gpu_per_model_two_replicas_and_autoscaling():
    path = REPO / "deploy/gpu-cluster.example.yaml"
    document = read_serve_config(path)
    config = load_app_args(path).freeze()
    assert all(not model.path.startswith(("embedded:", "/")) for model in config.models)  # hub ids
    assert all(model.num_gpus == 1 for model in config.models)
    bundles = replica_bundles(config)
    assert [bundle.get("GPU", 0) for bundle in bundles] == [0] + [1] * len(config.models)
    autoscaling = document["applications"][0]["deployments"][0]["autoscaling_config"]
    assert autoscaling["min_replicas"] == 2 and autoscaling["max_replicas"] > 2


def test_replica_bundles_put_the_replica_first_then_one_bundle_per_model():
    args = parse_app_args(
        {
            "models": {"t": {"path": "/m/t", "role": "target"}, "d": {"path": "/m/d", "role": "draft"}},
            "resources": {"cpus_per_model": 0.5, "coordinator_cpus": 0.2, "per_model": {"t": {"gpus": 1}}},
        }
    )
    assert replica_bundles(args.freeze()) == [
        {"CPU": pytest.approx(INGRESS_CPUS + 0.2)},
        {"CPU": 0.5, "GPU": 1.0},
        {"CPU": 0.5},
    ]


@pytest.mark.parametrize(
    "args, named",
    [
        ({"models": {"t": {"path": "x", "role": "target"}}, "defaults": {"strategy": "beam"}}, ["defaults.strategy", "'beam'"]),
        ({"models": {"t": {"path": "x", "role": "boss"}}}, ["models.t.role", "'boss'"]),
        ({"models": {"t": {"path": "x", "role": "target"}}, "replicas": 3}, ["replicas", "3"]),
    ],
)
def test_bad_args_fail_build_app_naming_the_key_and_value(args, named):
    with pytest.raises(ConfigError) as caught:
        build_app(args)
    for text in named:
        assert text in str(caught.value)


def test_validate_document_checks_every_specserve_application():
    document = read_serve_config(REPO / "deploy/ensemble.yaml")
    document["applications"][1]["args"]["defaults"]["gammas"] = [4, 0, 4]
    with pytest.raises(ConfigError, match="ensemble-3"):
        validate_document(document, "ensemble.yaml")


def test_addresses_flags_override_yaml_which_overrides_args_server_and_defaults():
    document = {
        "http_options": {"host": "127.0.0.2", "port": 8100},
        "applications": [{"import_path": "cluster.app:build_app", "args": {"server": {"grpc_port": 9300, "http_port": 1}}}],
    }
    assert resolve_addresses(document).http_url == "http://127.0.0.2:8100"
    assert resolve_addresses(document).grpc_port == 9300
    flagged = resolve_addresses(document, host="127.0.0.1", http_port=18000, grpc_port=19000)
    assert (flagged.http_url, flagged.grpc_target) == ("http://127.0.0.1:18000", "127.0.0.1:19000")
    bare = resolve_addresses({"applications": []})
    assert (bare.host, bare.http_port, bare.grpc_port) == ("127.0.0.1", 8000, 9000)


def test_with_addresses_registers_the_grpc_servicer_once():
    document = {"applications": [], "grpc_options": {"grpc_servicer_functions": [GRPC_SERVICER_REGISTRATION]}}
    addresses = resolve_addresses(document, http_port=18000, grpc_port=19000)
    updated = with_addresses(document, addresses)
    assert updated["grpc_options"] == {"grpc_servicer_functions": [GRPC_SERVICER_REGISTRATION], "port": 19000}
    assert updated["http_options"] == {"host": "127.0.0.1", "port": 18000}
    assert document["grpc_options"] == {"grpc_servicer_functions": [GRPC_SERVICER_REGISTRATION]}  # input untouched
    assert with_addresses({"applications": []}, addresses)["grpc_options"]["grpc_servicer_functions"] == [
        GRPC_SERVICER_REGISTRATION
    ]


def test_with_addresses_replaces_the_stubs_registration_with_the_tolerant_one():
    # An older config listing the generated stubs' function gets the tolerant registration
    # (which registers the same service through it) instead of both.
    document = {"applications": [], "grpc_options": {"grpc_servicer_functions": [GRPC_SERVICER_FUNCTION, "x.y.z"]}}
    updated = with_addresses(document, resolve_addresses(document))
    assert updated["grpc_options"]["grpc_servicer_functions"] == [GRPC_SERVICER_REGISTRATION, "x.y.z"]
