"""``resources.cpu_affinity`` (cluster/serving/cpu_affinity.py, cluster/serving/serve_command.py): the setting's
validation, the rule that decides each process's cores, and what ``specserve serve`` binds
before it starts Ray."""

from __future__ import annotations

import copy
import pathlib

import pytest

from cluster.config import ConfigError, parse_app_args, read_serve_config
from cluster.serving.cpu_affinity import (
    CPU_CORES_ENV, cores_from_env, describe_plan, plan_cpu_affinity, reserved_core_count, serving_cores,
    target_worker_cores,
)
from cluster.serving.serve_command import serving_binding

ROLES = {"target": "target", "draft": "draft", "partner": "member", "partner2": "member"}
CO_LOCATED = [["target", "draft"], ["partner"], ["partner2"]]
DEFAULT_YAML = pathlib.Path(__file__).resolve().parents[3] / "deploy" / "default.yaml"
MODELS = {name: {"path": f"embedded:{name}", "role": role} for name, role in ROLES.items()}


def _args(**resources):
    return parse_app_args({"models": MODELS, "resources": resources}, "app.args")


def test_the_setting_defaults_to_off_and_takes_auto_or_core_lists():
    assert _args().resources.cpu_affinity == "off"
    assert _args(cpu_affinity="auto").resources.cpu_affinity == "auto"
    assert _args(cpu_affinity="spare").resources.cpu_affinity == "spare"
    assert _args(cpu_affinity=False).resources.cpu_affinity == "off"  # YAML's unquoted off
    assert _args(cpu_affinity={"target": [1], "partner": [0]}).resources.cpu_affinity == {"target": [1], "partner": [0]}


@pytest.mark.parametrize("value,named", [
    ({"target": [-1]}, "cpu_affinity"),
    ({"target": []}, "at least one core"),
    ({"target": [1, 1]}, "core 1 is listed twice"),
    ({"nobody": [0]}, "resources.cpu_affinity: unknown models ['nobody']"),
    ("on", "cpu_affinity"),
])
def test_a_bad_setting_is_refused_naming_it(value, named):
    with pytest.raises(ConfigError, match="cpu_affinity") as error:
        _args(cpu_affinity=value)
    assert named in str(error.value)


def test_auto_gives_the_targets_worker_the_last_cores_the_other_workers_any_and_the_rest_the_others():
    plan = plan_cpu_affinity("auto", CO_LOCATED, ROLES, [0, 0, 0], 1, (0, 1))
    assert plan.workers == ((1,), (0, 1), (0, 1)) and plan.serving == (0,)
    assert "worker 0 [target, draft] cores [1]; worker 1 [partner] cores [0, 1]" in describe_plan(plan, CO_LOCATED)
    # more threads, more cores: torch_threads cores of its own, the target's worker found wherever it is
    plan = plan_cpu_affinity("auto", [["partner"], ["target", "draft"]], ROLES, [0, 0], 2, (0, 1, 2, 3))
    assert plan.workers == ((0, 1, 2, 3), (2, 3)) and plan.serving == (0, 1)


def test_spare_keeps_the_serving_processes_off_the_targets_cores_and_binds_no_worker_to_fewer_cores():
    plan = plan_cpu_affinity("spare", CO_LOCATED, ROLES, [0, 0, 0], 1, (0, 1))
    # every worker on every core: that undoes the serving processes' binding it inherits
    assert plan.workers == ((0, 1), (0, 1), (0, 1)) and plan.serving == (0,)
    assert "cores [1] spared for the target's worker" in describe_plan(plan, CO_LOCATED)
    assert serving_cores("spare", 2, (0, 1, 2, 3), gpu_host=False) == (0, 1)
    assert plan_cpu_affinity("spare", CO_LOCATED, ROLES, [0, 0, 0], 1, None).workers == (None, None, None)
    assert "GPU workers" in plan_cpu_affinity("spare", CO_LOCATED, ROLES, [1, 0, 0], 1, (0, 1, 2, 3)).rule


