"""Serving metrics of one model group: recorded in the coordinator, read at scrape time.

Recording is plain dict arithmetic in the coordinator's event loop (:class:`MetricsRecorder`,
fed by :class:`SchedulerMetrics` from the scheduler's step loop: a few increments per request
per step, no Ray calls). Three readers:

* ``GET /metrics`` on the HTTP ingress gathers a :meth:`MetricsRecorder.snapshot` (plain,
  picklable data) from every coordinator of the application and renders them with
  ``prometheus_client`` (:mod:`cluster.serving.metrics`);
* :class:`RayMetricsExporter` copies the same figures into ``ray.util.metrics`` objects on a
  timer (:data:`RAY_EXPORT_PERIOD_S`), so Ray's own Prometheus export (its metrics-export port,
  names prefixed ``ray_``) carries them too;
* tests read snapshots directly.

Every family is declared once in :data:`METRICS` (name, type, help, labels, buckets). Every
sample also carries ``model_group`` (the served model name = the Serve application's name) and
``replica`` (the ingress replica that owns the group). Counter names are given without the
``_total`` suffix, which the Prometheus text (and Ray's export) add.
"""

from __future__ import annotations

import bisect
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

#: Ray namespace of the named coordinator actors (so a scrape can find every group of an app).
COORDINATOR_NAMESPACE = "specserve"
#: Name prefix of the coordinator actors: ``<prefix>/<model group>/<replica>``.
COORDINATOR_NAME_PREFIX = "specserve-coordinator"
#: Labels every sample carries (first, in this order).
GROUP_LABELS = ("model_group", "replica")
#: Seconds between two copies of the recorded figures into ``ray.util.metrics``.
RAY_EXPORT_PERIOD_S = 5.0
#: Raw histogram observations kept for the next Ray export at most (older ones are dropped).
MAX_PENDING_OBSERVATIONS = 100_000

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
PLAN_LABELS = ("strategy", "method")
#: ``method`` label of strategies without a verification rule (ar, ensemble) and of requests
#: refused before their plan was known.
NO_METHOD = "none"


def plan_labels(plan: Any | None) -> tuple[str, str]:
    """A request's metric labels (strategy, method) from its plan; :data:`NO_METHOD` for both
    before the plan is known."""
    if plan is None:
        return NO_METHOD, NO_METHOD
    return plan.strategy, plan.method or NO_METHOD

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                   0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0,
                   120.0, 300.0, 600.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


@dataclass(frozen=True)
class MetricSpec:
    """One metric family: ``labels`` are the labels after :data:`GROUP_LABELS`."""

    name: str
    kind: str
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


# The families the coordinator records (per request / per step).
REQUESTS = MetricSpec("specserve_requests", COUNTER,
                      "Requests ended, by status: stop, length (finished), cancelled, timed_out, error, unavailable "
                      "(a worker died; retryable), rejected (the waiting line was full: 429), invalid (400 from the "
                      "coordinator's checks).", PLAN_LABELS + ("status",))
PROMPT_TOKENS = MetricSpec("specserve_prompt_tokens", COUNTER,
                           "Prompt tokens of the requests admitted to run (one coordinator request per choice).",
                           PLAN_LABELS)
GENERATION_TOKENS = MetricSpec("specserve_generation_tokens", COUNTER,
                               "Tokens returned to clients (what usage.completion_tokens sums to).", PLAN_LABELS)
TIME_TO_FIRST_TOKEN = MetricSpec("specserve_time_to_first_token_seconds", HISTOGRAM,
                                 "Seconds from a request's arrival at the coordinator to its first returned token.",
                                 PLAN_LABELS, TTFT_BUCKETS)
INTER_TOKEN_LATENCY = MetricSpec("specserve_inter_token_latency_seconds", HISTOGRAM,
                                 "Seconds per returned token after the first chunk: a chunk of n tokens arriving "
                                 "t seconds after the previous one counts n observations of t / n.",
                                 PLAN_LABELS, LATENCY_BUCKETS)
E2E_LATENCY = MetricSpec("specserve_e2e_request_latency_seconds", HISTOGRAM,
                         "Seconds from arrival to the end of requests that were admitted (every status but rejected "
                         "and invalid).", PLAN_LABELS, REQUEST_BUCKETS)
QUEUE_TIME = MetricSpec("specserve_request_queue_time_seconds", HISTOGRAM,
                        "Seconds a request waited before it was admitted to run.", PLAN_LABELS, REQUEST_BUCKETS)
