"""A soak test of the served application the way production fails: 16 clients at once, mixed
strategies, streaming and non-streaming, one stream in five cut by its client after the first
chunk. Nothing else may fail, every session must be freed within seconds, and the workers'
memory must not grow (loopback only, bounded in requests and time)."""

from __future__ import annotations

import asyncio
import pathlib
import random
import time

import httpx
import pytest

CONCURRENCY = 16
REQUESTS = 200
CUT_FRACTION = 0.2
MAX_TOKENS = 12
SESSIONS_FREED_WITHIN_S = 5.0
MEMORY_GROWTH_LIMIT = 0.05
REQUEST_TIMEOUT_S = 120.0

STRATEGIES = [
    {"strategy": "ar"},
    {"strategy": "sd", "method": "block", "gamma": 4},
    {"strategy": "sd", "method": "greedy_block", "gamma": 3},
    {"strategy": "multi_draft", "method": "spectr", "gamma": 3, "num_drafts": 2},
    {"strategy": "ensemble", "ensemble": "weighted", "members": ["target", "partner"]},
    {"strategy": "se", "method": "token", "ensemble": "weighted", "members": ["target", "partner"], "gammas": [2, 1]},
]


def _worker_rss_kib() -> dict[int, int]:
    """Resident memory of every ModelWorker process on this machine (pid -> KiB)."""
    sizes = {}
    for status in pathlib.Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        if "ray::ModelWorker" not in text.split("\n", 1)[0] and "ModelWorker" not in text.split("\n", 1)[0]:
            continue
        for line in text.splitlines():
            if line.startswith("VmRSS:"):
                sizes[int(status.parent.name)] = int(line.split()[1])
    return sizes


def _body(index: int, stream: bool, model: str) -> dict:
    return {
        "model": model,
        "prompt": f"def function_{index}(x):\n    ",
        "max_tokens": MAX_TOKENS,
        "temperature": 1.0,
        "seed": index,
        "stream": stream,
        "speculation": STRATEGIES[index % len(STRATEGIES)],
    }


async def _one(client: httpx.AsyncClient, index: int, cut: bool, stream: bool, model: str) -> str:
    """'cut', 'ok' or a failure description."""
    body = _body(index, stream, model)
    if not stream:
        response = await client.post("/v1/completions", json=body)
        if response.status_code != 200:
            return f"{response.status_code} {response.text[:200]}"
        return "ok" if response.json()["choices"][0]["text"] is not None else "no text"
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return f"{response.status_code} {(await response.aread())[:200]!r}"
        events = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if cut:
                return "cut"  # leaving the block closes the connection mid-stream
            if '"error"' in line:
                return f"error event {line[:200]}"
            events += 1
            if line == "data: [DONE]":
                return "ok" if events > 1 else "empty stream"
    return "stream ended without [DONE]"


async def _soak(http_url: str, model: str) -> list[str]:
    plan = random.Random(7)
    jobs = [(i, plan.random() < CUT_FRACTION, plan.random() < 0.7) for i in range(REQUESTS)]  # (index, cut, stream)
    jobs = [(i, cut and stream, stream) for i, cut, stream in jobs]
    results: list[str] = []
    limits = httpx.Limits(max_connections=CONCURRENCY * 2)
    async with httpx.AsyncClient(base_url=http_url, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:

        async def worker() -> None:
            while jobs:
                index, cut, stream = jobs.pop()
                results.append(await _one(client, index, cut, stream, model))

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return results


def _open_sessions(http_url: str) -> dict[str, int]:
    return httpx.get(f"{http_url}/v1/status", timeout=30).json()["sessions"]


@pytest.mark.slow
def test_soak_with_cut_streams_loses_nothing_and_frees_every_session(serve_app):
    for strategy in range(len(STRATEGIES)):  # warm every path before measuring memory
        body = _body(strategy, False, serve_app.model)
        assert httpx.post(f"{serve_app.http_url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S).status_code == 200
    memory_before = _worker_rss_kib()
    started = time.monotonic()
    results = asyncio.run(_soak(serve_app.http_url, serve_app.model))
    elapsed = time.monotonic() - started
    cut = results.count("cut")
    failures = [r for r in results if r not in ("ok", "cut")]
    print(f"\nsoak: {len(results)} requests in {elapsed:.1f} s, {cut} cut by their client, {len(failures)} failures")
    assert len(results) == REQUESTS and cut >= REQUESTS * CUT_FRACTION / 2
    assert failures == []
    deadline = time.monotonic() + SESSIONS_FREED_WITHIN_S
    while any((sessions := _open_sessions(serve_app.http_url)).values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(sessions.values()), sessions
    memory_after = _worker_rss_kib()
    for pid, before in memory_before.items():
        if pid in memory_after:
            assert memory_after[pid] <= before * (1 + MEMORY_GROWTH_LIMIT), (pid, before, memory_after[pid])