@pytest.mark.parametrize("cores,gpus,threads,why", [
    (None, [0, 0, 0], 1, "not started by `specserve serve`"),
    ((0,), [0, 0, 0], 1, "1 cores, none to spare"),
    ((0, 1), [0, 0, 0], 2, "none to spare beyond torch_threads 2"),
    ((0, 1, 2, 3), [1, 0, 0], 1, "GPU workers"),
])
def test_auto_binds_nothing_without_a_spare_core_on_gpus_or_outside_specserve_serve(cores, gpus, threads, why):
    plan = plan_cpu_affinity("auto", CO_LOCATED, ROLES, gpus, threads, cores)
    assert plan.workers == (None, None, None) and plan.serving is None and why in plan.rule


def test_off_binds_nothing_and_core_lists_bind_the_workers_of_their_models_gpus_included():
    assert plan_cpu_affinity("off", CO_LOCATED, ROLES, [0, 0, 0], 1, (0, 1)).workers == (None, None, None)
    plan = plan_cpu_affinity({"draft": [3], "target": [2], "partner": [1]}, CO_LOCATED, ROLES, [1, 0, 0], 1, (0, 1, 2, 3))
    assert plan.workers == ((2, 3), (1,), None) and plan.serving == (0,)
    assert plan_cpu_affinity({"target": [1]}, CO_LOCATED, ROLES, [0, 0, 0], 1, None).serving is None


def test_torch_threads_auto_reserves_one_core_for_the_targets_worker():
    """Under ``auto`` the worker's thread count follows its mask: the rule gives it one core of its own."""
    assert (reserved_core_count("auto"), reserved_core_count(3)) == (1, 3)
    assert target_worker_cores((0, 1, 2, 3), "auto") == (3,)
    assert plan_cpu_affinity("auto", CO_LOCATED, ROLES, [0, 0, 0], "auto", (0, 1)).workers == ((1,), (0, 1), (0, 1))
    assert serving_cores("spare", "auto", (0, 1), gpu_host=False) == (0,)


def test_serving_cores_and_the_recorded_host_cores():
    assert target_worker_cores((3, 0, 2, 1), 1) == (3,)
    assert serving_cores("auto", 1, (0, 1), gpu_host=False) == (0,)
    assert serving_cores("auto", 1, (0, 1), gpu_host=True) is None
    assert serving_cores({"target": [0, 1]}, 1, (0, 1), gpu_host=False) is None  # nothing left to them
    assert cores_from_env({CPU_CORES_ENV: "1,0"}) == (0, 1)
    assert cores_from_env({}) is None and cores_from_env({CPU_CORES_ENV: "x"}) is None


def test_specserve_serve_binds_the_serving_processes_off_the_workers_cores():
    document = read_serve_config(str(DEFAULT_YAML))
    assert serving_binding(document, (0, 1), gpu_host=False)[0] is None  # the default deployment: off
    document["applications"][0]["args"]["resources"]["cpu_affinity"] = "auto"
    assert serving_binding(document, (0, 1), gpu_host=False)[0] == (0,)
    assert serving_binding(document, (0,), gpu_host=False)[0] is None
    assert serving_binding(document, (0, 1), gpu_host=True)[0] is None
    document["applications"][0]["args"]["resources"]["cpu_affinity"] = "spare"
    assert serving_binding(document, (0, 1), gpu_host=False)[0] == (0,)
    several = copy.deepcopy(document)
    several["applications"][0]["deployments"][0]["num_replicas"] = 2
    serving, why = serving_binding(several, (0, 1), gpu_host=False)
    assert serving is None and "several model groups" in why
    listed = copy.deepcopy(several)
    listed["applications"][0]["args"]["resources"]["cpu_affinity"] = {"target": [3], "partner": [2]}
    assert serving_binding(listed, (0, 1, 2, 3), gpu_host=True)[0] == (0, 1)
