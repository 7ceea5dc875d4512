"""Request, chunk and stats types exchanged between the serving layer and the Coordinator.

These are the only objects that cross the Serve ingress <-> Coordinator boundary. They are
pydantic models with ``extra="forbid"`` so a bad field is named in the error, and they are
plain data (picklable) so they travel through Ray unchanged.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, model_validator

from verifiers.ensemble import EnsembleKind  # the ensemble functions' vocabulary, defined once

Strategy = Literal["ar", "sd", "multi_draft", "ensemble", "se"]
FinishReason = Literal["stop", "length", "error"]

MAX_GAMMA = 32
MAX_DRAFTS = 8
MAX_TOP_LOGPROBS = 20
MAX_NGRAM = 16


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


class InvalidRequestError(ValueError):
    """A request parameter is invalid. ``field`` names it (dotted path), so the HTTP layer can
    answer 400 and the gRPC layer INVALID_ARGUMENT with a message that names the field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self):
        # Pickle by (field, message): the default would call cls(str(self)) and fail, so the
        # error could not cross a Ray actor boundary.
        return (type(self), (self.field, self.message))


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


class SamplingParams(_Frozen):
    """How tokens are drawn. Every strategy samples from exactly this law (losslessness)."""

    temperature: float = Field(1.0, ge=0.0, description="Softmax temperature; 0 means greedy (argmax).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass in (0, 1]; 1 disables it.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 disables it.")
    max_tokens: int = Field(
        64, ge=0, description="Maximum number of generated tokens; 0 (only with prompt_logprobs) scores the prompt alone."
    )
    stop: list[str] = Field(default_factory=list, description="Stop strings; generation ends before the first match.")
    seed: int | None = Field(None, ge=0, description="Seed of every random stream of the request; None picks one.")
    ignore_eos: bool = Field(False, description="Keep generating past the end-of-sequence token.")
    # The penalties' and logit_bias' ranges are checked where requests enter the server, with
    # every other value (cluster.validation.check_generation_request).
    presence_penalty: float = Field(
        0.0, description="Subtracted from the logit of every token already generated (OpenAI, -2..2)."
    )
    frequency_penalty: float = Field(
        0.0, description="Subtracted from a token's logit once per time it was generated (OpenAI, -2..2)."
    )
    repetition_penalty: float = Field(
        1.0,
        description="Logits of tokens in the prompt or the output are divided by it when positive, multiplied when "
        "negative (the transformers / vLLM extension), in (0, 10]; 1 disables it.",
    )
    logit_bias: dict[int, float] = Field(
        default_factory=dict, description="Token id -> value added to its logit before sampling (OpenAI, -100..100)."
    )
    min_p: float = Field(
        0.0, description="Drop tokens whose probability (after temperature and top-k) is below min_p times the "
        "row's largest, before top-p (vLLM's extension), in [0, 1]; 0 disables it.",
    )
    min_tokens: int = Field(
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
        None, description="Keep only the prompt's last this many tokens (>= 1); None keeps it whole."
    )
    logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS,
        description="Return each generated token's log-probability under the law it was sampled from, with this "
        "many most likely alternatives (0: the token alone); None: no log-probabilities.",
    )
    structured: StructuredOutput | None = Field(
        None, description="Constrain the output to a JSON schema, regex, choice or grammar; None: unconstrained."
    )
    prompt_logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS,
        description="Return each prompt token's log-probability (after the first) under the model's raw law (the "
        "target's, or the ensemble's for ensemble / se, at temperature 1 with no top-k / top-p / penalties), with "
        "this many most likely alternatives; None: none.",
    )


class SpeculationParams(_Frozen):
    """Which decoding strategy serves the request. Unset fields take the deployment's defaults."""

    strategy: Strategy | None = Field(None, description="ar | sd | multi_draft | ensemble | se.")
    method: str | None = Field(
        None,
        description=(
            "Verification rule: token | block | greedy_block (sd), token | block (se); "
            "spectr | sequential_gbv | spectr_gbv (multi_draft)."
        ),
    )
    gamma: GammaValue | None = Field(
        None,
        description='Draft block length (sd, multi_draft), or "auto": chosen before each draft from the '
        "request's acceptance so far, in [1, gamma_max] (lossless like any fixed gamma).",
    )
    gamma_max: int | None = Field(None, ge=1, le=MAX_GAMMA, description='Largest block "auto" may draft.')
    num_drafts: int | None = Field(None, ge=1, le=MAX_DRAFTS, description="K i.i.d. drafts (multi_draft).")
    ensemble: EnsembleKind | None = Field(None, description="weighted | contrastive (ensemble, se).")
    weights: list[float] | None = Field(None, description="Weighted ensemble weights, one per member, summing to 1.")
    mu: float | None = Field(None, ge=0.0, description="Contrastive strength: softmax(expert - mu * amateur).")
    gammas: list[int] | None = Field(
        None, description="Per-member proposal lengths (se with the alternate proposer; refused with a model proposer)."
    )
    members: list[str] | None = Field(None, description="Names of the ensemble members to use, in order.")
    proposer: str | None = Field(
        None, description='Who drafts. sd: "draft" (the deployment\'s draft model) or "ngram" (prompt lookup: '
        "drafts copied from the prompt and the output, no model; plain steps where nothing matches). se: "
        '"alternate" (the members in turn, each verified by the others) or the name of a deployment model (a '
        "draft, or one of the members) whose blocks every member scores in one forward and the ensemble law "
        "verifies with the request's method. Unset: the deployment's defaults.proposers.",
    )
    prompt_lookup_max: int | None = Field(
        None, ge=1, le=MAX_NGRAM, description="Longest n-gram prompt lookup and prediction realignment look up."
    )
    prompt_lookup_min: int | None = Field(
        None, ge=1, le=MAX_NGRAM, description="Shortest n-gram prompt lookup and prediction realignment look up."
    )


class GenerationRequest(_Frozen):
    """One generation request as the Coordinator receives it."""

    request_id: str = Field(..., min_length=1, description="Unique id, used in logs and session names.")
    prompt: str | None = Field(None, description="Prompt text (tokenized by the coordinator).")
    prompt_ids: list[int] | None = Field(None, description="Prompt token ids (instead of prompt).")
    sampling: SamplingParams = Field(default_factory=SamplingParams, description="Sampling parameters.")
    speculation: SpeculationParams = Field(
        default_factory=SpeculationParams, description="Strategy overrides; unset fields use the deployment defaults."
    )
    prediction: str | list[int] | None = Field(
        None, description="Predicted output (text or token ids): sd drafts it before its proposer (OpenAI's "
        "predicted outputs; the output law is unchanged).",
    )

    @model_validator(mode="after")
    def _exactly_one_prompt(self) -> GenerationRequest:
        if (self.prompt is None) == (self.prompt_ids is None):
            raise ValueError("exactly one of prompt and prompt_ids must be given")
        if self.prompt is not None and not self.prompt:
            raise ValueError("prompt must not be empty")
        if self.prompt_ids is not None and not self.prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        return self


class RequestStats(_Frozen):
    """Per-request measurements, reported with the final chunk."""

    strategy: str = Field(..., description="The strategy that served the request (ar, sd, multi_draft, ensemble, se).")
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
