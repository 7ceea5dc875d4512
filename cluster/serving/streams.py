"""The coordinator streams of a request, as the ingress reads them.

Each choice of a request is one ``Coordinator.generate`` call, consumed as a streaming
ObjectRefGenerator (:class:`CoordinatorStream`): failures reported in a chunk become the
errors :func:`cluster.serving.errors.client_error` maps to statuses; a client that goes away cancels
the streams, which frees the request's sessions in the workers. The choices of one request run
concurrently: collected whole (:func:`collect_all`) or interleaved as their chunks arrive
(:func:`prime_all`, then :func:`interleave`). :func:`model_group_health` is Serve's replica
health check.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from actors.request_schema import GenerationChunk, GenerationRequest, InvalidRequestError
from actors.coordination.admission import OverloadedError
from cluster.serving.errors import ModelGroupUnavailable, RequestFailed, RequestTimedOut, clean_text
from cluster.responses import CompletionAccumulator
from verifiers.grammar import GRAMMAR_ERROR_PREFIX

logger = logging.getLogger(__name__)


def unwrap_task_error(error: BaseException) -> BaseException:
    """The InvalidRequestError behind a Ray task error (re-created so it pickles cleanly)."""
    cause = getattr(error, "cause", None)
    for candidate in (error, cause):
        if isinstance(candidate, InvalidRequestError):
            return InvalidRequestError(candidate.field, candidate.message)
        if isinstance(candidate, OverloadedError):
            return OverloadedError(candidate.message)
    if isinstance(error, RayActorError) or isinstance(cause, RayActorError):
        return ModelGroupUnavailable(f"model group unavailable: {error}")
    return error


class CoordinatorStream:
    """Async iterator over one request's :class:`GenerationChunk` stream from the coordinator.

    ``cancel()`` (called when the client goes away) cancels the coordinator's generator task,
    whose clean-up releases the request's sessions in every worker.
    """

    def __init__(self, coordinator: Any, request: GenerationRequest):
        self.request_id = request.request_id
        structured = request.sampling.structured
        self._constraint_field = structured.field if structured is not None else None
        self._refs = coordinator.generate.options(num_returns="streaming").remote(request)
        self._finished = False

    def __aiter__(self) -> "CoordinatorStream":
        return self

    async def __anext__(self) -> GenerationChunk:
        if self._finished:
            raise StopAsyncIteration
        try:
            ref = await self._refs.__anext__()
            chunk: GenerationChunk = await ref
        except StopAsyncIteration:
            self._finished = True
            raise
        except (RayTaskError, RayActorError) as error:
            self._finished = True
            raise unwrap_task_error(error) from None
        if chunk.error is not None:
            self._finished = True
            if chunk.timed_out:  # past limits.request_timeout_s: 504 / DEADLINE_EXCEEDED
                raise RequestTimedOut(chunk.error)
            if chunk.retryable:  # a worker died and is being restarted: 503 / UNAVAILABLE
                raise ModelGroupUnavailable(f"the model group reported: {chunk.error}")
            if self._constraint_field is not None and chunk.error.startswith(GRAMMAR_ERROR_PREFIX):
                # the constraint ran past the grammar engine's limits mid-request: the client's to fix
                raise InvalidRequestError(self._constraint_field, chunk.error[len(GRAMMAR_ERROR_PREFIX):])
            raise RequestFailed(f"the model group reported: {chunk.error}")
        if chunk.finished:
            self._finished = True
        return chunk

    def cancel(self) -> None:
        """Cancel the coordinator task if it is still running (idempotent)."""
        if not self._finished:
            self._finished = True
            logger.info("request %s: client went away, cancelling its coordinator stream", self.request_id)
            ray.cancel(self._refs)


async def _prime(stream: CoordinatorStream) -> tuple[GenerationChunk | None, CoordinatorStream]:
    """Wait for the first chunk, so invalid requests fail before a streaming response starts."""
    try:
        first = await stream.__anext__()
    except StopAsyncIteration:
        first = None
    except BaseException:
        stream.cancel()
        raise
    return first, stream


async def prime_all(streams: list[CoordinatorStream]) -> list[GenerationChunk | None]:
    """The first chunk of every choice's stream (concurrently); if one fails, every stream is
    cancelled and the first failure (in choice order) is raised."""
    try:
        primed = await asyncio.gather(*(_prime(stream) for stream in streams), return_exceptions=True)
    except BaseException:
        for stream in streams:
            stream.cancel()
        raise
    failures = [item for item in primed if isinstance(item, BaseException)]
    if failures:
        for stream in streams:
            stream.cancel()
        raise failures[0]
    return [first for first, _ in primed]


async def interleave(
    streams: list[CoordinatorStream], firsts: list[GenerationChunk | None]
) -> AsyncIterator[tuple[int, GenerationChunk]]:
    """``(position, chunk)`` of every choice's stream as the chunks arrive (each stream starting
    with its primed first chunk). A failing stream raises here; closing the iterator (the
    client went away) or a failure cancels every stream."""
    if len(streams) == 1:
        try:
            chunk = firsts[0]
            while chunk is not None:
                yield 0, chunk
                chunk = await anext(streams[0], None)
        finally:
            streams[0].cancel()
        return
    # A bounded queue: a stream is read no faster than the client reads (the coordinator
    # merges the chunks of a stream that fell behind).
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))

    async def pump(position: int) -> None:
        try:
            chunk = firsts[position]
            while chunk is not None:
                await queue.put((position, chunk, None))
                chunk = await anext(streams[position], None)
            await queue.put((position, None, None))
        except Exception as error:  # noqa: BLE001 - handed to the reader, which raises it
            await queue.put((position, None, error))

    tasks = [asyncio.ensure_future(pump(position)) for position in range(len(streams))]
    try:
        remaining = len(streams)
        while remaining:
            position, chunk, error = await queue.get()
            if error is not None:
                raise error
            if chunk is None:
                remaining -= 1
                continue
            yield position, chunk
    finally:
        await cancel_all(tasks, streams)


async def cancel_all(tasks: list[asyncio.Future], streams: list[CoordinatorStream]) -> None:
    """Cancel the choices' tasks and their coordinator streams (a client went away, or they ended)."""
    for task in tasks:
        task.cancel()
    for stream in streams:
        stream.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def wait(ref: Any, timeout_s: float) -> Any:
    return await asyncio.wait_for(ref, timeout=timeout_s)