STEP_BATCH_SIZE = MetricSpec("specserve_step_batch_size", HISTOGRAM,
                             "Requests per scheduler step (one cohort's step; each model worker gets one call per "
                             "step carrying the work of these requests).", (), BATCH_BUCKETS)
STEP_DURATION = MetricSpec("specserve_step_duration_seconds", HISTOGRAM,
                           "Wall seconds of one scheduler step (every worker call of the step, results handled).",
                           (), LATENCY_BUCKETS)
SPEC_DRAFTS = MetricSpec("specserve_spec_decode_num_drafts", COUNTER,
                         "Drafts verified: sd 1 per verification, multi_draft K per verification (K drafts of gamma "
                         "tokens), se 1 per verified segment (the tokens one member proposed).", PLAN_LABELS)
SPEC_DRAFT_TOKENS = MetricSpec("specserve_spec_decode_num_draft_tokens", COUNTER,
                               "Draft tokens verified: sd gamma, multi_draft K x gamma per verification, se the "
                               "segment's length.", PLAN_LABELS)
SPEC_ACCEPTED_TOKENS = MetricSpec("specserve_spec_decode_num_accepted_tokens", COUNTER,
                                  "Draft tokens accepted (the correction or bonus token not included; multi_draft: "
                                  "of the chosen draft).", PLAN_LABELS)
SPEC_ACCEPTED_PER_POS = MetricSpec("specserve_spec_decode_num_accepted_tokens_per_pos", COUNTER,
                                   "Verifications that accepted the draft token at this 0-based position (so "
                                   "non-increasing in position).", PLAN_LABELS + ("position",))
SPEC_VERIFICATIONS = MetricSpec("specserve_spec_decode_num_verifications", COUNTER,
                                "Verifications (target or ensemble checks of a block): mean accepted length = "
                                "accepted tokens / verifications.", PLAN_LABELS)
STEPS = MetricSpec("specserve_scheduler_steps", COUNTER, "Scheduler steps run (all cohorts).")
# Gauges read from the scheduler at snapshot time.
RUNNING = MetricSpec("specserve_num_requests_running", GAUGE, "Requests running (admitted, not ended).")
WAITING = MetricSpec("specserve_num_requests_waiting", GAUGE, "Requests waiting to be admitted (queue depth).")
# Worker counters read from the workers at snapshot time (cumulative since the worker started).
WORKER_FORWARD_SECONDS = MetricSpec("specserve_worker_forward_seconds", COUNTER,
                                    "Seconds the worker spent in forward passes (host copy of the logits included).",
                                    ("worker",))
WORKER_STEP_SECONDS = MetricSpec("specserve_worker_step_seconds", COUNTER,
                                 "Seconds the worker spent inside step calls (forwards, sampling, verification, "
                                 "session bookkeeping; not waiting for proposals).", ("worker",))
WORKER_STEPS = MetricSpec("specserve_worker_steps", COUNTER, "Step calls the worker ran.", ("worker",))
WORKER_FORWARDS = MetricSpec("specserve_worker_forward_passes", COUNTER,
                             "Batched forward passes the worker ran.", ("worker",))
WORKER_SESSIONS = MetricSpec("specserve_worker_sessions", GAUGE, "Open sessions (KV-cache slots in use).",
                             ("worker",))
WORKER_PROMPT_TOKENS = MetricSpec("specserve_worker_prompt_tokens", COUNTER,
                                  "Prompt tokens of the sessions the worker opened.", ("worker",))
WORKER_PREFIX_REUSED_TOKENS = MetricSpec("specserve_worker_prefix_cache_reused_tokens", COUNTER,
                                         "Prompt tokens whose keys/values were copied from what the worker already "
                                         "held instead of computed (prefix caching; hit rate = this / prompt tokens).",
                                         ("worker",))
WORKER_LEAN_FAILURES = MetricSpec("specserve_worker_lean_forward_failures", COUNTER,
                                  "Lean decoder forwards that raised (each logged and run again by the batched path or "
                                  "the model's own decoder; a path failing 3 times in a row is dropped).", ("worker",))
WORKER_KV_BLOCKS_USED = MetricSpec("specserve_worker_kv_blocks_used", GAUGE,
                                   "KV cache blocks held by open sessions.", ("worker",))
WORKER_KV_BLOCKS_FREE = MetricSpec("specserve_worker_kv_blocks_free", GAUGE,
                                   "KV cache blocks free (or held only by finished requests' parked prefixes).",
                                   ("worker",))
