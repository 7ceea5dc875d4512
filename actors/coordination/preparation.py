"""A request checked against the deployment, then made ready for the scheduler.

A request's values are checked by the request models' own constraints (:mod:`actors.request_schema`);
:class:`RequestPreparer` checks what depends on the deployment: the tokenizer (a text prompt, stop
strings, a structured output's grammar, a text prediction), the group's vocabulary and the models'
context, and the plan resolved against the configured models (:func:`actors.coordination.plan.resolve_plan`),
raising :class:`actors.request_schema.InvalidRequestError` naming the field; then builds the request's
:class:`actors.coordination.request_state.RequestState`: its machine (:mod:`actors.coordination.strategies`),
the sessions it opens on the workers and its output tracker.
"""

from __future__ import annotations

import secrets
import uuid
from typing import Any

from actors.request_schema import GenerationRequest, InvalidRequestError
from actors.coordination.output import OutputTracker
from actors.coordination.plan import DecodingPlan, resolve_plan
from actors.coordination.request_state import RequestState
from actors.coordination.strategies import MachineSampling, build_machine
from actors.messages import OpenSession, RowSampling, WorkerInfo
from verifiers.grammar import GrammarConstraint, GrammarError, compile_constraint
from verifiers.penalties import Penalties


class RequestPreparer:
    """The deployment's checks of a request and the building of its state: ``config`` is the
    group's :class:`cluster.config.GroupConfig`, ``tokenizer`` its tokenizer (None: token ids
    only), ``eos_token_ids`` the ids that end a completion."""

    def __init__(self, config: Any, tokenizer: Any, eos_token_ids: frozenset[int]):
        self.config = config
        self.roles = dict(config.roles)
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids

    def _tokenize(self, request: GenerationRequest) -> list[int]:
        if request.prompt_ids is not None:
            return [int(t) for t in request.prompt_ids]
        if self.tokenizer is None:
            raise InvalidRequestError("prompt", "this deployment has no tokenizer; send prompt_ids")
        # The tokenizer's own convention (e.g. a BOS token for models trained with one), as
        # model.generate users would tokenize.
        return list(self.tokenizer(request.prompt)["input_ids"])

    def _prompt_ids(self, request: GenerationRequest) -> list[int]:
        """The prompt's token ids, cut to their last ``truncate_prompt_tokens`` when set."""
        prompt_ids = self._tokenize(request)
        keep = request.sampling.truncate_prompt_tokens
        return prompt_ids if keep is None else prompt_ids[-keep:]

    def _prediction_ids(self, request: GenerationRequest, vocab_limit: int) -> tuple[int, ...]:
        """The predicted output's token ids (text: tokenized without special tokens), () for none."""
        prediction = request.prediction
        if prediction is None:
            return ()
        if isinstance(prediction, str):
            if self.tokenizer is None:
                raise InvalidRequestError("prediction", "a text prediction needs a tokenizer; this deployment has none")
            return tuple(self.tokenizer(prediction, add_special_tokens=False)["input_ids"])
        bad = [t for t in prediction if not 0 <= t < vocab_limit]
        if bad:
            raise InvalidRequestError("prediction", f"token ids must lie in [0, {vocab_limit}), got {bad[:5]}")
        return tuple(prediction)

    def plan(self, request: GenerationRequest) -> DecodingPlan:
        """The request's plan, resolved once against the deployment (raises InvalidRequestError)."""
        return resolve_plan(request.speculation, self.config.defaults, self.roles, prediction=request.prediction is not None)

    def prepare(self, request: GenerationRequest, plan: DecodingPlan, infos: dict[str, WorkerInfo],
                vocab_limit: int) -> tuple[list[int], int, int]:
        """Check everything about a request under its resolved plan, against the workers' ``infos``
        and the group's ``vocab_limit`` (the tokenizer's real tokens; padded embedding rows are
        masked); returns (prompt ids, vocab_limit, the context a request may use); raises
        InvalidRequestError."""
        prompt_ids = self._prompt_ids(request)
        if not prompt_ids:
            raise InvalidRequestError("prompt", "the prompt tokenizes to no tokens")
        bad = [t for t in prompt_ids if not 0 <= t < vocab_limit]
        if bad:
            raise InvalidRequestError("prompt_ids", f"token ids must lie in [0, {vocab_limit}), got {bad[:5]}")
        # Each worker reports the context a request may use there (engine.max_model_len when set).
        max_context = min(infos[name].max_context for name in plan.models)
        limit = self._context_name(max_context)
        if len(prompt_ids) >= max_context:
            raise InvalidRequestError(
                "prompt", f"the prompt has {len(prompt_ids)} tokens; the {limit} is {max_context}"
            )
        sampling = request.sampling
        if len(prompt_ids) + sampling.max_tokens > max_context:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({sampling.max_tokens}) exceeds the {limit} "
                f"({max_context}); at most {max_context - len(prompt_ids)}",
            )
        if sampling.stop and self.tokenizer is None:
            raise InvalidRequestError("stop", "stop strings need a tokenizer; this deployment has none")
        bad_bias = [t for t in sampling.logit_bias if not 0 <= t < vocab_limit]
        if bad_bias:
            raise InvalidRequestError("logit_bias", f"token ids must lie in [0, {vocab_limit}), got {bad_bias[:5]}")
        self._grammar(sampling, request.request_id)
        self._prediction_ids(request, vocab_limit)
        return prompt_ids, vocab_limit, max_context

    def _grammar(self, sampling, request_key: str) -> GrammarConstraint | None:
        """The request's structured-output constraint over the group's tokenizer (cached per
        grammar), or None; raises InvalidRequestError naming the field it came from."""
        structured = sampling.structured
        if structured is None:
            return None
        if self.config.tokenizer_path is None:
            raise InvalidRequestError(structured.field, "structured outputs need a tokenizer; this deployment has none")
        try:
            return compile_constraint(structured.kind, structured.spec, self.config.tokenizer_path, request_key)
        except GrammarError as error:
            raise InvalidRequestError(structured.field, str(error)) from None

    def _context_name(self, max_context: int) -> str:
        """How a 400 names the context limit: ``max_model_len`` when that setting is the limit."""
        max_model_len = getattr(self.config, "max_model_len", None)
        return "max_model_len" if max_model_len == max_context else "model context"

    def request_state(
        self, request: GenerationRequest, plan: DecodingPlan, prompt_ids: list[int], vocab_limit: int, max_context: int
    ) -> RequestState:
        """The scheduler's state of a prepared request (:meth:`prepare`): its machine, the
        sessions it opens and its output tracker."""
        sampling = request.sampling
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(62)
        penalties = Penalties(
            presence=sampling.presence_penalty,
            frequency=sampling.frequency_penalty,
            repetition=sampling.repetition_penalty,
            logit_bias=tuple(sorted((int(t), float(b)) for t, b in sampling.logit_bias.items())),
            min_tokens=sampling.min_tokens,
            eos_ids=tuple(sorted(self.eos_token_ids)),
            min_p=sampling.min_p,
            grammar=self._grammar(sampling, f"{request.request_id}/{uuid.uuid4().hex[:12]}"),
        )
        built = build_machine(
            plan,
            MachineSampling(sampling.temperature, sampling.top_k, sampling.top_p, penalties, tuple(prompt_ids),
                            sampling.logprobs, self._prediction_ids(request, vocab_limit) if plan.prediction else ()),
            seed=seed,
            max_new_tokens=sampling.max_tokens,
            context_budget=max_context - len(prompt_ids),
        )
        row_sampling = RowSampling(sampling.temperature, sampling.top_k, sampling.top_p, vocab_limit, penalties,
                                   precision=self.config.row_precision)
        opens = {
            model: OpenSession(tuple(prompt_ids), row_sampling, dict(seeds))
            for model, seeds in built.worker_seeds.items()
        }
        output = OutputTracker(
            self.tokenizer,
            max_tokens=sampling.max_tokens,
            stop=sampling.stop,
            eos_token_ids=self.eos_token_ids,
            ignore_eos=sampling.ignore_eos,
            min_tokens=sampling.min_tokens,
            skip_special_tokens=sampling.skip_special_tokens,
            spaces_between_special_tokens=sampling.spaces_between_special_tokens,
            include_stop_str_in_output=sampling.include_stop_str_in_output,
        )
        return RequestState(
            request_id=request.request_id,
            session_id=f"{request.request_id}/{uuid.uuid4().hex[:12]}",
            plan=plan,
            machine=built.machine,
            output=output,
            prompt_ids=prompt_ids,
            opens=opens,
            vocab_limit=vocab_limit,
            grammar=penalties.grammar,
        )
