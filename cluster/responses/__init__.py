"""OpenAI response objects: token texts, log-probabilities, whole responses, stream chunks, SSE.

:class:`actors.request_schema.GenerationChunk` streams are rendered as OpenAI ``text_completion`` /
``chat.completion`` objects or their server-sent-event chunks. Responses carry a
``speculation`` block next to ``usage`` (an extension): the request's
:class:`actors.request_schema.RequestStats` (accepted lengths, block efficiency, target calls, ...); with
several choices it is their sum (:func:`merged_speculation`) and each choice carries its own.
Prompt log-probabilities render as OpenAI's ``echo`` with ``logprobs`` (the prompt's tokens
first, the first one null) and as vLLM's ``prompt_logprobs`` (:func:`prompt_logprobs_block`).

By job: token texts and log-probabilities (:mod:`cluster.responses.logprobs`), usage and stats
(:mod:`cluster.responses.usage`), whole responses and error bodies
(:mod:`cluster.responses.completions`), stream chunks and server-sent events
(:mod:`cluster.responses.stream`); every name is re-exported here.
"""

from cluster.responses.completions import (
    completion_response,
    error_body,
    invalid_request_body,
    models_list,
    tool_calls_of,
)
from cluster.responses.logprobs import LOGPROB_FLOOR, LogprobsRenderer, TokenTexts, prompt_logprobs_block
from cluster.responses.stream import SSE_DONE, ChoiceStream, sse_event, stream_chunk, usage_chunk
from cluster.responses.usage import (
    CompletionAccumulator,
    merged_speculation,
    prediction_details,
    speculation_block,
    total_usage,
    usage_block,
)

__all__ = [
    "ChoiceStream",
    "CompletionAccumulator",
    "LOGPROB_FLOOR",
    "LogprobsRenderer",
    "SSE_DONE",
    "TokenTexts",
    "completion_response",
    "error_body",
    "invalid_request_body",
    "merged_speculation",
    "models_list",
    "prediction_details",
    "prompt_logprobs_block",
    "speculation_block",
    "sse_event",
    "stream_chunk",
    "tool_calls_of",
    "total_usage",
    "usage_block",
    "usage_chunk",
]
