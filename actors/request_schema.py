"""The request schema: the request, chunk and stats types exchanged between the serving layer
and the Coordinator.

These are the only objects that cross the Serve ingress <-> Coordinator boundary. They are
pydantic models with ``extra="forbid"`` so a bad field is named in the error, and they are
plain data (picklable) so they travel through Ray unchanged.

They are also the one place a request's values are checked. HTTP and gRPC both build a
:class:`GenerationRequest` from the deployment's defaults and the client's fields
(:func:`GenerationRequest.parse`), and its constraints refuse what the decoding code cannot
take, before any model work:

- non-finite numbers (``NaN``, ``inf``; JSON ``1e400`` parses as ``inf``) and the ranges of
  ``temperature`` (0, greedy, or at least :data:`MIN_POSITIVE_TEMPERATURE`: ``logits / 1e-320``
  overflows), ``top_p``, the penalties, ``min_p``, the ``logit_bias`` values, ``speculation.mu``
  (at most :data:`MAX_MU`: ``expert - 1e308 * amateur`` overflows) and ``speculation.weights``;
- integers beyond int64 (HTTP JSON has no limit; seeds must fit a torch generator), negative
  token ids (``prompt_ids``, ``logit_bias``), block lengths outside [1, :data:`MAX_GAMMA`];
- sizes: the prompt (``max_prompt_chars``, the deployment's ``limits.max_prompt_chars``),
  stop strings, ``logit_bias`` entries, the ``weights`` / ``gammas`` / ``members`` lists, names;
- the values that go together: ``max_tokens`` 0 only with prompt log-probabilities,
  ``min_tokens`` at most ``max_tokens`` and not with a structured-output constraint, a
  structured-output grammar that compiles (:class:`StructuredOutput`), distinct members.

Every failure is an :class:`InvalidRequestError` naming the field by its path
(``sampling.temperature``, ``speculation.weights``; :mod:`actors.invalid_request`), which the
protocols rename to their own (HTTP ``temperature``) and answer with HTTP 400 / gRPC
INVALID_ARGUMENT. What depends on the deployment is checked where the deployment is known:
the strategy's rule, models and list lengths by
:func:`actors.coordination.plan.resolve_plan`, the prompt against the vocabulary and the
context by the coordinator.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from actors.invalid_request import InvalidRequestError, error_message, invalid_request, shortened
from verifiers.ensemble import WEIGHT_SUM_TOLERANCE, EnsembleKind  # the ensemble functions' vocabulary, defined once

Strategy = Literal["ar", "sd", "multi_draft", "ensemble", "se"]
FinishReason = Literal["stop", "length", "error"]

MAX_GAMMA = 32
MAX_DRAFTS = 8
MAX_TOP_LOGPROBS = 20
MAX_NGRAM = 16
INT64_MAX = 2**63 - 1
#: Smallest positive temperature (0 means greedy).
MIN_POSITIVE_TEMPERATURE = 1e-6
#: Largest contrastive strength ``speculation.mu``.
MAX_MU = 1000.0
MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 256
#: Longest ``weights`` / ``gammas`` / ``members`` list.
MAX_LIST_ITEMS = 64
#: Largest absolute ``presence_penalty`` / ``frequency_penalty`` (OpenAI's range).
MAX_PENALTY = 2.0
#: Largest ``repetition_penalty`` (must be > 0; 1 disables it).
MAX_REPETITION_PENALTY = 10.0
#: Most ``logit_bias`` entries, and the bound of their values.
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LOGIT_BIAS = 100.0
#: Longest model, member or method name.
MAX_NAME_CHARS = 128


def check_gamma(value: object) -> int | str:
    """A draft block length: an int in ``[1, MAX_GAMMA]`` or ``"auto"`` (:mod:`verifiers.adaptive`)."""
    if value == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_GAMMA:
        raise ValueError(f'must be an integer in [1, {MAX_GAMMA}] or "auto", got {value!r}')
    return value


#: ``gamma`` as requests and configs spell it (one error message naming the field, not one per
#: member of the union).
GammaValue = Annotated[Union[int, Literal["auto"]], PlainValidator(check_gamma, json_schema_input_type=Union[int, Literal["auto"]])]


def _greedy_or_positive(value: float) -> float:
    if 0 < value < MIN_POSITIVE_TEMPERATURE:
        raise ValueError(f"must be 0 (greedy) or at least {MIN_POSITIVE_TEMPERATURE} (got {value})")
    return value


# The value types of the request fields: each constraint is declared once, here.
#: An integer >= 0 that fits an int64 (seeds feed torch generators; token ids, counts).
Int64 = Annotated[int, Field(ge=0, le=INT64_MAX)]
Temperature = Annotated[float, Field(ge=0.0, allow_inf_nan=False), AfterValidator(_greedy_or_positive)]
#: Alternatives per token of log-probabilities (OpenAI's ``top_logprobs``).
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]
Penalty = Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
LogitBias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS, allow_inf_nan=False)]
#: A model or member name.
Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)]
#: A weighted ensemble's weight.
Weight = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
#: A draft or proposal block length.
BlockLength = Annotated[int, Field(ge=1, le=MAX_GAMMA)]
#: Contrastive strength.
Mu = Annotated[float, Field(ge=0.0, le=MAX_MU, allow_inf_nan=False)]


def check_weight_sum(weights: Any) -> Any:
    """Weights (when given) must sum to 1 (within :data:`WEIGHT_SUM_TOLERANCE`)."""
    if weights is not None and weights and abs(sum(weights) - 1.0) > WEIGHT_SUM_TOLERANCE:
        raise ValueError(f"weights must sum to 1, got sum {sum(weights)!r}")
    return weights


def check_distinct(names: Any) -> Any:
    """Member names (when given) must be distinct."""
    if names is not None and len(set(names)) != len(names):
        raise ValueError(f"members must be distinct, got {shortened(list(names))}")
    return names


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StructuredOutput(_Frozen):
    """A structured-output constraint (:mod:`verifiers.grammar`): every token is drawn from the
    law restricted to what the grammar allows after the tokens before it."""

    kind: Literal["json_schema", "json_object", "regex", "choice", "grammar"] = Field(
        ..., description="json_schema (spec: a JSON schema object), json_object (any JSON object), regex (spec: "
        "a regular expression), choice (spec: a list of strings), grammar (spec: a Lark grammar).")
    spec: Any = Field(None, description="The schema, regex, choices or grammar (None for json_object).")
    field: str = Field("structured_outputs", description="The request field it came from (named in errors).")

    @model_validator(mode="after")
    def _compiles(self) -> StructuredOutput:
        """The constraint's grammar alone (no tokenizer, no model work): invalid schemas, regexes
        and grammars, unsupported keywords and grammars over the engine's limits are refused here
        (over the tokenizer: the coordinator)."""
        from verifiers.grammar import GrammarError, compile_constraint

        try:
            compile_constraint(self.kind, self.spec, None)
        except GrammarError as error:
            raise ValueError(str(error)) from None
        return self

    @classmethod
    def checked(cls, kind: str, spec: Any = None, field: str = "structured_outputs") -> StructuredOutput:
        """The constraint, or :class:`InvalidRequestError` naming ``field`` (the request field it
        came from) when it does not compile."""
        try:
            return cls(kind=kind, spec=spec, field=field)
        except ValidationError as error:
            raise InvalidRequestError(field, error_message(error.errors(include_url=False)[0])) from None


class SamplingParams(_Frozen):
    """How tokens are drawn. Every strategy samples from exactly this law (losslessness)."""

    temperature: Temperature = Field(
        1.0, description=f"Softmax temperature; 0 means greedy (argmax), else at least {MIN_POSITIVE_TEMPERATURE}."
    )
    top_p: float = Field(
        1.0, gt=0.0, le=1.0, allow_inf_nan=False, description="Nucleus sampling mass in (0, 1]; 1 disables it."
    )
    top_k: Int64 = Field(0, description="Keep the k most likely tokens; 0 disables it.")
    max_tokens: Int64 = Field(
        64, description="Maximum number of generated tokens; 0 (only with prompt_logprobs) scores the prompt alone."
    )
    stop: list[StopString] = Field(
        default_factory=list, max_length=MAX_STOP_STRINGS,
        description=f"Stop strings (at most {MAX_STOP_STRINGS}, each 1..{MAX_STOP_CHARS} characters); generation "
        "ends before the first match.",
    )
    seed: Int64 | None = Field(None, description="Seed of every random stream of the request; None picks one.")
    ignore_eos: bool = Field(False, description="Keep generating past the end-of-sequence token.")
    presence_penalty: Penalty = Field(
        0.0, description="Subtracted from the logit of every token already generated (OpenAI, -2..2)."
    )
    frequency_penalty: Penalty = Field(
        0.0, description="Subtracted from a token's logit once per time it was generated (OpenAI, -2..2)."
    )
    repetition_penalty: float = Field(
        1.0, gt=0.0, le=MAX_REPETITION_PENALTY, allow_inf_nan=False,
        description="Logits of tokens in the prompt or the output are divided by it when positive, multiplied when "
        "negative (the transformers / vLLM extension), in (0, 10]; 1 disables it.",
    )
    logit_bias: dict[Int64, LogitBias] = Field(
        default_factory=dict, max_length=MAX_LOGIT_BIAS_ENTRIES,
        description=f"Token id -> value added to its logit before sampling (OpenAI, -100..100; at most "
        f"{MAX_LOGIT_BIAS_ENTRIES} entries; the ids must exist in the vocabulary).",
    )
    min_p: float = Field(
        0.0, ge=0.0, le=1.0, allow_inf_nan=False,
        description="Drop tokens whose probability (after temperature and top-k) is below min_p times the "
        "row's largest, before top-p (vLLM's extension), in [0, 1]; 0 disables it.",
    )
    min_tokens: Int64 = Field(
        0, description="Generate at least this many tokens before an end-of-sequence token can be drawn or a stop "
        "string can end the output (vLLM's extension), in [0, max_tokens].",
    )
    skip_special_tokens: bool = Field(True, description="Leave special tokens out of the output text.")
    spaces_between_special_tokens: bool = Field(
        True, description="With skip_special_tokens false: a space between a special token and its neighbours."
    )
    include_stop_str_in_output: bool = Field(
        False, description="Keep the stop string that ended the output at the end of the text."
    )
    truncate_prompt_tokens: int | None = Field(
        None, ge=1, le=INT64_MAX, description="Keep only the prompt's last this many tokens (>= 1); None keeps it whole."
    )
    logprobs: TopLogprobs | None = Field(
        None,
        description="Return each generated token's log-probability under the law it was sampled from, with this "
        "many most likely alternatives (0: the token alone); None: no log-probabilities.",
    )
    structured: StructuredOutput | None = Field(
        None, description="Constrain the output to a JSON schema, regex, choice or grammar; None: unconstrained."
    )
    prompt_logprobs: TopLogprobs | None = Field(
        None,
        description="Return each prompt token's log-probability (after the first) under the model's raw law (the "
        "target's, or the ensemble's for ensemble / se, at temperature 1 with no top-k / top-p / penalties), with "
        "this many most likely alternatives; None: none.",
    )

    @model_validator(mode="after")
    def _fields_agree(self) -> SamplingParams:
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise InvalidRequestError(
                "max_tokens", "0 only scores the prompt: it needs prompt log-probabilities (echo with logprobs, "
                "or prompt_logprobs); otherwise at least 1"
            )
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                "min_tokens", f"must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if self.structured is not None and self.min_tokens:
            raise InvalidRequestError("min_tokens", "cannot be combined with a structured-output constraint (the "
                                      "grammar decides where the output may end)")
        return self


class SpeculationParams(_Frozen):
    """Which decoding strategy serves the request. Unset fields take the deployment's defaults."""

    strategy: Strategy | None = Field(None, description="ar | sd | multi_draft | ensemble | se.")
    method: str | None = Field(
        None, max_length=MAX_NAME_CHARS,
        description=(
            "Verification rule. sd: token, block, greedy_block; multi_draft: spectr, sequential_gbv, spectr_gbv; se "
            "alternating: token, block; se with a model proposer: any of the six (spectr_gbv: experimental, not "
            "lossless for K >= 2). Unset here and in defaults: the strategy's first rule."
        ),
    )
    gamma: GammaValue | None = Field(
        None,
        description='Draft block length (sd, multi_draft, se with a model proposer), or "auto" (docs/strategies.md); '
        "se alternating: each member's proposal length. Unset: defaults.gamma (se with a model proposer: "
        "defaults.se_draft_gamma if set).",
    )
    gamma_max: int | None = Field(None, ge=1, le=MAX_GAMMA, description='Largest block "auto" may draft.')
    num_drafts: int | None = Field(None, ge=1, le=MAX_DRAFTS, description="K i.i.d. drafts (multi_draft).")
    ensemble: EnsembleKind | None = Field(None, description="weighted | contrastive (ensemble, se).")
    weights: list[Weight] | None = Field(
        None, max_length=MAX_LIST_ITEMS, description="Weighted ensemble weights in [0, 1], one per member, summing to 1. Unset: uniform."
    )
    mu: Mu | None = Field(None, description=f"Contrastive strength in [0, {MAX_MU:g}]: softmax(expert - mu * amateur).")
    gammas: list[BlockLength] | None = Field(
        None, max_length=MAX_LIST_ITEMS,
        description=f"Per-member proposal lengths in [1, {MAX_GAMMA}] (se with the alternate proposer; refused with a "
        "model proposer). Unset: gamma for each (1 with \"auto\").",
    )
    members: list[Name] | None = Field(
        None, max_length=MAX_LIST_ITEMS,
        description="Ensemble members, distinct, in order (contrastive: expert, amateur). Unset: the target, then the members.",
    )
    proposer: str | None = Field(
        None, max_length=MAX_NAME_CHARS,
        description='Who drafts. sd: "draft" (the draft model) or "ngram" (prompt lookup, no model). se: "alternate" '
        "(the members in turn) or a deployment model whose blocks every member scores in one forward. Unset: "
        "defaults.proposer for the default strategy, else defaults.proposers (both set: equal).",
    )
    prompt_lookup_max: int | None = Field(
        None, ge=1, le=MAX_NGRAM, description="Longest n-gram prompt lookup and prediction realignment look up."
    )
    prompt_lookup_min: int | None = Field(
        None, ge=1, le=MAX_NGRAM, description="Shortest n-gram prompt lookup and prediction realignment look up."
    )

    _weights_sum_to_one = field_validator("weights")(check_weight_sum)
    _distinct_members = field_validator("members")(check_distinct)


