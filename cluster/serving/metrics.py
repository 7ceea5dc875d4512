"""``GET /metrics``: every model group of an application in the Prometheus text format.

Each ingress replica owns one model group, whose coordinator is a named Ray actor
(``actors.coordination.metrics.GroupIdentity.actor_name`` in namespace ``specserve``). A scrape that lands on
any replica lists the named coordinators of its application (``ray.util.list_named_actors``),
asks each for a snapshot (:meth:`actors.coordination.coordinator.Coordinator.metrics_snapshot`) concurrently,
each within :data:`SCRAPE_TIMEOUT_S`, and renders them together, every sample labelled with the
replica that owns its group. A coordinator that is dead or does not answer in time is skipped and
counted in ``specserve_scrape_coordinators{state="failed"}``; the scrape never waits longer than
the timeout.

Rendering goes through ``prometheus_client`` (:class:`SnapshotCollector`, a custom collector
over the snapshots, and ``generate_latest``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from actors.coordination.metrics import (
    COORDINATOR_NAMESPACE,
    COUNTER,
    GAUGE,
    GROUP_LABELS,
    METRICS,
    MetricSpec,
    coordinator_name_prefix,
)

logger = logging.getLogger(__name__)

#: Seconds a scrape waits for all coordinators together (each one answers within
#: ``actors.coordination.coordinator.WORKER_METRICS_TIMEOUT_S`` plus its own work).
SCRAPE_TIMEOUT_S = 3.0
#: Content type of the Prometheus text format (version 0.0.4).
CONTENT_TYPE = CONTENT_TYPE_LATEST
SCRAPE_COORDINATORS = MetricSpec(
    "specserve_scrape_coordinators", GAUGE,
    "Coordinators (model groups, one per replica) of the application that answered this scrape (state=ok) or "
    "were skipped because they were dead or slow (state=failed).", ("state",))


@dataclass
class ScrapeResult:
    """The snapshots gathered by one scrape and how many coordinators failed to answer."""

    snapshots: list[dict[str, Any]] = field(default_factory=list)
    failed: int = 0


def coordinator_names(model_group: str) -> list[str]:
    """Names of the live named coordinators of ``model_group`` (a blocking GCS call)."""
    import ray

    prefix = coordinator_name_prefix(model_group)
    return sorted(
        entry["name"] for entry in ray.util.list_named_actors(all_namespaces=True)
        if entry.get("namespace") == COORDINATOR_NAMESPACE and entry["name"].startswith(prefix)
    )


class CoordinatorDirectory:
    """Finds the coordinators of one application and gathers their snapshots."""

    def __init__(self, model_group: str, own_name: str | None = None, own_handle: Any = None):
        self.model_group = model_group
        self._handles: dict[str, Any] = {}
        if own_name is not None and own_handle is not None:
            self._handles[own_name] = own_handle

    def _handle(self, name: str) -> Any:
        """The actor handle of a named coordinator (cached; a blocking call the first time)."""
        handle = self._handles.get(name)
        if handle is None:
            import ray

            handle = self._handles[name] = ray.get_actor(name, namespace=COORDINATOR_NAMESPACE)
        return handle

    async def _snapshot(self, name: str) -> dict[str, Any]:
        handle = self._handles.get(name)
        if handle is None:
            handle = await asyncio.to_thread(self._handle, name)
        return await handle.metrics_snapshot.remote()

    async def scrape(self, timeout_s: float = SCRAPE_TIMEOUT_S) -> ScrapeResult:
        """Every coordinator's snapshot, within ``timeout_s`` in all; those that do not answer in
        time (or are dead) are counted as failed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            names = await asyncio.wait_for(asyncio.to_thread(coordinator_names, self.model_group), timeout_s)
        except Exception as error:  # noqa: BLE001 - the GCS did not answer: fall back to the known ones
            logger.warning("listing the coordinators of %s failed: %s", self.model_group, type(error).__name__)
            names = sorted(self._handles)
        remaining = max(0.1, deadline - loop.time())
        results = await asyncio.gather(
            *(asyncio.wait_for(self._snapshot(name), remaining) for name in names), return_exceptions=True
        )
        scrape = ScrapeResult()
        for name, result in zip(names, results):
            if isinstance(result, dict):
                scrape.snapshots.append(result)
                continue
            scrape.failed += 1
            logger.warning("metrics of coordinator %s skipped: %s", name, type(result).__name__)
            if not isinstance(result, asyncio.TimeoutError):
                self._handles.pop(name, None)  # dead: look it up again if the name comes back
        for name in [name for name in self._handles if name not in names]:
            del self._handles[name]  # gone from the name table: its replica was removed
        return scrape


def _bucket_pairs(spec: MetricSpec, buckets: list[float]) -> list[tuple[str, float]]:
    """Per-bucket counts -> Prometheus' cumulative ``(le, count)`` pairs ending with +Inf."""
    pairs, running = [], 0.0
    for bound, count in zip([*spec.buckets, float("inf")], buckets):
        running += count
        pairs.append((floatToGoString(bound), running))
    return pairs


def _family(spec: MetricSpec, labels: list[str]) -> Metric:
    if spec.kind == COUNTER:
        return CounterMetricFamily(spec.name, spec.help, labels=labels)
    if spec.kind == GAUGE:
        return GaugeMetricFamily(spec.name, spec.help, labels=labels)
    return HistogramMetricFamily(spec.name, spec.help, labels=labels)


class SnapshotCollector(Collector):
    """A ``prometheus_client`` collector over coordinator snapshots: every family of
    :data:`actors.coordination.metrics.METRICS` (empty ones too), each sample labelled with its group's
    ``model_group`` and ``replica``, plus :data:`SCRAPE_COORDINATORS`."""

    def __init__(self, model_group: str, snapshots: Iterable[dict[str, Any]], failed: int = 0):
        self.model_group = model_group
        self.snapshots = list(snapshots)
        self.failed = failed

    def collect(self) -> Iterator[Metric]:
        for spec in METRICS.values():
            family = _family(spec, [*GROUP_LABELS, *spec.labels])
            for snapshot in self.snapshots:
                self._add(family, spec, snapshot)
            yield family
        scrape = GaugeMetricFamily(SCRAPE_COORDINATORS.name, SCRAPE_COORDINATORS.help,
                                   labels=["model_group", *SCRAPE_COORDINATORS.labels])
        scrape.add_metric([self.model_group, "ok"], len(self.snapshots))
        scrape.add_metric([self.model_group, "failed"], self.failed)
        yield scrape

    @staticmethod
    def _add(family: Metric, spec: MetricSpec, snapshot: dict[str, Any]) -> None:
        identity = snapshot["identity"]
        group = [identity["model_group"], identity["replica"]]
        if spec.kind in (COUNTER, GAUGE):
            section = snapshot["counters" if spec.kind == COUNTER else "gauges"]
            for key, value in section.get(spec.name, []):
                family.add_metric([*group, *map(str, key)], value)
            return
        for key, buckets, total, _count in snapshot["histograms"].get(spec.name, []):
            family.add_metric([*group, *map(str, key)], _bucket_pairs(spec, buckets), total)


def render(model_group: str, scrape: ScrapeResult) -> bytes:
    """The Prometheus text exposition of one scrape."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(model_group, scrape.snapshots, scrape.failed))
    return generate_latest(registry)