WORKER_PREEMPTIONS = MetricSpec("specserve_worker_preemptions", COUNTER,
                                "Sessions whose KV blocks the worker took back for others (recomputed when resumed).",
                                ("worker",))
SCRAPE_WORKERS = MetricSpec("specserve_scrape_workers", GAUGE,
                            "Workers of the group that answered (state=ok) or not (state=failed) in this scrape.",
                            ("state",))

#: Families whose samples the recorder holds.
RECORDED = (REQUESTS, PROMPT_TOKENS, GENERATION_TOKENS, TIME_TO_FIRST_TOKEN, INTER_TOKEN_LATENCY, E2E_LATENCY,
            QUEUE_TIME, STEP_BATCH_SIZE, STEP_DURATION, SPEC_DRAFTS, SPEC_DRAFT_TOKENS, SPEC_ACCEPTED_TOKENS,
            SPEC_ACCEPTED_PER_POS, SPEC_VERIFICATIONS, STEPS)
#: Families filled at snapshot time.
SNAPSHOT_GAUGES = (RUNNING, WAITING)
WORKER_METRICS = (WORKER_FORWARD_SECONDS, WORKER_STEP_SECONDS, WORKER_STEPS, WORKER_FORWARDS, WORKER_SESSIONS,
                  WORKER_PROMPT_TOKENS, WORKER_PREFIX_REUSED_TOKENS, WORKER_LEAN_FAILURES, WORKER_KV_BLOCKS_USED,
                  WORKER_KV_BLOCKS_FREE, WORKER_PREEMPTIONS)
#: ``ModelWorker.metrics()`` key of each worker family.
WORKER_KEYS = {
    WORKER_FORWARD_SECONDS.name: "forward_seconds_total",
    WORKER_STEP_SECONDS.name: "step_seconds_total",
    WORKER_STEPS.name: "steps",
    WORKER_FORWARDS.name: "forward_passes_total",
    WORKER_SESSIONS.name: "sessions",
    WORKER_PROMPT_TOKENS.name: "prompt_tokens_total",
    WORKER_PREFIX_REUSED_TOKENS.name: "prefix_reused_tokens_total",
    WORKER_LEAN_FAILURES.name: "lean_forward_failures_total",
    WORKER_KV_BLOCKS_USED.name: "kv_blocks_used",
    WORKER_KV_BLOCKS_FREE.name: "kv_blocks_free",
    WORKER_PREEMPTIONS.name: "preemptions_total",
}
#: Every family of a coordinator's snapshot, by name.
METRICS: dict[str, MetricSpec] = {spec.name: spec for spec in (*RECORDED, *SNAPSHOT_GAUGES, *WORKER_METRICS,
                                                               SCRAPE_WORKERS)}


@dataclass(frozen=True)
class GroupIdentity:
    """Who a model group is, for metrics: the served model name and the owning replica."""

    model_group: str
    replica: str = ""

    @property
    def actor_name(self) -> str:
        """The coordinator's Ray actor name (in :data:`COORDINATOR_NAMESPACE`)."""
        return f"{COORDINATOR_NAME_PREFIX}/{self.model_group}/{self.replica}"


def coordinator_name_prefix(model_group: str) -> str:
    """Every coordinator of ``model_group`` has a name starting with this."""
    return f"{COORDINATOR_NAME_PREFIX}/{model_group}/"


@dataclass
class HistogramData:
    """Per-bucket counts (not cumulative; the last one is +Inf), sum and count."""

    buckets: list[float]
    total: float = 0.0
    count: float = 0.0

    def add(self, index: int, value: float, weight: int) -> None:
        self.buckets[index] += weight
        self.total += value * weight
        self.count += weight


