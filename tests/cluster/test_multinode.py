"""Placement of a model group on the nodes of a multi-node Ray cluster, and the loss of a node.

The YAML part (no Ray): custom Ray resources per model (``resources.per_model.<name>.resources``)
and for the coordinator (``resources.coordinator_resources``) are validated, reach the frozen
config and the placement-group bundles of a Serve replica, and the defaults are unchanged.

The cluster part runs in a subprocess that owns its own Ray cluster (``ray.cluster_utils.Cluster``
on this machine, in its own Ray temp directory, so the session's shared Ray instance and any other
Ray on the machine are untouched): a head node with ``node_coordinator`` and two worker nodes with
``node_draft`` and ``node_target``, one CPU each. The tiny draft and target (tests/conftest.py)
are pinned to their nodes and the coordinator to the head by the YAML ``args``. The subprocess
checks where every actor runs (directly, and inside a placement group built from the replica's
bundles, the way a Serve replica reserves its group), serves requests, removes the draft's node
while requests run, sends requests while it is gone, adds a node with ``node_draft`` back and
measures how long the group takes to serve again. It writes what it saw as JSON; the test asserts
on it and prints the figures (run with ``-s``).

Run the cluster part alone: ``python -m tests.cluster.test_multinode <target dir> <draft dir> <report.json>``.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from cluster.config import ConfigError, parse_app_args

REPO = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "deploy" / "multinode.example.yaml"

#: Custom resource of each node, by the actor pinned to it.
NODE_RESOURCES = {"coordinator": "node_coordinator", "draft": "node_draft", "target": "node_target"}
#: What each actor asks of its node's resource (the nodes have 1: many groups fit on a node).
PIN = 0.01
#: Bound of the whole cluster run (1 to 4 minutes measured on 2 busy cores: 3 node starts, 6 actors
#: loading torch, one node start and two actor restarts).
SUBPROCESS_TIMEOUT_S = 330.0
#: The group must serve again within this long after the draft's node is back.
RECOVERY_LIMIT_S = 60.0
#: How long a request may take to end (success or error) once the draft's node is removed.
END_LIMIT_S = 60.0
#: How long requests sent while the draft's node is away are watched before the node returns.
OUTAGE_WATCH_S = 15.0
#: How long Ray may take to declare the removed node dead (its GCS health checks: 3 s period,
#: 5 failures, 10 s timeout by default).
DETECTION_LIMIT_S = 60.0
LONG_TOKENS = 200  # tiny context is 256; long enough to be mid-flight when the node goes


def placement_args(target: str, draft: str) -> dict:
    """specserve ``args`` for the tiny target and draft, each pinned to its node."""
    return {
        "models": {"target": {"path": target, "role": "target"}, "draft": {"path": draft, "role": "draft"}},
        "defaults": {"strategy": "sd", "method": "block", "gamma": 4},
        "resources": {
            "cpus_per_model": 0.25,
            "torch_threads": 1,
            "coordinator_resources": {NODE_RESOURCES["coordinator"]: PIN},
            "per_model": {
                "target": {"resources": {NODE_RESOURCES["target"]: PIN}},
                "draft": {"resources": {NODE_RESOURCES["draft"]: PIN}},
            },
        },
        "limits": {"max_concurrent_requests": 16, "session_idle_timeout_s": 120},
    }


# ---------------------------------------------------------------------------- the YAML (no Ray)


def test_custom_resources_reach_the_model_specs_and_the_replica_bundles():
    from cluster.serving.ingress import INGRESS_CPUS, MODEL_BUNDLE_OFFSET, replica_bundles
    from cluster.serving.bringup import coordinator_bundle_index, model_group_bundles

    args = placement_args("/m/target", "/m/draft")
    args["resources"]["coordinator_cpus"] = 0.5
    config = parse_app_args(args).freeze()
    assert config.model("draft").resources == {"node_draft": PIN}
    assert config.model("target").resources == {"node_target": PIN}
    assert config.coordinator_resources == {"node_coordinator": PIN}
    bundles = replica_bundles(config)
    assert bundles == [
        {"CPU": pytest.approx(INGRESS_CPUS + 0.5)},  # the replica (app.py: it keeps the coordinator's CPUs too)
        {"CPU": 0.25, "node_target": PIN},
        {"CPU": 0.25, "node_draft": PIN},
        {"CPU": 0.5, "node_coordinator": PIN},  # the coordinator's own bundle
    ]
    assert bundles[coordinator_bundle_index(config, MODEL_BUNDLE_OFFSET)] == {"CPU": 0.5, "node_coordinator": PIN}
    assert model_group_bundles(config) == bundles[MODEL_BUNDLE_OFFSET:]


def test_without_custom_resources_nothing_changes():
    from cluster.serving.bringup import coordinator_bundle_index, model_group_bundles

    args = placement_args("/m/target", "/m/draft")
    del args["resources"]["coordinator_resources"], args["resources"]["per_model"]
    config = parse_app_args(args).freeze()
    assert all(model.resources == {} for model in config.models) and config.coordinator_resources == {}
    # placement auto without nodes or GPUs set by hand: the draft shares its target's worker (one bundle)
    assert model_group_bundles(config) == [{"CPU": 0.5}]
    assert coordinator_bundle_index(config, 1) == -1  # any bundle, as before


@pytest.mark.parametrize(
    "resources, named",
    [
        ({"per_model": {"draft": {"resources": {"CPU": 1}}}}, ["resources.per_model.draft.resources", "'CPU'", "cpus"]),
        ({"per_model": {"draft": {"resources": {"GPU": 1}}}}, ["resources.per_model.draft.resources", "'GPU'"]),
        ({"coordinator_resources": {"memory": 1}}, ["resources.coordinator_resources", "'memory'"]),
        ({"coordinator_resources": {"node_x": 0}}, ["resources.coordinator_resources", "'node_x'", ">= 0.0001"]),
        ({"coordinator_resources": {"node_x": -1}}, ["resources.coordinator_resources", "'node_x'"]),
        ({"coordinator_resources": {"node_x": float("inf")}}, ["resources.coordinator_resources", "'node_x'", "inf"]),
        ({"per_model": {"target": {"resources": {"a node": 1}}}}, ["resources.per_model.target.resources", "'a node'"]),
        ({"per_model": {"target": {"resources": {"": 1}}}}, ["resources.per_model.target.resources", "''"]),
        ({"per_model": {"target": {"resources": {"node_t": "many"}}}}, ["resources.per_model.target.resources.node_t", "'many'"]),
        ({"per_model": {"ghost": {"resources": {"node_g": 1}}}}, ["resources.per_model", "ghost"]),
        ({"coordinator_resource": {"node_c": 1}}, ["resources.coordinator_resource"]),
    ],
)
def test_bad_placement_is_refused_naming_the_key(resources, named):
    args = placement_args("/m/target", "/m/draft")
    args["resources"] = {"cpus_per_model": 0.25, **resources}
    with pytest.raises(ConfigError) as caught:
        parse_app_args(args)
    for text in named:
        assert text in str(caught.value), str(caught.value)


def test_placement_fields_are_described():
    from cluster.config import ModelResourceArgs, ResourcesArgs

    assert "custom ray resources" in ModelResourceArgs.model_fields["resources"].description.lower()
    assert "custom ray resources" in ResourcesArgs.model_fields["coordinator_resources"].description.lower()


def test_the_multinode_example_pins_draft_target_and_coordinator_to_their_nodes():
    from cluster.serving.ingress import replica_bundles
    from cluster.config import load_app_args

    args = load_app_args(EXAMPLE)
    config = args.freeze()
    assert config.model("draft").resources == {"node_draft": PIN}
    assert config.model("target").resources == {"node_target": PIN}
    assert config.coordinator_resources == {"node_coordinator": PIN}
    bundles = replica_bundles(config)
    assert [set(bundle) - {"CPU", "GPU"} for bundle in bundles] == [set(), {"node_target"}, {"node_draft"}, {"node_coordinator"}]


# ---------------------------------------------------------------------------- the cluster (subprocess)


def test_group_placed_on_three_nodes_serves_and_recovers_when_the_drafts_node_is_replaced(tiny_checkpoints, tmp_path):
    report_path = tmp_path / "multinode.json"
    # Ray's session files and its "current cluster" address file go under RAY_TMPDIR: a private,
    # short directory (unix socket paths are limited to ~100 characters).
    ray_tmp = tempfile.mkdtemp(prefix="ssmn-", dir="/tmp")
    env = {key: value for key, value in os.environ.items() if key not in ("RAY_ADDRESS", "TMPDIR")}
    env.update(RAY_TMPDIR=ray_tmp, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    command = [sys.executable, "-m", "tests.cluster.test_multinode",
               str(tiny_checkpoints["target"]), str(tiny_checkpoints["draft"]), str(report_path)]
    started = time.monotonic()
    # Its own session: on a timeout the whole process group (driver, raylets, workers) is killed.
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=SUBPROCESS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"the multi-node run took over {SUBPROCESS_TIMEOUT_S:.0f} s:\n{output[-6000:]}")
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    elapsed = time.monotonic() - started
    assert process.returncode == 0, output[-6000:]
    report = json.loads(report_path.read_text())
    print(f"\nmulti-node run: {elapsed:.1f} s in all")
    print("\n".join(line[:240] for line in output.splitlines() if line.startswith("[multinode")))
    print(json.dumps(report["figures"], indent=2))

    # Placement: each actor on the node holding its resource, directly and in a replica's placement group.
    assert report["placement"]["bundles"] == {"1": "target", "2": "draft", "3": "coordinator"}
    for variant in ("direct", "placement_group"):
        assert report["placement"][variant] == {"coordinator": "coordinator", "draft": "draft", "target": "target"}, variant
        assert report["served"][variant]["errors"] == [], variant
        # Requests running when the draft's node went away: each ended, successfully or retryably.
        in_flight = report["in_flight"][variant]
        assert in_flight["hung"] == [] and in_flight["other_errors"] == [], (variant, in_flight)
        assert len(in_flight["ok"]) + len(in_flight["retryable"]) == in_flight["sent"], (variant, in_flight)
        assert any(name.startswith("sd") for name in in_flight["retryable"]), (variant, "no sd request was in flight")
        # Requests sent while it was away: none ended with a non-retryable error, none is left once it is back.
        outage = report["outage"][variant]
        assert outage["other_errors"] == [] and outage["unfinished_after_recovery"] == 0, (variant, outage)
        # The draft restarted on the new node and the group serves the same greedy tokens again.
        recovery = report["recovery"][variant]
        assert recovery["draft_node"] == "new_draft_node", (variant, recovery)
        assert recovery["served_again_s"] is not None and recovery["served_again_s"] < RECOVERY_LIMIT_S, (variant, recovery)
        assert recovery["same_greedy_tokens"], variant
    assert report["recovery"]["bundles"]["2"] == "new_draft_node"  # the draft's bundle moved with it


# ---------------------------------------------------------------------------- the subprocess


def _log(message: str) -> None:
    print(f"[multinode {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _request(index: int, max_tokens: int, strategy: str = "sd"):
    from actors.request_schema import GenerationRequest

    speculation = {"strategy": strategy} if strategy != "sd" else {}
    return GenerationRequest(
        request_id=f"mn-{index}",
        prompt=f"def function_{index}(x):\n    ",
        sampling={"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
        speculation=speculation,
    )


def _outcome(chunks) -> tuple[str, str | None]:
    final = chunks[-1]
    if final.error is None:
        return "ok", None
    return ("retryable" if final.retryable else "error"), final.error


def _tokens(chunks) -> list[int]:
    return [token for chunk in chunks for token in chunk.token_ids]


def _actor_node(handle) -> str:
    import ray

    return ray._private.state.actors(handle._actor_id.hex())["Address"]["NodeID"]


def _settle(refs: dict, limit_s: float) -> dict[str, dict]:
    """Wait up to ``limit_s`` for every ref; name -> {outcome, error, seconds} (outcome 'pending'
    for those that had not ended)."""
    import ray

    started = time.monotonic()
    results: dict[str, dict] = {}
    remaining = dict(refs)
    while remaining and time.monotonic() - started < limit_s:
        ready, _ = ray.wait(list(remaining.values()), num_returns=1, timeout=max(0.0, limit_s - (time.monotonic() - started)))
        for ref in ready:
            name = next(name for name, r in remaining.items() if r == ref)
            del remaining[name]
            try:
                outcome, error = _outcome(ray.get(ref))
            except Exception as exc:  # noqa: BLE001 - the coordinator itself failed: recorded as an error
                outcome, error = "error", f"{type(exc).__name__}: {exc}"
            results[name] = {"outcome": outcome, "error": error, "seconds": round(time.monotonic() - started, 2)}
    for name in remaining:
        results[name] = {"outcome": "pending", "error": None, "seconds": None}
    return results


def _actor_state(handle) -> str:
    import ray

    return ray._private.state.actors(handle._actor_id.hex())["State"]


def _outage_requests(groups: dict, when: str) -> dict:
    refs = {}
    for variant, group in groups.items():
        refs[f"{variant}/{when}-sd"] = group.coordinator.generate_all.remote(_request(300, 16))
        refs[f"{variant}/{when}-ar"] = group.coordinator.generate_all.remote(_request(301, 16, "ar"))
        refs[f"{variant}/{when}-health"] = group.coordinator.health.remote()
    return refs


def _serve_check(group, count: int, max_tokens: int) -> dict:
    import ray

    chunks = ray.get([group.coordinator.generate_all.remote(_request(i, max_tokens)) for i in range(count)], timeout=120)
    return {"errors": [c[-1].error for c in chunks if c[-1].error is not None],
            "tokens": [len(_tokens(c)) for c in chunks], "greedy_0": _tokens(chunks[0])}


def _wait_until_served(group, since: float, reference: list[int], limit_s: float) -> dict:
    """Send one greedy request after another until one succeeds (or ``limit_s`` passes)."""
    import ray

    attempts = []
    while time.monotonic() - since < limit_s:
        try:
            (chunks,) = ray.get([group.coordinator.generate_all.remote(_request(0, 24))], timeout=30)
            outcome, error = _outcome(chunks)
        except ray.exceptions.GetTimeoutError:
            outcome, error, chunks = "timeout", None, None
        except ray.exceptions.RayError as exc:  # the coordinator itself failed
            outcome, error, chunks = "error", f"{type(exc).__name__}: {exc}", None
        attempts.append({"at_s": round(time.monotonic() - since, 2), "outcome": outcome, "error": error})
        if outcome == "ok":
            return {"attempts": attempts, "served_again_s": round(time.monotonic() - since, 2),
                    "same_greedy_tokens": _tokens(chunks) == reference}
        if outcome not in ("retryable", "timeout"):
            break
        time.sleep(0.5)
    return {"attempts": attempts, "served_again_s": None, "same_greedy_tokens": False}


def _sessions_once_released(group, within_s: float) -> dict[str, int]:
    """Open sessions per worker, polled until none is left or ``within_s`` has passed."""
    import ray

    models = list(group.workers)
    deadline = time.monotonic() + within_s
    while True:
        counts = dict(zip(models, ray.get([group.workers[name].num_sessions.remote() for name in models], timeout=30)))
        if not any(counts.values()) or time.monotonic() > deadline:
            return counts
        time.sleep(0.2)


def run_cluster(target: str, draft: str) -> dict:
    """Both ways of placing a group at once, on one cluster: ``direct`` (the actors' own
    ``resources=`` options, as ``specserve generate`` starts a group) and ``placement_group``
    (inside a placement group built from a Serve replica's bundles, as each replica does)."""
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.placement_group import placement_group, placement_group_table

    from cluster.serving.ingress import MODEL_BUNDLE_OFFSET, replica_bundles
    from cluster.serving.bringup import as_group_config, start_model_group

    report: dict = {"placement": {}, "served": {}, "in_flight": {}, "outage": {}, "recovery": {}, "figures": {}}
    figures = report["figures"]
    started = time.monotonic()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {NODE_RESOURCES["coordinator"]: 1}, "include_dashboard": False})
    nodes = {"coordinator": cluster.head_node}
    nodes["draft"] = cluster.add_node(num_cpus=1, resources={NODE_RESOURCES["draft"]: 1})
    nodes["target"] = cluster.add_node(num_cpus=1, resources={NODE_RESOURCES["target"]: 1})
    cluster.wait_for_nodes()
    names = {node.node_id: name for name, node in nodes.items()}
    figures["cluster_start_s"] = round(time.monotonic() - started, 1)
    _log(f"cluster of 3 nodes up in {figures['cluster_start_s']} s")
    ray.init(address=cluster.address, log_to_driver=os.environ.get("SPECSERVE_MULTINODE_LOGS") == "1",
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                                       "TOKENIZERS_PARALLELISM": "false"}})
    config = as_group_config(placement_args(target, draft))
    groups: dict = {}
    try:
        # 1. Start both groups (their actors load at the same time) and check where everything runs.
        t0 = time.monotonic()
        pg = placement_group(replica_bundles(config), strategy="PACK")
        ray.get(pg.ready(), timeout=60)
        bundle_nodes = placement_group_table(pg)["bundles_to_node_id"]
        report["placement"]["bundles"] = {str(i): names[node] for i, node in bundle_nodes.items() if i >= MODEL_BUNDLE_OFFSET}
        groups["direct"] = start_model_group(config, wait=False)
        groups["placement_group"] = start_model_group(config, placement_group=pg, first_bundle=MODEL_BUNDLE_OFFSET, wait=False)
        references = {}
        for variant, group in groups.items():
            infos = ray.get([worker.info.remote() for worker in group.workers.values()], timeout=150)
            report["placement"][variant] = {
                **{info.name: names[info.node_id] for info in infos}, "coordinator": names[_actor_node(group.coordinator)]}
        figures["groups_start_s"] = round(time.monotonic() - t0, 1)
        for variant, group in groups.items():
            served = _serve_check(group, 4, 24)
            report["served"][variant] = served
            references[variant] = served["greedy_0"]
        _log(f"placement {report['placement']}, served {report['served']}")

        # 2. Remove the draft's node while requests run (sd needs the draft; ar only the target).
        sent = {f"{variant}/sd-{i}": (variant, _request(100 + i, LONG_TOKENS)) for variant in groups for i in range(4)}
        sent.update({f"{variant}/ar-{i}": (variant, _request(200 + i, LONG_TOKENS, "ar")) for variant in groups for i in range(2)})
        refs = {name: groups[variant].coordinator.generate_all.remote(request) for name, (variant, request) in sent.items()}
        time.sleep(1.0)
        removed_at = time.monotonic()
        cluster.remove_node(nodes["draft"], allow_graceful=False)
        figures["remove_node_call_s"] = round(time.monotonic() - removed_at, 2)
        results = _settle(refs, END_LIMIT_S)
        for variant in groups:
            mine = {name.split("/", 1)[1]: r for name, r in results.items() if name.startswith(variant + "/")}
            ended = [r["seconds"] for r in mine.values() if r["seconds"] is not None]
            report["in_flight"][variant] = {
                "sent": len(mine),
                "ok": sorted(name for name, r in mine.items() if r["outcome"] == "ok"),
                "retryable": sorted(name for name, r in mine.items() if r["outcome"] == "retryable"),
                "hung": sorted(name for name, r in mine.items() if r["outcome"] == "pending"),
                "other_errors": [r["error"] for r in mine.values() if r["outcome"] == "error"],
                "all_ended_after_removal_s": round(max(ended) + figures["remove_node_call_s"], 2) if ended else None,
                "errors": sorted({r["error"] for r in mine.values() if r["error"]}),
            }
        _log(f"in flight when the draft's node went: {report['in_flight']}")

        # 3. While the node is away: new requests and the coordinators' health checks, first right
        #    away, then once Ray has declared the node dead (the drafts then wait to be restarted).
        outage_refs = _outage_requests(groups, "early")
        outage = _settle(outage_refs, OUTAGE_WATCH_S)
        draft_states = {variant: _actor_state(group.workers["draft"]) for variant, group in groups.items()}
        while time.monotonic() - removed_at < DETECTION_LIMIT_S and not all(
                state == "RESTARTING" for state in draft_states.values()):
            time.sleep(0.5)
            draft_states = {variant: _actor_state(group.workers["draft"]) for variant, group in groups.items()}
        figures["node_death_seen_after_s"] = round(time.monotonic() - removed_at, 1)
        late_refs = _outage_requests(groups, "late")
        outage.update(_settle(late_refs, OUTAGE_WATCH_S))
        outage_refs.update(late_refs)
        for variant in groups:
            report["outage"][variant] = {
                "during": {name.split("/", 1)[1]: r for name, r in outage.items() if name.startswith(variant + "/")},
                "draft_state": draft_states[variant],
            }
        report["outage"]["placement_group_state"] = placement_group_table(pg)["state"]
        _log(f"while the draft's node is away: {report['outage']}")

        # 4. A node with node_draft joins: Ray restarts each draft there (max_restarts=-1; in the
        #    placement group once the draft's bundle is rescheduled onto it).
        added_at = time.monotonic()
        nodes["new_draft"] = cluster.add_node(num_cpus=1, resources={NODE_RESOURCES["draft"]: 1})
        names[nodes["new_draft"].node_id] = "new_draft_node"
        node_up = time.monotonic()
        figures["add_node_call_s"] = round(node_up - added_at, 2)
        restarted: dict[str, float] = {}
        while len(restarted) < len(groups) and time.monotonic() - node_up < RECOVERY_LIMIT_S + 30:
            for variant, group in groups.items():
                if variant not in restarted and _actor_state(group.workers["draft"]) == "ALIVE":
                    restarted[variant] = round(time.monotonic() - node_up, 2)
            time.sleep(0.25)
        for variant, group in groups.items():
            recovery = _wait_until_served(group, node_up, references[variant], RECOVERY_LIMIT_S + 30)
            recovery["draft_alive_after_node_up_s"] = restarted.get(variant)
            draft_info = ray.get(group.workers["draft"].info.remote(), timeout=30)
            recovery["draft_node"] = names.get(draft_info.node_id, draft_info.node_id)
            if recovery["served_again_s"] is not None:
                recovery["served_again_after_removal_s"] = round(node_up + recovery["served_again_s"] - removed_at, 2)
            report["recovery"][variant] = recovery
        bundle_nodes = placement_group_table(pg)["bundles_to_node_id"]
        report["recovery"]["bundles"] = {str(i): names.get(node, node) for i, node in bundle_nodes.items()
                                         if i >= MODEL_BUNDLE_OFFSET}
        _log(f"recovery: {report['recovery']}")
        # How the requests sent during the outage ended.
        pending = {name: ref for name, ref in outage_refs.items() if outage[name]["outcome"] == "pending"}
        final = {**outage, **_settle(pending, 30)}
        for variant in groups:
            mine = {name.split("/", 1)[1]: r for name, r in final.items() if name.startswith(variant + "/")}
            report["outage"][variant]["final"] = {name: r["outcome"] for name, r in mine.items()}
            report["outage"][variant]["other_errors"] = [
                r["error"] for name, r in mine.items() if not name.endswith("health") and r["outcome"] == "error"]
            report["outage"][variant]["unfinished_after_recovery"] = sum(r["outcome"] == "pending" for r in mine.values())
        # Sessions still open in the workers once every request has ended (they should all be
        # released at the coordinator's next idle flush; what remains waits for the idle timeout).
        for variant, group in groups.items():
            report["recovery"][variant]["sessions_left"] = _sessions_once_released(group, within_s=10.0)
        for variant in groups:
            figures[variant] = {
                "in_flight": {key: len(report["in_flight"][variant][key]) for key in ("ok", "retryable", "hung")},
                "in_flight_all_ended_after_removal_s": report["in_flight"][variant]["all_ended_after_removal_s"],
                "while_away": {name: r["outcome"] for name, r in report["outage"][variant]["during"].items()},
                "draft_state_while_away": report["outage"][variant]["draft_state"],
                "draft_alive_after_node_up_s": report["recovery"][variant]["draft_alive_after_node_up_s"],
                "served_again_after_node_up_s": report["recovery"][variant]["served_again_s"],
                "served_again_after_removal_s": report["recovery"][variant].get("served_again_after_removal_s"),
                "sessions_left": report["recovery"][variant]["sessions_left"],
            }
        figures["placement_group_state_while_away"] = report["outage"]["placement_group_state"]
        figures["total_s"] = round(time.monotonic() - started, 1)
    finally:
        t0 = time.monotonic()
        for group in groups.values():
            try:
                group.shutdown()
            except Exception as error:  # noqa: BLE001 - tearing down a cluster that may be half gone
                _log(f"shutdown: {error}")
        ray.shutdown()
        for node in list(cluster.worker_nodes):
            cluster.remove_node(node, allow_graceful=False)
        cluster.shutdown()
        _log(f"cluster shut down in {time.monotonic() - t0:.1f} s")
    return report


def main(argv: list[str]) -> int:
    target, draft, report_path = argv
    report = run_cluster(target, draft)
    pathlib.Path(report_path).write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
