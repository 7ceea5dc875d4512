"""cluster.serving.bringup with logical GPUs: every model worker gets its own GPU (explicitly, with
``gpus_per_model: auto``, and inside a placement group). It needs a Ray instance with GPUs, so it runs in a subprocess with its own
Ray (the shared session instance is untouched). The workers are the deterministic fake
workers of tests/actors/fake_models.py (loading real weights adds nothing to placement)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[3]

SCRIPT = r"""
import json, logging
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from actors.request_schema import GenerationRequest
from cluster.serving.bringup import model_group_bundles, start_model_group
from tests.actors.fake_models import FunctionModelWorker, fake_group_config

logging.basicConfig(level=logging.WARNING)
ray.init(num_cpus=4, num_gpus=3, include_dashboard=False, log_to_driver=False)
config = fake_group_config()
config = config.model_copy(update={
    "models": tuple(m.model_copy(update={"num_gpus": 1}) for m in config.models if m.name != "partner2")})

def run(group):
    infos = ray.get([worker.info.remote() for worker in group.workers.values()])
    request = GenerationRequest(request_id="gpu", prompt_ids=[1, 2, 3], sampling={"max_tokens": 6, "seed": 1})
    chunks = [ray.get(ref) for ref in group.coordinator.generate.options(num_returns="streaming").remote(request)]
    return {"gpu_ids": {i.name: [str(g) for g in i.gpu_ids] for i in infos},
            "devices": sorted({i.device for i in infos}),
            "tokens": [t for c in chunks for t in c.token_ids], "error": chunks[-1].error}

auto_config = config.model_copy(update={
    "models": tuple(m.model_copy(update={"num_gpus": None}) for m in config.models)})  # gpus_per_model: auto
group = start_model_group(auto_config, worker_cls=FunctionModelWorker)
auto = run(group)
group.shutdown()
pg = placement_group(model_group_bundles(config), strategy="PACK")
ray.get(pg.ready())
group = start_model_group(config, placement_group=pg, worker_cls=FunctionModelWorker)
placed = run(group)
table = ray.util.placement_group_table(pg)
group.shutdown()
remove_placement_group(pg)
print(json.dumps({"auto": auto, "placed": placed, "bundles": table["bundles"],
                  "auto_bundles": model_group_bundles(auto_config)}))
"""


def test_each_worker_gets_its_own_gpu():
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    for variant in ("auto", "placed"):
        gpu_ids = report[variant]["gpu_ids"]
        assert set(gpu_ids) == {"target", "draft", "partner"}
        assert all(len(ids) == 1 for ids in gpu_ids.values()), gpu_ids
        assert len({ids[0] for ids in gpu_ids.values()}) == 3, gpu_ids  # distinct GPUs
        assert report[variant]["devices"] == ["cpu"]  # logical GPUs only: torch has no CUDA here
        assert report[variant]["error"] is None and len(report[variant]["tokens"]) == 6
    assert report["placed"]["tokens"] == report["auto"]["tokens"]  # same seed, same output
    assert all(bundle.get("GPU") == 1.0 for bundle in report["auto_bundles"])
    assert all(bundle.get("GPU") == 1.0 for bundle in report["bundles"].values())


def test_startup_logs_show_in_a_replica_and_requests_stay_quiet():
    """A Serve replica's root logger has no handler (Serve configures only ``ray.serve``), so
    bring-up's INFO lines (each worker's slots and forward path) were lost: ``show_startup_logs``
    (run by each replica) lets them out once, and leaves request-time INFO lines of other
    ``cluster`` loggers out. Where the root logger has a handler, it adds none (no line twice)."""
    import io
    import logging

    from cluster.serving.bringup import STARTUP_LOGGERS, show_startup_logs

    root, loggers = logging.getLogger(), [logging.getLogger(name) for name in STARTUP_LOGGERS]
    saved_root, saved = root.handlers[:], [(each.level, each.handlers[:]) for each in loggers]
    stream = io.StringIO()
    try:
        root.handlers.clear()
        show_startup_logs(stream)
        show_startup_logs(stream)
        logging.getLogger("cluster.serving.bringup").info("worker target (target): forward: the lean decoder (llama)")
        logging.getLogger("cluster.serving.ingress").info("request r1: user 'someone'")
        logging.getLogger("cluster.serving.streams").info("request r1: client went away")
        root.handlers[:] = saved_root
        for each in loggers:
            each.handlers.clear()
        show_startup_logs(stream)
        added_under_a_handled_root = [handler for each in loggers for handler in each.handlers]
    finally:
        root.handlers[:] = saved_root
        for each, (level, handlers) in zip(loggers, saved):
            each.setLevel(level)
            each.handlers[:] = handlers
    assert stream.getvalue().splitlines() == ["INFO cluster.serving.bringup: worker target (target): forward: the lean decoder (llama)"]
    assert added_under_a_handled_root == []