@dataclass
class MetricsRecorder:
    """Counters and histograms of one model group, keyed by label values (``spec.labels``).

    ``pending`` (when ``keep_pending``) keeps raw histogram observations for the next Ray export.
    """

    keep_pending: bool = False
    counters: dict[str, dict[tuple, float]] = field(default_factory=dict)
    histograms: dict[str, dict[tuple, HistogramData]] = field(default_factory=dict)
    pending: deque = field(default_factory=lambda: deque(maxlen=MAX_PENDING_OBSERVATIONS))
    dropped_observations: int = 0

    def inc(self, spec: MetricSpec, key: tuple, amount: float = 1.0) -> None:
        """Add ``amount`` to a counter sample."""
        samples = self.counters.setdefault(spec.name, {})
        samples[key] = samples.get(key, 0.0) + amount

    def observe(self, spec: MetricSpec, key: tuple, value: float, weight: int = 1) -> None:
        """Record ``weight`` observations of ``value`` in a histogram sample."""
        samples = self.histograms.setdefault(spec.name, {})
        data = samples.get(key)
        if data is None:
            data = samples[key] = HistogramData([0.0] * (len(spec.buckets) + 1))
        data.add(bisect.bisect_left(spec.buckets, value), value, weight)
        if self.keep_pending:
            if len(self.pending) == self.pending.maxlen:
                self.dropped_observations += 1  # the oldest goes: Ray's export has not run for long
            self.pending.append((spec.name, key, value, weight))

    def take_pending(self) -> list[tuple[str, tuple, float, int]]:
        """The observations since the last call (for the Ray export)."""
        pending = list(self.pending)
        self.pending.clear()
        return pending

    def snapshot(self) -> dict[str, Any]:
        """Plain data: ``{"counters": {name: [(key, value)]}, "histograms": {name: [(key, buckets,
        sum, count)]}}`` (buckets per bucket, not cumulative, +Inf last)."""
        return {
            "counters": {name: list(samples.items()) for name, samples in self.counters.items()},
            "histograms": {
                name: [(key, list(data.buckets), data.total, data.count) for key, data in samples.items()]
                for name, samples in self.histograms.items()
            },
        }


@dataclass
class RequestClock:
    """Per-request timestamps the metrics need (kept on the scheduler's request state)."""

    first_token_at: float = 0.0
    last_token_at: float = 0.0
    ended: bool = False


class SchedulerMetrics:
    """What the scheduler records: requests, tokens, latencies, steps, speculation."""

    def __init__(self, recorder: MetricsRecorder | None = None):
        self.recorder = recorder if recorder is not None else MetricsRecorder()

    def admitted(self, labels: tuple[str, str], clock: RequestClock, prompt_tokens: int, waited_s: float) -> None:
        """A request starts running."""
        self.recorder.inc(PROMPT_TOKENS, labels, prompt_tokens)
        self.recorder.observe(QUEUE_TIME, labels, waited_s)

    def tokens(self, labels: tuple[str, str], clock: RequestClock, count: int, now: float, submitted: float) -> None:
        """``count`` tokens were returned to the client at ``now`` (one chunk)."""
        recorder = self.recorder
        recorder.inc(GENERATION_TOKENS, labels, count)
        if not clock.first_token_at:
            clock.first_token_at = now
            recorder.observe(TIME_TO_FIRST_TOKEN, labels, now - submitted)
        else:
            recorder.observe(INTER_TOKEN_LATENCY, labels, (now - clock.last_token_at) / count, count)
        clock.last_token_at = now

    def ended(self, labels: tuple[str, str], clock: RequestClock, status: str, now: float, submitted: float,
              admitted: bool = True) -> None:
        """A request ended with ``status`` (counted once per request)."""
        if clock.ended:
            return
        clock.ended = True
        self.recorder.inc(REQUESTS, (*labels, status))
        if admitted:
            self.recorder.observe(E2E_LATENCY, labels, now - submitted)

    def refused(self, labels: tuple[str, str], status: str) -> None:
        """A request refused before it could run (``rejected``, ``invalid``)."""
        self.recorder.inc(REQUESTS, (*labels, status))

    def step(self, batch_size: int) -> None:
        """A cohort step starts with ``batch_size`` requests."""
        self.recorder.inc(STEPS, ())
        self.recorder.observe(STEP_BATCH_SIZE, (), batch_size)

    def step_duration(self, seconds: float) -> None:
        self.recorder.observe(STEP_DURATION, (), seconds)

    def verified(self, labels: tuple[str, str], drafts: int, draft_tokens: int, accepted: int) -> None:
        """One verification: ``drafts`` drafts of ``draft_tokens`` tokens in all, ``accepted``
        of them accepted (positions ``0 .. accepted - 1``)."""
        recorder = self.recorder
        recorder.inc(SPEC_VERIFICATIONS, labels)
        recorder.inc(SPEC_DRAFTS, labels, drafts)
        recorder.inc(SPEC_DRAFT_TOKENS, labels, draft_tokens)
        if accepted:
            recorder.inc(SPEC_ACCEPTED_TOKENS, labels, accepted)
            for position in range(accepted):
                recorder.inc(SPEC_ACCEPTED_PER_POS, (*labels, str(position)))