class GenerationRequest(_Frozen):
    """One generation request as the Coordinator receives it."""

    request_id: str = Field(..., min_length=1, description="Unique id, used in logs and session names.")
    prompt: str | None = Field(None, description="Prompt text (tokenized by the coordinator).")
    prompt_ids: list[Int64] | None = Field(None, description="Prompt token ids (instead of prompt).")
    sampling: SamplingParams = Field(default_factory=SamplingParams, description="Sampling parameters.")
    speculation: SpeculationParams = Field(
        default_factory=SpeculationParams, description="Strategy overrides; unset fields use the deployment defaults."
    )
    prediction: str | list[int] | None = Field(
        None, description="Predicted output (text or token ids): sd drafts it before its proposer (OpenAI's "
        "predicted outputs; the output law is unchanged).",
    )

    @model_validator(mode="after")
    def _exactly_one_prompt(self, info: ValidationInfo) -> GenerationRequest:
        if (self.prompt is None) == (self.prompt_ids is None):
            raise InvalidRequestError("prompt", "exactly one of prompt and prompt_ids must be given")
        if self.prompt is not None and not self.prompt:
            raise InvalidRequestError("prompt", "must not be empty")
        if self.prompt_ids is not None and not self.prompt_ids:
            raise InvalidRequestError("prompt_ids", "must not be empty")
        limit = (info.context or {}).get("max_prompt_chars")
        if limit is not None and self.prompt is not None and len(self.prompt) > limit:
            raise InvalidRequestError("prompt", f"at most {limit} characters (got {len(self.prompt)})")
        if limit is not None and self.prompt_ids is not None and len(self.prompt_ids) > limit:
            raise InvalidRequestError("prompt_ids", f"at most {limit} token ids (got {len(self.prompt_ids)})")
        return self

    @classmethod
    def parse(cls, fields: Mapping[str, Any], max_prompt_chars: int | None = None) -> GenerationRequest:
        """Validate a request given as plain fields; :class:`InvalidRequestError` naming the first
        bad field otherwise. ``max_prompt_chars``: the deployment's prompt size limit
        (``limits.max_prompt_chars``: characters of a text prompt, or token ids)."""
        try:
            return cls.model_validate(fields, context={"max_prompt_chars": max_prompt_chars})
        except ValidationError as error:
            raise invalid_request(error, cls) from None


