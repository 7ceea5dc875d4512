"""The clients of a serving-load level: closed-loop streaming ``POST /v1/completions`` requests,
timed on the client side (:mod:`benchmarks.served.serve_load_records` defines the figures)."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from benchmarks.reports.store import load_avg
from benchmarks.served.load_cases import LoadCase, ServeLoadSettings
from benchmarks.served.prompts import Prompt
from benchmarks.served.serve_load_records import LevelRun, LevelSummary, RequestRecord, summarize_level
from benchmarks.served.server_process import MAX_ERROR_CHARS, MemoryProbe, MetricsProbe, busy_fractions

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LevelPlan:
    case: LoadCase
    concurrency: int
    requests: int
    overlap: bool | None = None  # the server's args.engine.overlap (None: not known)


class LoadClient:
    """Streams completions from the server and times them."""

    def __init__(self, base_url: str, model: str, settings: ServeLoadSettings, prompts: list[Prompt],
                 api_key: str | None = None):
        self.url = base_url + "/v1/completions"
        self.metrics = MetricsProbe(base_url + "/metrics", model)
        self.model = model
        self.settings = settings
        self.prompts = prompts
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def body(self, case: LoadCase, index: int, max_tokens: int) -> dict[str, Any]:
        prompt = self.prompts[index % len(self.prompts)]
        return {
            "model": self.model, "prompt": prompt.text, "max_tokens": max_tokens,
            "temperature": self.settings.temperature, "top_p": 1.0, "top_k": 0,
            "seed": self.settings.seed + max(index, 0), "ignore_eos": True, "stream": True,
            "return_token_ids": True, "speculation": case.speculation,
        }

    async def request(self, client, case: LoadCase, concurrency: int, index: int, level_start: float,
                      max_tokens: int, overlap: bool | None = None) -> RequestRecord:
        prompt = self.prompts[index % len(self.prompts)]
        body = self.body(case, index, max_tokens)
        times: list[float] = []
        tokens: list[int] = []
        final: dict[str, Any] = {}
        error: str | None = None
        done = False
        sent = time.perf_counter()

        async def consume() -> None:
            nonlocal error, done
            async with client.stream("POST", self.url, json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    error = f"HTTP {response.status_code}: {text}"
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    arrived = time.perf_counter()
                    payload = line[len("data:"):].strip()
                    if payload == "[DONE]":
                        done = True
                        return
                    event = json.loads(payload)
                    if "error" in event:
                        error = f"stream error: {json.dumps(event['error'])}"
                        continue
                    count = 0
                    for choice in event.get("choices") or []:
                        if "token_ids" in choice:
                            count += len(choice["token_ids"])
                        elif choice.get("text"):
                            count += 1  # a server without token ids: one per non-empty chunk
                    if count:
                        times.append(arrived - sent)
                        tokens.append(count)
                    if event.get("usage"):
                        final.update(usage=event["usage"], speculation=event.get("speculation") or {})

        try:
            await asyncio.wait_for(consume(), timeout=self.settings.request_timeout_s)
        except asyncio.TimeoutError:
            error = f"timed out after {self.settings.request_timeout_s:.0f} s"
        except Exception as exc:  # noqa: BLE001 - every failure is recorded and counted
            error = f"{type(exc).__name__}: {exc}"
        if error is None and not done:
            error = "stream ended without [DONE]"
        speculation = final.get("speculation") or {}
        return RequestRecord(
            label=case.label, concurrency=concurrency, index=index, prompt_id=prompt.id,
            seed=body["seed"], ok=error is None, error=None if error is None else error[:MAX_ERROR_CHARS],
            sent_s=sent - level_start, e2e_s=time.perf_counter() - sent, chunk_times_s=times, chunk_tokens=tokens,
            usage_completion_tokens=(final.get("usage") or {}).get("completion_tokens"),
            target_calls=speculation.get("target_calls"), overlap=overlap,
            drafted_tokens=_drafted_tokens(speculation),
            times_s={key[len("time_"):]: float(value) for key, value in speculation.items()
                     if key.startswith("time_") and isinstance(value, (int, float))} or None,
        )

    def measure_level(self, plan: LevelPlan, memory: MemoryProbe) -> LevelSummary:
        """Run one level and summarize it alone: what a round of interleaved cases reads."""
        run, records = asyncio.run(self.run_level(plan, memory))
        return summarize_level(run, records, self.settings.max_tokens)

    async def run_level(self, plan: LevelPlan, memory: MemoryProbe) -> tuple[LevelRun, list[RequestRecord]]:
        import httpx

        settings = self.settings
        limits = httpx.Limits(max_connections=plan.concurrency + 1, max_keepalive_connections=plan.concurrency + 1)
        timeout = httpx.Timeout(settings.request_timeout_s, connect=30.0)
        async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False, headers=self.headers) as client:
            warm_started = time.perf_counter()
            warm = await self.request(client, plan.case, plan.concurrency, -1, warm_started,
                                      min(settings.warmup_tokens, settings.max_tokens), plan.overlap)
            warmup_s = time.perf_counter() - warm_started
            if not warm.ok:
                logger.warning("%s warm-up failed: %s", plan.case.label, warm.error)
            memory.start_level()
            seconds_before = await self.metrics.scrape(client)
            records: list[RequestRecord] = []
            counter = itertools.count()
            started = time.perf_counter()
            deadline = started + settings.level_timeout_s

            async def closed_loop() -> None:
                while True:
                    index = next(counter)
                    if index >= plan.requests or time.perf_counter() > deadline:
                        return
                    records.append(await self.request(client, plan.case, plan.concurrency, index, started,
                                                      settings.max_tokens, plan.overlap))

            await asyncio.gather(*(closed_loop() for _ in range(plan.concurrency)))
            wall_s = time.perf_counter() - started
            seconds_after = await self.metrics.scrape(client)
        records.sort(key=lambda r: r.index)
        run = LevelRun(label=plan.case.label, strategy=plan.case.strategy, concurrency=plan.concurrency,
                       requests=plan.requests, wall_s=wall_s, warmup_ok=warm.ok, warmup_s=warmup_s,
                       memory=memory.read(), load_average=load_avg(), overlap=plan.overlap,
                       busy=busy_fractions(seconds_before, seconds_after, wall_s))
        return run, records


def _drafted_tokens(speculation: dict[str, Any]) -> int | None:
    """Tokens drafted over a request's iterations (its stats' ``draft_lengths``), or None."""
    lengths = speculation.get("draft_lengths")
    return int(sum(lengths)) if isinstance(lengths, list) and lengths else None