def worker_samples(worker_totals: dict[str, dict[str, float]]) -> dict[str, list[tuple[tuple, float]]]:
    """``ModelWorker.metrics()`` per worker name -> samples of the worker families."""
    return {
        spec.name: [((worker,), float(totals[WORKER_KEYS[spec.name]])) for worker, totals in sorted(worker_totals.items())
                    if WORKER_KEYS[spec.name] in totals]
        for spec in WORKER_METRICS
    }


def group_snapshot(identity: GroupIdentity, recorder: MetricsRecorder, running: int, waiting: int,
                   worker_totals: dict[str, dict[str, float]], workers_failed: int) -> dict[str, Any]:
    """One coordinator's snapshot: identity, recorded families, gauges, worker counters."""
    snapshot = recorder.snapshot()
    gauges = {RUNNING.name: [((), float(running))], WAITING.name: [((), float(waiting))],
              SCRAPE_WORKERS.name: [(("ok",), float(len(worker_totals))), (("failed",), float(workers_failed))]}
    for name, samples in worker_samples(worker_totals).items():
        kind = METRICS[name].kind
        (snapshot["counters"] if kind == COUNTER else gauges)[name] = samples
    snapshot["gauges"] = gauges
    snapshot["identity"] = {"model_group": identity.model_group, "replica": identity.replica}
    return snapshot


class RayMetricsExporter:
    """Copies a group's figures into ``ray.util.metrics`` (Ray's Prometheus export), in batches.

    Counters are incremented by what they grew since the last export (a worker that restarted
    starts again from 0: its new total is added), histograms get the raw observations kept since
    the last export, gauges are set. Tags: :data:`GROUP_LABELS` + the family's labels.
    """

    def __init__(self, identity: GroupIdentity, metrics_module: Any = None):
        if metrics_module is None:
            from ray.util import metrics as metrics_module
        self._module = metrics_module
        self._base = (identity.model_group, identity.replica)
        self._objects: dict[str, Any] = {}
        self._exported: dict[tuple[str, tuple], float] = {}

    def _object(self, spec: MetricSpec) -> Any:
        metric = self._objects.get(spec.name)
        if metric is None:
            tag_keys = GROUP_LABELS + spec.labels
            if spec.kind == COUNTER:
                metric = self._module.Counter(spec.name, description=spec.help, tag_keys=tag_keys)
            elif spec.kind == GAUGE:
                metric = self._module.Gauge(spec.name, description=spec.help, tag_keys=tag_keys)
            else:
                metric = self._module.Histogram(spec.name, description=spec.help, boundaries=list(spec.buckets),
                                                tag_keys=tag_keys)
            self._objects[spec.name] = metric
        return metric

    def _tags(self, spec: MetricSpec, key: tuple) -> dict[str, str]:
        return dict(zip(GROUP_LABELS + spec.labels, (*self._base, *(str(v) for v in key))))

    def export(self, snapshot: dict[str, Any], observations: list[tuple[str, tuple, float, int]]) -> None:
        """Export one :func:`group_snapshot` and the histogram observations since the last call."""
        for name, samples in snapshot["counters"].items():
            spec = METRICS[name]
            for key, value in samples:
                previous = self._exported.get((name, key), 0.0)
                delta = value - previous if value >= previous else value  # below: the source restarted
                self._exported[(name, key)] = value
                if delta > 0:
                    self._object(spec).inc(delta, tags=self._tags(spec, key))
        for name, samples in snapshot["gauges"].items():
            spec = METRICS[name]
            for key, value in samples:
                self._object(spec).set(value, tags=self._tags(spec, key))
        for name, key, value, weight in observations:
            spec = METRICS[name]
            metric, tags = self._object(spec), self._tags(spec, key)
            for _ in range(weight):
                metric.observe(value, tags=tags)


class StepCounters:
    """The scheduler's step counters that its stats show (steps, solo bursts, the recent steps'
    batch sizes and durations), each step also recorded in ``metrics``."""

    def __init__(self, metrics: SchedulerMetrics):
        self.metrics = metrics
        self.steps = 0
        self.bursts = 0
        self.batch_sizes: deque[int] = deque(maxlen=256)
        self.step_seconds: deque[float] = deque(maxlen=256)

    def step(self, batch: int) -> None:
        """A step of ``batch`` requests starts."""
        self.steps += 1
        self.batch_sizes.append(batch)
        self.metrics.step(batch)

    def duration(self, seconds: float) -> None:
        """A step took ``seconds``."""
        self.step_seconds.append(seconds)
        self.metrics.step_duration(seconds)