# ----------------------------------------------------------------------------------------
class RequestStats(_Frozen):
    """Per-request measurements, reported with the final chunk."""

    strategy: str = Field(..., description="The strategy that served the request.")
    method: str | None = Field(None, description="Its verification rule; None for ar and ensemble.")
    prompt_tokens: int = Field(0, description="Tokens of the prompt.")
    completion_tokens: int = Field(0, description="Tokens generated.")
    target_calls: int = Field(0, description="Forward calls of the target (or of the verifying members).")
    model_calls: dict[str, int] = Field(default_factory=dict, description="Forward calls per model name.")
    accepted_lengths: list[int] = Field(default_factory=list, description="Accepted draft tokens per iteration.")
    draft_lengths: list[int] = Field(
        default_factory=list, description='Tokens drafted per iteration (per draft): gamma, or the choices of "auto".'
    )
    pre_drafted: int = Field(
        0, description="Iterations that verified a block drafted while the previous block was verified "
        "(engine.pre_drafting)."
    )
    block_efficiency: float = Field(0.0, description="Generated tokens per target call.")
    proposer: str | None = Field(
        None, description='The proposer that ran: sd "draft" or "ngram"; se "alternate" or the proposing model; '
        "None for the other strategies."
    )
    tokens_per_second: float = Field(0.0, description="Generated tokens over the request's wall-clock time.")
    time_draft_s: float = Field(
        0.0, description="Seconds in proposing forwards: the draft's (sd, multi_draft), the members' proposals (se)."
    )
    time_target_s: float = Field(
        0.0, description="Seconds in the other forwards: the target's, or the members' scoring (ensemble, se)."
    )
    time_verify_s: float = Field(0.0, description="Seconds in verification.")
    time_coordination_s: float = Field(
        0.0, description="The rest of the wall-clock time: calls between actors, scheduling, output."
    )
    bytes_moved: int = Field(0, description="Bytes of probability rows moved between actors.")
    proposed_tokens: dict[str, int] = Field(
        default_factory=dict, description='Tokens proposed by each model-free proposer ("prediction", "ngram").'
    )
    accepted_proposed: dict[str, int] = Field(
        default_factory=dict, description="Of them, the tokens verification accepted."
    )


