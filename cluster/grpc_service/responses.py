"""Chunks and results as ``GenerateResponse`` messages: usage, speculation stats and
per-token log-probabilities."""

from __future__ import annotations

from typing import Any

from actors.request_schema import GenerationChunk, GenerationRequest, RequestStats, TokenLogprob
from cluster.responses import CompletionAccumulator, TokenTexts, merged_speculation, prediction_details, total_usage
from protos import specserve_pb2


def stats_to_proto(stats: RequestStats | None) -> tuple[specserve_pb2.Usage, specserve_pb2.SpeculationStats]:
    """``usage`` and ``speculation`` messages of the final response."""
    if stats is None:
        return specserve_pb2.Usage(), specserve_pb2.SpeculationStats()
    usage = specserve_pb2.Usage(
        prompt_tokens=stats.prompt_tokens,
        completion_tokens=stats.completion_tokens,
        total_tokens=stats.prompt_tokens + stats.completion_tokens,
        **(prediction_details([stats]) or {}),
    )
    speculation = specserve_pb2.SpeculationStats(
        strategy=stats.strategy,
        method=stats.method or "",
        target_calls=stats.target_calls,
        model_calls=dict(stats.model_calls),
        accepted_lengths=list(stats.accepted_lengths),
        draft_lengths=list(stats.draft_lengths),
        proposer=stats.proposer or "",
        block_efficiency=stats.block_efficiency,
        tokens_per_second=stats.tokens_per_second,
        time_draft_s=stats.time_draft_s,
        time_target_s=stats.time_target_s,
        time_verify_s=stats.time_verify_s,
        time_coordination_s=stats.time_coordination_s,
        bytes_moved=stats.bytes_moved,
        proposed_tokens=dict(stats.proposed_tokens),
        accepted_proposed=dict(stats.accepted_proposed),
    )
    return usage, speculation


def usage_to_proto(usage: dict[str, Any]) -> specserve_pb2.Usage:
    """An HTTP ``usage`` object (:func:`cluster.responses.total_usage`) as a message: the
    prediction details flattened into it."""
    flat = {name: value for name, value in usage.items() if name != "completion_tokens_details"}
    return specserve_pb2.Usage(**flat, **usage.get("completion_tokens_details", {}))


def speculation_to_proto(block: dict[str, Any] | None) -> specserve_pb2.SpeculationStats:
    """A ``speculation`` block (:func:`cluster.responses.merged_speculation`) as a message."""
    if block is None:
        return specserve_pb2.SpeculationStats()
    fields = specserve_pb2.SpeculationStats.DESCRIPTOR.fields_by_name
    values = {name: value for name, value in block.items() if name in fields and value is not None}
    return specserve_pb2.SpeculationStats(**values)


def logprobs_to_proto(entries: list[TokenLogprob] | None, texts: TokenTexts | None) -> list[specserve_pb2.TokenLogprob]:
    """Per-token log-probabilities as messages (token text and bytes when ``texts`` is given)."""

    def shown(token_id: int) -> dict[str, Any]:
        return {} if texts is None else {"token": texts.text_of(token_id), "bytes": texts.bytes_of(token_id)}

    return [
        specserve_pb2.TokenLogprob(
            token_id=entry.token_id,
            logprob=entry.logprob,
            top_logprobs=[specserve_pb2.TopLogprob(token_id=token_id, logprob=logprob, **shown(token_id))
                          for token_id, logprob in entry.top],
            **shown(entry.token_id),
            **({} if entry.rank is None else {"rank": entry.rank}),
        )
        for entry in entries or ()
    ]


def chunk_to_response(
    chunk: GenerationChunk,
    model: str,
    *,
    index: int = 0,
    request_id: str | None = None,
    texts: TokenTexts | None = None,
) -> specserve_pb2.GenerateResponse:
    """One streamed message of choice ``index``; a choice's final one carries finish_reason,
    usage and speculation stats (that choice's). ``request_id``: the request's id (default: the
    chunk's, which is the request's when it has one choice)."""
    response = specserve_pb2.GenerateResponse(
        request_id=request_id or chunk.request_id,
        model=model,
        text=chunk.text,
        token_ids=list(chunk.token_ids),
        finished=chunk.finished,
        finish_reason=(chunk.finish_reason or "") if chunk.finished else "",
        index=index,
        logprobs=logprobs_to_proto(chunk.logprobs, texts),
        prompt_logprobs=logprobs_to_proto(chunk.prompt_logprobs, texts),
    )
    if chunk.finished:
        usage, speculation = stats_to_proto(chunk.stats)
        response.usage.CopyFrom(usage)
        response.speculation.CopyFrom(speculation)
    return response


def final_response(
    request_id: str,
    model: str,
    result: CompletionAccumulator | list[CompletionAccumulator],
    texts: TokenTexts | None = None,
    wall_s: float | None = None,
) -> specserve_pb2.GenerateResponse:
    """The unary ``Generate`` response: every choice in ``choices``; choice 0's text, token ids,
    finish reason and log-probabilities also in the top-level fields; the usage of all choices
    and their :func:`cluster.responses.merged_speculation` stats."""
    results = [result] if isinstance(result, CompletionAccumulator) else list(result)
    choices = []
    for item in results:
        usage, speculation = stats_to_proto(item.stats)
        choices.append(specserve_pb2.Choice(
            index=item.index,
            text=item.text,
            token_ids=item.token_ids,
            finish_reason=item.finish_reason or "",
            logprobs=logprobs_to_proto(item.logprobs, texts),
            prompt_logprobs=logprobs_to_proto(item.prompt_logprobs, texts),
            usage=usage,
            speculation=speculation,
        ))
    first = choices[0]
    return specserve_pb2.GenerateResponse(
        request_id=request_id,
        model=model,
        text=first.text,
        token_ids=first.token_ids,
        finished=True,
        finish_reason=first.finish_reason,
        usage=usage_to_proto(total_usage(results)),
        speculation=speculation_to_proto(merged_speculation(results, wall_s)),
        index=0,
        logprobs=first.logprobs,
        prompt_logprobs=first.prompt_logprobs,
        choices=choices,
    )


def wants_logprobs(request: GenerationRequest) -> bool:
    """Whether the request asked for per-token log-probabilities (of its output or its prompt)."""
    return request.sampling.logprobs is not None or request.sampling.prompt_logprobs is not None

