"""Which models share a worker (cluster/config/placement.py, cluster/serving/bringup.py): the auto rule for 0 to 4
GPUs, explicit placements, the refusal of a group that needs more GPUs than the cluster has, the
bundles, and the deploy/ examples' placements (one GPU: target and draft in one worker; two GPUs:
a worker each), all resolved without a GPU."""

from __future__ import annotations

import pathlib

import pytest

from cluster.config.placement import check_cluster_gpus, describe_placement, resolve_placement
from cluster.serving.bringup import model_group_bundles
from cluster.config import ConfigError, load_app_args, parse_app_args, read_serve_config
from cluster.config.placement import auto_workers

REPO = pathlib.Path(__file__).resolve().parents[3]
FOUR = [("target", "target"), ("draft", "draft"), ("partner", "member"), ("partner2", "member")]


@pytest.mark.parametrize("gpus,workers", [
    (0, [["target", "draft"], ["partner"], ["partner2"]]),
    (1, [["target", "draft", "partner", "partner2"]]),
    (2, [["target", "draft", "partner2"], ["partner"]]),
    (3, [["target", "draft"], ["partner"], ["partner2"]]),
    (4, [["target"], ["draft"], ["partner"], ["partner2"]]),
    (8, [["target"], ["draft"], ["partner"], ["partner2"]]),
])
def test_the_auto_rule(gpus, workers):
    assert auto_workers(FOUR, gpus) == workers


def test_the_auto_rule_without_a_draft_or_a_target():
    assert auto_workers([("a", "member"), ("b", "member")], 0) == [["a"], ["b"]]
    assert auto_workers([("d", "draft"), ("m", "member")], 1) == [["d", "m"]]


def _args(**resources):
    return parse_app_args({
        "models": {name: {"path": f"embedded:{name}", "role": role} for name, role in FOUR},
        "defaults": {"strategy": "sd", "members": ["target", "partner"]},
        "resources": resources,
    })


def test_default_yaml_resolves_by_the_gpus_and_prints_its_rule():
    config = load_app_args(REPO / "deploy/default.yaml").freeze()
    on_cpu = resolve_placement(config, gpus=0)
    assert on_cpu.workers[0] == ("target", "draft") and not on_cpu.uses_overlap
    assert "draft shares its target's worker" in describe_placement(on_cpu)
    one = resolve_placement(config, gpus=1)
    assert one.workers == (("target", "draft", "partner", "partner2"),)
    assert model_group_bundles(one) == [{"CPU": 1.0, "GPU": 1.0}]
    four = resolve_placement(config, gpus=4)
    assert four.workers == (("target",), ("draft",), ("partner",), ("partner2",)) and four.uses_overlap
    check_cluster_gpus(one, gpus=1)
    check_cluster_gpus(four, gpus=4)


def test_a_group_that_needs_more_gpus_than_the_cluster_has_is_refused_with_the_numbers():
    config = resolve_placement(_args(gpus_per_model=1).freeze(), gpus=2)
    assert len(config.workers) == 4  # GPUs set by hand: a worker each
    with pytest.raises(ConfigError, match=r"needs 4 GPUs .* the Ray cluster has 2; set resources.gpus_per_model: auto"):
        check_cluster_gpus(config, gpus=2)


def test_explicit_placement_and_its_validation():
    config = resolve_placement(_args(placement={"target": 1, "draft": 1, "partner": 0, "partner2": 2}).freeze(),
                               gpus=3)
    assert config.workers == (("partner",), ("target", "draft"), ("partner2",))
    assert model_group_bundles(config) == [{"CPU": 0.25, "GPU": 1.0}, {"CPU": 0.5, "GPU": 1.0},
                                           {"CPU": 0.25, "GPU": 1.0}]
    assert resolve_placement(_args(placement="separate").freeze(), gpus=0).workers == tuple((n,) for n, _ in FOUR)
    with pytest.raises(ConfigError, match=r"unknown models \['nope'\], models without one \['partner2'\]"):
        _args(placement={"target": 0, "draft": 0, "partner": 1, "nope": 1})
    with pytest.raises(ConfigError, match="placement"):
        _args(placement={"target": -1, "draft": 0, "partner": 1, "partner2": 1})


@pytest.mark.parametrize("name,workers,gpus", [
    ("one-gpu.example.yaml", (("target", "draft"),), [1.0]),
    ("two-gpu.example.yaml", (("target",), ("draft",)), [1.0, 1.0]),
])
def test_the_gpu_examples_resolve_to_their_placements(name, workers, gpus):
    config = resolve_placement(load_app_args(REPO / "deploy" / name).freeze(), gpus=len(gpus))
    assert config.workers == workers
    assert [bundle["GPU"] for bundle in model_group_bundles(config)] == gpus
    check_cluster_gpus(config, gpus=len(gpus))
    assert config.uses_overlap == (len(workers) == 2)
    if len(workers) == 1:
        with pytest.raises(ConfigError, match="needs 1 GPUs"):
            check_cluster_gpus(config, gpus=0)


def test_every_deploy_file_resolves_to_workers_it_can_start():
    """The multi-node example pins models to nodes (a worker each), the simulated devices are a device
    each; every file's workers fit a cluster of its models' count of GPUs, and the CPU ones need none."""
    placements = {}
    for path in sorted((REPO / "deploy").glob("*.yaml")):
        for app in read_serve_config(path)["applications"]:
            config = resolve_placement(load_app_args(path, app["name"]).freeze(), gpus=0)
            placements[path.name] = config.workers
            if "gpu" not in path.name or "simulated" in path.name:
                check_cluster_gpus(config, gpus=0)
    assert placements["multinode.example.yaml"] == (("target",), ("draft",))
    assert all(len(models) == 1 for models in placements["simulated-gpu.yaml"])
    assert placements["default.yaml"][0] == ("target", "draft")


def test_serve_prints_each_applications_placement_and_refuses_missing_gpus():
    """What `specserve serve` prints before it deploys, and its refusal (exit 2) when a group asks
    for GPUs this machine's cluster does not have (no GPU here, Ray up or not)."""
    from cluster.serving.serve_command import placement_lines

    document = read_serve_config(REPO / "deploy/default.yaml")
    (line,) = placement_lines(document)
    assert line.startswith("placement of specserve: worker 0 [target, draft] CPU; worker 1 [partner] CPU")
    document["applications"][0]["args"]["resources"]["gpus_per_model"] = 1
    with pytest.raises(ConfigError, match=r"application 'specserve': resources: the model group needs 4 GPUs"):
        placement_lines(document)