class TokenLogprob(_Frozen):
    """A generated token's log-probability under the law it was sampled from (the target's for
    ar / sd / multi_draft, the ensemble's for ensemble / se), and the most likely alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = Field(default_factory=list, description="(token id, logprob), most likely first.")
    rank: int | None = Field(None, description="Prompt tokens: 1 + the number of tokens more likely than this one.")


class GenerationChunk(_Frozen):
    """A streamed piece of output: tokens accepted since the previous chunk."""

    request_id: str
    token_ids: list[int] = Field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] | None = Field(
        None, description="One per token of token_ids when the request asked for log-probabilities."
    )
    prompt_token_ids: list[int] | None = Field(
        None, description="The first chunk of a request with prompt_logprobs: the prompt's token ids."
    )
    prompt_logprobs: list[TokenLogprob] | None = Field(
        None, description="The first chunk of a request with prompt_logprobs: one per prompt token after the first."
    )
    prompt_tokens: int | None = Field(
        None, description="The request's prompt tokens (on every chunk of generated tokens; usage in every chunk)."
    )
    finished: bool = False
    finish_reason: FinishReason | None = None
    stats: RequestStats | None = None
    error: str | None = Field(None, description="Set when the request failed; the chunk is then final.")
    timed_out: bool = Field(False, description="With error: the request ran past limits.request_timeout_s.")
    retryable: bool = Field(
        False, description="With error: the request failed because a model worker became unavailable "
        "(it is being restarted); the same request can be sent again (HTTP 503 / gRPC UNAVAILABLE)."
    )