class ModelGroupUnhealthy(RuntimeError):
    """The replica's model group failed its health check (a worker or the coordinator did not answer)."""


async def model_group_health(ref: Any, timeout_s: float) -> None:
    """Await the coordinator's ``health()`` ref; any failure is raised as :class:`ModelGroupUnhealthy`.

    A dead worker reaches here as a ``RayActorError`` (the coordinator's call to it failed).
    Serve's controller reads a ``RayActorError`` from ``check_health`` as the replica actor's
    own crash and replaces the replica at once, dropping every request in flight on it; a plain
    exception counts as one failed check toward the deployment's failure threshold, which a
    worker restarted by Ray in a few seconds never reaches.
    """
    try:
        await wait(ref, timeout_s)
    except Exception as error:  # noqa: BLE001 - re-raised as a plain failure, see above
        raise ModelGroupUnhealthy(f"model group health check failed: {type(error).__name__}: "
                                  f"{clean_text(str(error), 300)}") from None


def start_streams(coordinator: Any, requests: list[GenerationRequest]) -> list[CoordinatorStream]:
    """One coordinator stream per choice. Each coordinator request resolves its plan (once)
    and checks it before any model work, so a bad one fails the first chunk."""
    streams: list[CoordinatorStream] = []
    try:
        for request in requests:
            streams.append(CoordinatorStream(coordinator, request))
    except BaseException:
        for stream in streams:
            stream.cancel()
        raise
    return streams

async def collect(stream: CoordinatorStream, result: CompletionAccumulator | None = None) -> CompletionAccumulator:
    result = CompletionAccumulator() if result is None else result
    try:
        async for chunk in stream:
            result.add(chunk)
    finally:
        stream.cancel()
    return result

async def collect_all(streams: list[CoordinatorStream], results: list[CompletionAccumulator]) -> None:
    """Every choice's stream into its accumulator, concurrently; the first failure cancels
    the other streams and is raised."""
    if len(streams) == 1:
        await collect(streams[0], results[0])
        return
    tasks = [asyncio.ensure_future(collect(stream, result)) for stream, result in zip(streams, results)]
    try:
        await asyncio.gather(*tasks)
    finally:
        await cancel_all(tasks, streams)
