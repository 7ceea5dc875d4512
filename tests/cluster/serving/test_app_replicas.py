"""Scaling: a deployment with ``num_replicas: 2`` runs two complete model groups, each owned by
its replica and reserved in that replica's placement group.

The second application is added to the session's Serve config and removed again at the end
(the config is applied declaratively, as `serve deploy` would)."""

from __future__ import annotations

import httpx
import pytest
import ray

from cluster.serving.ingress import INGRESS_CPUS
from cluster.serving.serve_command import deploy

from tests.cluster.conftest import serve_document, specserve_application

APP = "specserve-two"


@pytest.fixture(scope="module")
def two_replica_app(serve_app, tiny_checkpoints):
    args = {
        "models": {
            "target": {"path": str(tiny_checkpoints["target"]), "role": "target"},
            "draft": {"path": str(tiny_checkpoints["draft"]), "role": "draft"},
        },
        "defaults": {"strategy": "sd", "method": "token", "gamma": 3},
        "resources": {"cpus_per_model": 0.25, "torch_threads": 1},
    }
    both = serve_document(serve_app.document["applications"] + [specserve_application(APP, "/two", args, num_replicas=2)])
    both.update({key: serve_app.document[key] for key in ("http_options", "grpc_options")})
    deploy("<two replicas>", serve_app.addresses, both)
    yield f"{serve_app.http_url}/two"
    deploy("<session app only>", serve_app.addresses, serve_app.document)  # deletes specserve-two


def test_two_replicas_each_own_their_model_actors(two_replica_app):
    statuses = {}
    with httpx.Client(base_url=two_replica_app, timeout=60) as http:
        for _ in range(60):
            status = http.get("/v1/status").json()
            statuses[status["replica"]] = status
            if len(statuses) == 2:
                break
    assert len(statuses) == 2, "requests should reach both replicas"
    first, second = statuses.values()
    assert first["coordinator"] != second["coordinator"]
    assert set(first["workers"]) == set(second["workers"]) == {"target", "draft"}
    assert not set(first["workers"].values()) & set(second["workers"].values())

    actors = ray._private.state.actors()  # GCS actor table (no dashboard needed)
    pg_table = ray.util.placement_group_table()
    for status in statuses.values():
        replica_port = actors[status["replica_actor"]]["Address"]["Port"]
        for actor_id in [status["coordinator"], *status["workers"].values()]:
            assert actors[actor_id]["State"] == "ALIVE"
            assert actors[actor_id]["OwnerAddress"]["Port"] == replica_port  # created (owned) by this replica
        group = pg_table[status["placement_group"]]
        assert group["state"] == "CREATED" and group["strategy"] == "PACK"
        # placement auto on CPU: the draft shares its target's worker, one bundle of both models' CPUs
        assert [bundle.get("CPU") for bundle in group["bundles"].values()] == [INGRESS_CPUS, 0.5]
    assert first["placement_group"] != second["placement_group"]


def test_both_replicas_serve_requests(two_replica_app, greedy_reference):
    prompt_ids = greedy_reference.encode("for name in ")
    expected = greedy_reference.continuation(prompt_ids, 6)
    body = {"prompt": prompt_ids, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    with httpx.Client(base_url=two_replica_app, timeout=120) as http:
        results = [http.post("/v1/completions", json=body).json() for _ in range(4)]
    assert all(result["choices"][0]["token_ids"] == expected for result in results)
    assert all(result["model"] == APP for result in results)


def test_a_scrape_on_either_replica_covers_both(two_replica_app):
    """GET /metrics answered by either replica shows both replicas' model groups."""
    from prometheus_client.parser import text_string_to_metric_families

    from cluster.serving.ingress import REPLICA_HEADER

    with httpx.Client(base_url=two_replica_app, timeout=60) as http:
        replicas = set()
        for _ in range(60):
            replicas.add(http.get("/v1/status").json()["replica"])
            if len(replicas) == 2:
                break
        answered = set()
        for _ in range(60):
            response = http.get("/metrics")
            assert response.status_code == 200
            answered.add(response.headers[REPLICA_HEADER])
            samples = [s for family in text_string_to_metric_families(response.text) for s in family.samples]
            running = {s.labels["replica"] for s in samples if s.name == "specserve_num_requests_running"}
            assert running == replicas
            workers = {(s.labels["replica"], s.labels["worker"]) for s in samples
                       if s.name == "specserve_worker_forward_seconds_total"}
            assert workers == {(replica, worker) for replica in replicas for worker in ("target", "draft")}
            scraped = {s.labels["state"]: s.value for s in samples if s.name == "specserve_scrape_coordinators"}
            assert scraped == {"ok": 2, "failed": 0}
            assert all(s.labels["model_group"] == APP for s in samples if "model_group" in s.labels)
            if len(answered) == 2:
                break
    assert answered == replicas, "scrapes should reach both replicas"
