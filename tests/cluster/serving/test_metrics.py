"""GET /metrics without Ray: snapshots of several replicas merged and rendered by
prometheus_client, the scrape's handling of dead and slow coordinators, and the Grafana
dashboard's references (deploy/grafana-dashboard.json)."""

from __future__ import annotations

import asyncio
import json
import pathlib
import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from actors.coordination.metrics import COUNTER, GAUGE, METRICS, GroupIdentity, RequestClock, SchedulerMetrics, group_snapshot
from cluster.serving import metrics as cluster_metrics
from cluster.serving.metrics import SCRAPE_COORDINATORS, CoordinatorDirectory, ScrapeResult, render

DASHBOARD = pathlib.Path(__file__).resolve().parents[3] / "deploy" / "grafana-dashboard.json"


def metric_names() -> set[str]:
    """Every sample name ``GET /metrics`` can show (counters' ``_total``, histograms'
    ``_bucket`` / ``_sum`` / ``_count``): what dashboards may reference."""
    names = {SCRAPE_COORDINATORS.name}
    for spec in METRICS.values():
        if spec.kind == COUNTER:
            names.add(f"{spec.name}_total")
        elif spec.kind == GAUGE:
            names.add(spec.name)
        else:
            names.update(f"{spec.name}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
    return names


def _snapshot(replica: str, tokens: int, accepted: list[int]) -> dict:
    metrics = SchedulerMetrics()
    labels = ("sd", "block")
    clock = RequestClock()
    metrics.tokens(labels, clock, tokens, now=1.0, submitted=0.25)
    for count in accepted:
        metrics.verified(labels, drafts=1, draft_tokens=4, accepted=count)
    metrics.ended(labels, clock, "length", now=2.0, submitted=0.25)
    metrics.step(3)
    workers = {"target": {"forward_seconds_total": 1.25, "step_seconds_total": 2.5, "steps": 7,
                          "forward_passes_total": 9, "sessions": 2}}
    return group_snapshot(GroupIdentity("app", replica), metrics.recorder, running=1, waiting=2,
                          worker_totals=workers, workers_failed=0)


def _samples(text: str) -> dict[str, list]:
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def test_snapshots_of_two_replicas_render_with_their_replica_label():
    scrape = ScrapeResult([_snapshot("r1", 5, [4, 1]), _snapshot("r2", 3, [2])], failed=1)
    text = render("app", scrape).decode()
    samples = _samples(text)
    tokens = {s.labels["replica"]: s.value for s in samples["specserve_generation_tokens_total"]}
    assert tokens == {"r1": 5, "r2": 3}
    assert all(s.labels["model_group"] == "app" and s.labels["strategy"] == "sd"
               for s in samples["specserve_generation_tokens_total"])
    per_pos = {(s.labels["replica"], s.labels["position"]): s.value
               for s in samples["specserve_spec_decode_num_accepted_tokens_per_pos_total"]}
    assert per_pos == {("r1", "0"): 2, ("r1", "1"): 1, ("r1", "2"): 1, ("r1", "3"): 1, ("r2", "0"): 1, ("r2", "1"): 1}
    forward = {s.labels["replica"]: (s.labels["worker"], s.value) for s in samples["specserve_worker_forward_seconds_total"]}
    assert forward == {"r1": ("target", 1.25), "r2": ("target", 1.25)}
    scrape_state = {s.labels["state"]: s.value for s in samples["specserve_scrape_coordinators"]}
    assert scrape_state == {"ok": 2, "failed": 1}
    waiting = {s.labels["replica"]: s.value for s in samples["specserve_num_requests_waiting"]}
    assert waiting == {"r1": 2, "r2": 2}


def test_histograms_render_cumulative_buckets():
    text = render("app", ScrapeResult([_snapshot("r1", 5, [])])).decode()
    samples = _samples(text)
    buckets = [s for s in samples["specserve_time_to_first_token_seconds_bucket"] if s.labels["replica"] == "r1"]
    values = [s.value for s in buckets]
    assert values == sorted(values) and buckets[-1].labels["le"] == "+Inf" and values[-1] == 1
    first_holding = next(s for s in buckets if s.value == 1)
    assert float(first_holding.labels["le"]) >= 0.75 > float(buckets[buckets.index(first_holding) - 1].labels["le"])
    assert samples["specserve_time_to_first_token_seconds_sum"][0].value == pytest.approx(0.75)
    assert samples["specserve_time_to_first_token_seconds_count"][0].value == 1


def test_every_declared_family_is_rendered_even_without_samples():
    text = render("app", ScrapeResult()).decode()
    families = {family.name: family.type for family in text_string_to_metric_families(text)}
    assert set(families) == set(METRICS) | {"specserve_scrape_coordinators"}
    assert all(families[name] == spec.kind for name, spec in METRICS.items())
    assert "specserve_spec_decode_num_drafts_total" in metric_names()


class _Ref:
    def __init__(self, result, delay_s: float = 0.0):
        self.result, self.delay_s = result, delay_s

    def __await__(self):
        return self._wait().__await__()

    async def _wait(self):
        await asyncio.sleep(self.delay_s)
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


class _Coordinator:
    """A stand-in coordinator handle: ``metrics_snapshot.remote()`` answers after ``delay_s``."""

    def __init__(self, result, delay_s: float = 0.0):
        self.metrics_snapshot = self
        self._result, self._delay_s = result, delay_s

    def remote(self):
        return _Ref(self._result, self._delay_s)


def test_a_dead_or_slow_coordinator_is_skipped_and_counted(monkeypatch):
    prefix = "specserve-coordinator/app/"
    handles = {
        prefix + "ok": _Coordinator(_snapshot("ok", 1, [])),
        prefix + "slow": _Coordinator(_snapshot("slow", 1, []), delay_s=30.0),
        prefix + "dead": _Coordinator(RuntimeError("actor died")),
    }
    monkeypatch.setattr(cluster_metrics, "coordinator_names", lambda group: sorted(handles))
    directory = CoordinatorDirectory("app", prefix + "ok", handles[prefix + "ok"])
    directory._handles.update(handles)

    async def scrape():
        started = asyncio.get_running_loop().time()
        result = await directory.scrape(timeout_s=0.3)
        return result, asyncio.get_running_loop().time() - started

    result, elapsed = asyncio.run(scrape())
    assert [s["identity"]["replica"] for s in result.snapshots] == ["ok"]
    assert result.failed == 2 and elapsed < 2.0
    assert prefix + "dead" not in directory._handles and prefix + "slow" in directory._handles


def test_grafana_dashboard_parses_and_references_only_existing_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [panel for panel in dashboard["panels"] if panel.get("type") != "row"]
    expressions = [target["expr"] for panel in panels for target in panel.get("targets", [])]
    assert len(panels) >= 10 and all(panel.get("targets") for panel in panels)
    referenced = {name for expr in expressions for name in re.findall(r"specserve_[a-z0-9_]+", expr)}
    assert referenced and referenced <= metric_names(), referenced - metric_names()
    for needed in ("specserve_generation_tokens_total", "specserve_spec_decode_num_accepted_tokens_total",
                   "specserve_spec_decode_num_draft_tokens_total", "specserve_worker_forward_seconds_total",
                   "specserve_time_to_first_token_seconds_bucket", "specserve_inter_token_latency_seconds_bucket",
                   "specserve_e2e_request_latency_seconds_bucket", "specserve_num_requests_waiting",
                   "specserve_num_requests_running", "specserve_step_batch_size_bucket",
                   "specserve_spec_decode_num_accepted_tokens_per_pos_total"):
        assert needed in referenced, needed
    variables = {variable["name"] for variable in dashboard["templating"]["list"]}
    used = {name for expr in expressions for name in re.findall(r"\$\{?(\w+)", expr)}
    assert used <= variables | {"__rate_interval", "__interval"}
