"""GET /metrics through the real HTTP server (the session's Serve application): the counters
grow by exactly what the responses reported, and the speculation counters are consistent."""

from __future__ import annotations

import json

import httpx
from prometheus_client.parser import text_string_to_metric_families

MULTI_DRAFT = {"strategy": "multi_draft", "method": "sequential_gbv", "num_drafts": 2, "gamma": 3}
SE = {"strategy": "se", "method": "block", "members": ["target", "partner"], "gammas": [2, 2]}


def scrape(http: httpx.Client) -> dict[tuple, float]:
    """(sample name, sorted labels without replica) -> value summed over replicas."""
    response = http.get("/metrics")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    values: dict[tuple, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "replica"))
            values[(sample.name, labels)] = values.get((sample.name, labels), 0.0) + sample.value
    return values


def value(values: dict, name: str, **labels: str) -> float:
    wanted = set(labels.items())
    return sum(v for (sample, sample_labels), v in values.items() if sample == name and wanted <= set(sample_labels))


def grew(before: dict, after: dict, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def _stream_usage(http: httpx.Client, body: dict) -> dict:
    usage = None
    with http.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                     "stream_options": {"include_usage": True}}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[len("data: "):])
                usage = event.get("usage") or usage
    assert usage is not None
    return usage


def test_metrics_grow_by_what_the_responses_reported(serve_app):
    base = {"prompt": "def main(", "max_tokens": 12, "temperature": 1.0, "seed": 5, "ignore_eos": True}
    with httpx.Client(base_url=serve_app.http_url, timeout=120) as http:
        before = scrape(http)
        done = http.post("/v1/completions", json={**base, "speculation": MULTI_DRAFT})
        assert done.status_code == 200, done.text
        multi_usage = done.json()["usage"]
        se_usage = _stream_usage(http, {**base, "speculation": SE})
        assert http.post("/v1/completions", json={**base, "top_p": 7}).status_code == 400
        after = scrape(http)

    group = {"model_group": serve_app.model}
    multi = {**group, "strategy": "multi_draft", "method": "sequential_gbv"}
    se = {**group, "strategy": "se", "method": "block"}
    for labels, usage in ((multi, multi_usage), (se, se_usage)):
        assert grew(before, after, "specserve_generation_tokens_total", **labels) == usage["completion_tokens"] == 12
        assert grew(before, after, "specserve_prompt_tokens_total", **labels) == usage["prompt_tokens"]
        assert grew(before, after, "specserve_requests_total", status="length", **labels) == 1
        assert grew(before, after, "specserve_time_to_first_token_seconds_count", **labels) == 1
        assert grew(before, after, "specserve_e2e_request_latency_seconds_count", **labels) == 1
        verifications = grew(before, after, "specserve_spec_decode_num_verifications_total", **labels)
        accepted = grew(before, after, "specserve_spec_decode_num_accepted_tokens_total", **labels)
        draft_tokens = grew(before, after, "specserve_spec_decode_num_draft_tokens_total", **labels)
        assert verifications >= 1 and 0 <= accepted <= draft_tokens
        per_pos = [grew(before, after, "specserve_spec_decode_num_accepted_tokens_per_pos_total", position=str(i),
                        **labels) for i in range(6)]
        assert per_pos == sorted(per_pos, reverse=True) and sum(per_pos) == accepted
    assert grew(before, after, "specserve_spec_decode_num_drafts_total", **multi) == \
        2 * grew(before, after, "specserve_spec_decode_num_verifications_total", **multi)
    assert grew(before, after, "specserve_requests_total", status="invalid", **group) == 1

    for worker in ("target", "draft", "partner"):
        forward = grew(before, after, "specserve_worker_forward_seconds_total", worker=worker, **group)
        step = grew(before, after, "specserve_worker_step_seconds_total", worker=worker, **group)
        assert 0 < forward <= step, worker
        assert grew(before, after, "specserve_worker_steps_total", worker=worker, **group) >= 1
    assert value(after, "specserve_scrape_coordinators", state="ok", **group) == 1
    assert value(after, "specserve_scrape_coordinators", state="failed", **group) == 0
    assert value(after, "specserve_scrape_workers", state="failed", **group) == 0
