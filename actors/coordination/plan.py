"""Resolve a request's speculation parameters against the deployment defaults.

A :class:`DecodingPlan` is the frozen, fully specified description of how one request is
decoded: which strategy, which verification rule, which models and block lengths. It is built
once per request by :func:`resolve_plan` before any model work. The values themselves were
checked when the request was parsed (the constraints of :mod:`actors.request_schema`: ranges, sizes,
weights summing to 1, distinct members); the plan applies the deployment's defaults and refuses
only what depends on them or on the deployment's models (a rule another strategy owns, a member
or proposer the deployment lacks, list lengths against the members), raising
:class:`actors.request_schema.InvalidRequestError` naming the field, so the serving layer can answer
400 / INVALID_ARGUMENT.

:class:`DecodingDefaults` is the ``defaults`` section of the deployment's YAML args, declared
here once (frozen pydantic, every field described) because the plan is what reads it;
``cluster.config`` uses it as its schema and validates it with :func:`resolve_plan` when the
configuration is loaded, so a bad YAML fails at start-up with the same message a bad request
would get.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from actors.request_schema import (
    MAX_DRAFTS,
    MAX_GAMMA,
    MAX_LIST_ITEMS,
    MAX_NGRAM,
    BlockLength,
    EnsembleKind,
    GammaValue,
    InvalidRequestError,
    Mu,
    Name,
    SpeculationParams,
    Strategy,
    Weight,
    check_distinct,
    check_weight_sum,
)
from verifiers.adaptive import AdaptiveGammaSettings
from verifiers.proposers import DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN, MODEL_FREE_METHODS
from verifiers.registry import MethodName

ModelRole = str  # "target" | "draft" | "member"

#: Verification rules each strategy accepts (the first one is the strategy's default rule).
STRATEGY_METHODS: dict[str, tuple[str, ...]] = {
    "ar": (),
    "sd": ("block", "token", "greedy_block"),
    # spectr_gbv is the published SpecTr-GBV (experimental: not lossless for K >= 2, see
    # verifiers.multi_draft); sequential_gbv is the lossless variant.
    "multi_draft": ("spectr", "sequential_gbv", "spectr_gbv"),
    "ensemble": (),
    "se": ("token", "block"),
}
MULTI_DRAFT_METHODS: tuple[str, ...] = STRATEGY_METHODS["multi_draft"]
#: ``speculation.proposer`` of se: the members propose in turn (Alg. 1 / 2 of the paper).
ALTERNATE = "alternate"
#: Rules of se with a draft proposer (the ensemble is sd's target): every rule of sd and multi_draft.
DRAFT_PROPOSER_METHODS: tuple[str, ...] = ("block", "token", "greedy_block", "spectr", "sequential_gbv", "spectr_gbv")
assert set(STRATEGY_METHODS) == set(get_args(Strategy)), "one strategy vocabulary: actors.request_schema.Strategy"
assert {m for methods in STRATEGY_METHODS.values() for m in methods} == set(get_args(MethodName)), \
    "one method vocabulary: verifiers.registry.MethodName"
#: Strategies whose tokens follow an ensemble of their members (the others follow the target).
ENSEMBLE_STRATEGIES: frozenset[str] = frozenset({"ensemble", "se"})

#: Who drafts for sd: the deployment's draft model, or prompt lookup (no model).
SdProposer = Literal["draft", "ngram"]


class StrategyProposers(BaseModel):
    """The default ``speculation.proposer`` of each strategy that has one (``defaults.proposers``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    sd: SdProposer = Field("draft", description="sd's (as speculation.proposer).")
    se: str = Field(ALTERNATE, description='se\'s (as speculation.proposer): "alternate", a draft or a member.')

    def of(self, strategy: str) -> str:
        """The default proposer of ``strategy`` ("draft" for the strategies without a choice)."""
        return self.se if strategy == "se" else self.sd if strategy == "sd" else "draft"


class DecodingDefaults(BaseModel):
    """Deployment-wide values for the fields of :class:`actors.request_schema.SpeculationParams` a request
    leaves unset (the ``defaults`` section of the YAML args)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    strategy: Strategy = Field("sd", description="ar | sd | multi_draft | ensemble | se.")
    method: str | None = Field(
        None,
        description="Verification rule of the default strategy (as speculation.method). Unset: the strategy's first rule.",
    )
    gamma: GammaValue = Field(
        4,
        description='Draft block length, or "auto" (as speculation.gamma); se: the default proposal length of each member.',
    )
    se_draft_gamma: GammaValue | None = Field(
        None,
        description='Block length, or "auto", of se with a model proposer when a request gives none. Unset: gamma. Every '
        "member scores the blocks: a longer one can pay than sd's.",
    )
    gamma_max: int = Field(8, ge=1, le=MAX_GAMMA, description='Largest block gamma "auto" may draft.')
    draft_cost_ratio: float = Field(
        0.07, ge=0.0, le=10.0,
        description='Time one more drafted token adds to an iteration, over one without drafts; gamma "auto" uses it '
        "until it has measured costs. 0.07: the embedded family on Ray; yours: sd's ms per iteration at two gammas.",
    )
    num_drafts: int = Field(2, ge=1, le=MAX_DRAFTS, description="Number of i.i.d. drafts K (multi_draft).")
    ensemble: EnsembleKind = Field("weighted", description="weighted | contrastive (ensemble, se).")
    members: tuple[Name, ...] | None = Field(
        None, max_length=MAX_LIST_ITEMS,
        description="Ensemble members in order (contrastive: expert, amateur). Unset: target then members.",
    )
    weights: tuple[Weight, ...] | None = Field(
        None, max_length=MAX_LIST_ITEMS, description="Weighted-ensemble weights, one per member, summing to 1."
    )
    mu: Mu = Field(0.1, description="Contrastive strength: softmax(expert - mu * amateur).")
    gammas: tuple[BlockLength, ...] | None = Field(
        None, max_length=MAX_LIST_ITEMS, description="Per-member proposal lengths (se). Unset: gamma for each."
    )
    proposer: str | None = Field(
        None,
        description="Proposer of the default strategy (as speculation.proposer). Unset: proposers.<strategy>; set, it "
        "must agree with proposers.<strategy> when that is set too.",
    )
    proposers: StrategyProposers = Field(
        default_factory=StrategyProposers,
        description="Each strategy's proposer when a request names none (sd and se keep their own, whichever is the "
        "default).",
    )
    prompt_lookup_max: int = Field(
        DEFAULT_NGRAM_MAX, ge=1, le=MAX_NGRAM, description="Longest n-gram of prompt lookup and prediction realignment."
    )
    prompt_lookup_min: int = Field(
        DEFAULT_NGRAM_MIN, ge=1, le=MAX_NGRAM, description="Shortest n-gram of prompt lookup and prediction realignment."
    )

    _weights_sum_to_one = field_validator("weights")(check_weight_sum)
    _distinct_members = field_validator("members")(check_distinct)

    @model_validator(mode="after")
    def _one_default_proposer(self) -> DecodingDefaults:
        named = self.proposers.model_fields_set
        if self.proposer is not None and self.strategy in named and self.proposers.of(self.strategy) != self.proposer:
            raise ValueError(f"proposer {self.proposer!r} and proposers.{self.strategy} "
                             f"{self.proposers.of(self.strategy)!r} disagree on the default strategy's proposer")
        return self


@dataclass(frozen=True)
class DecodingPlan:
    """How one request is decoded (all defaults applied, all values checked).

    target / draft: model names of the verifier and the proposer (sd, multi_draft; the target
    alone for ar). members / weights / gammas: ensemble members in order (ensemble, se);
    ``gammas[i]`` is member i's proposal length (se); for contrastive, members[0] is the expert
    and members[1] the amateur. adaptive: set when gamma is "auto" (sd, multi_draft, se); ``gamma``
    is then the largest block it may draft. proposer / ngram: sd's drafter ("draft": ``draft``;
    "ngram": prompt lookup, ``draft`` None) and the n-gram sizes of its lookups and of a
    prediction's realignment (``(max, min)``); ``prediction``: the request brought one (sd only).
    For se, proposer is ``"alternate"``, or the model that drafts blocks for the ensemble law (also
    in ``draft``; ``gamma`` / ``adaptive`` / ``num_drafts`` then mean what they mean in sd).
    """

    strategy: str
    method: str | None
    target: str | None
    draft: str | None
    gamma: int
    num_drafts: int
    ensemble: str | None
    members: tuple[str, ...]
    weights: tuple[float, ...] | None
    mu: float
    gammas: tuple[int, ...]
    adaptive: AdaptiveGammaSettings | None = None
    proposer: str = "draft"
    ngram: tuple[int, int] = (DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN)
    prediction: bool = False

    @property
    def models(self) -> tuple[str, ...]:
        """Every model the plan uses, each once, in a stable order."""
        names = [n for n in (self.target, self.draft) if n is not None] + list(self.members)
        return tuple(dict.fromkeys(names))


def _pick(value, default):
    return default if value is None else value


def _check_method(strategy: str, requested: str | None, default: str | None, default_strategy: str) -> str | None:
    valid = STRATEGY_METHODS[strategy]
    if not valid:
        if requested is not None:
            raise InvalidRequestError("speculation.method", f"strategy {strategy!r} takes no method, got {requested!r}")
        return None
    if requested is not None:
        if requested not in valid:
            raise InvalidRequestError(
                "speculation.method",
                f"unknown method {requested!r} for strategy {strategy!r}; expected one of {', '.join(valid)}",
            )
        return requested
    # The deployment's default method belongs to its default strategy; any other strategy
    # uses its own default rule (the first of STRATEGY_METHODS).
    if default is not None and strategy == default_strategy and default in valid:
        return default
    return valid[0]


def _resolve_members(requested, default, models: Mapping[str, ModelRole], strategy: str, ensemble: str) -> tuple[str, ...]:
    members = _pick(requested, default)
    if members is None:
        target = [name for name, role in models.items() if role == "target"]
        others = [name for name, role in models.items() if role == "member"]
        members = target + others
    members = tuple(members)
    unknown = [m for m in members if m not in models]
    if unknown:
        raise InvalidRequestError(
            "speculation.members",
            f"members {unknown} are not in the deployment; available models: {', '.join(models)}",
        )
    if len(members) < 2:
        raise InvalidRequestError("speculation.members", f"strategy {strategy!r} needs at least 2 members, got {list(members)}")
    if ensemble == "contrastive" and len(members) != 2:
        raise InvalidRequestError(
            "speculation.members",
            f"contrastive ensembles take exactly 2 members (expert, amateur), got {list(members)}",
        )
    return members


def _resolve_weights(requested, default, members: tuple[str, ...], ensemble: str) -> tuple[float, ...] | None:
    weights = requested if requested is not None else (default if default is not None and len(default) == len(members) else None)
    if weights is None:
        return None if ensemble == "contrastive" else tuple(1.0 / len(members) for _ in members)
    if ensemble == "contrastive":
        raise InvalidRequestError("speculation.weights", "weights apply to weighted ensembles only")
    weights = tuple(float(w) for w in weights)
    if len(weights) != len(members):
        raise InvalidRequestError(
            "speculation.weights", f"expected {len(members)} weights (one per member), got {len(weights)}"
        )
    return weights


def _resolve_gammas(requested, default, members: tuple[str, ...], gamma: int) -> tuple[int, ...]:
    gammas = requested if requested is not None else (default if default is not None and len(default) == len(members) else None)
    if gammas is None:
        return tuple(gamma for _ in members)
    gammas = tuple(int(g) for g in gammas)
    if len(gammas) != len(members):
        raise InvalidRequestError(
            "speculation.gammas", f"expected {len(members)} gammas (one per member), got {len(gammas)}"
        )
    return gammas


def _resolve_gamma(
    speculation: SpeculationParams, defaults: DecodingDefaults, drafted_ensemble: bool = False
) -> tuple[int, AdaptiveGammaSettings | None]:
    """``(gamma, adaptive)``: a fixed block, or for ``"auto"`` the settings of
    :mod:`verifiers.adaptive` and its largest block. ``drafted_ensemble``: se with a model
    proposer, whose default is ``defaults.se_draft_gamma`` when set."""
    default = defaults.se_draft_gamma if drafted_ensemble and defaults.se_draft_gamma is not None else defaults.gamma
    gamma = _pick(speculation.gamma, default)
    if gamma != "auto":  # both models validate gamma as GammaValue: an int or "auto"
        return gamma, None
    gamma_max = _pick(speculation.gamma_max, defaults.gamma_max)
    return gamma_max, AdaptiveGammaSettings(gamma_max=gamma_max, draft_cost_ratio=defaults.draft_cost_ratio)


def _check_draft_proposer_method(requested: str | None, defaults: DecodingDefaults) -> str:
    """The rule of se with a draft proposer: the request's, else the deployment's default when
    it is one of these rules, else block."""
    if requested is not None and requested not in DRAFT_PROPOSER_METHODS:
        raise InvalidRequestError(
            "speculation.method",
            f"unknown method {requested!r} for se with a draft proposer; expected one of {', '.join(DRAFT_PROPOSER_METHODS)}",
        )
    method = requested if requested is not None else (
        defaults.method if defaults.strategy == "se" and defaults.method in DRAFT_PROPOSER_METHODS else "block")
    return method


def _role_model(models: Mapping[str, ModelRole], role: str, strategy: str) -> str:
    names = [name for name, model_role in models.items() if model_role == role]
    if not names:
        raise InvalidRequestError("speculation.strategy", f"strategy {strategy!r} needs a {role} model; the deployment has none")
    return names[0]


def _default_proposer(strategy: str, defaults: DecodingDefaults) -> str:
    """The deployment's proposer for ``strategy``: ``defaults.proposer`` for the default strategy,
    else that strategy's entry of ``defaults.proposers`` (sd: "draft", se: "alternate" unless set)."""
    if defaults.proposer is not None and strategy == defaults.strategy:
        return defaults.proposer
    return defaults.proposers.of(strategy)


def _resolve_proposer(speculation: SpeculationParams, defaults: DecodingDefaults, strategy: str,
                      models: Mapping[str, ModelRole]) -> tuple[str, tuple[int, int]]:
    """The proposer (sd: "draft" or "ngram"; se: "alternate" or a model of the deployment) and
    the n-gram sizes ``(max, min)``; a proposer named for another strategy is refused. A model
    proposing for se shares the members' vocabulary: every model of a group does (checked when
    the group starts, ``actors.vocabulary``)."""
    proposer = _pick(speculation.proposer, _default_proposer(strategy, defaults))
    if strategy == "se":
        if proposer != ALTERNATE and proposer not in models:
            raise InvalidRequestError(
                "speculation.proposer",
                f"unknown proposer {proposer!r} for se; expected {ALTERNATE!r} or a model of the deployment: "
                f"{', '.join(models)}",
            )
    elif proposer not in get_args(SdProposer):
        raise InvalidRequestError("speculation.proposer", f'expected "draft" or "ngram", got {proposer!r}')
    if speculation.proposer == "ngram" and strategy != "sd":
        raise InvalidRequestError("speculation.proposer", f'"ngram" drafts for sd, not for strategy {strategy!r}')
    largest = _pick(speculation.prompt_lookup_max, defaults.prompt_lookup_max)
    smallest = _pick(speculation.prompt_lookup_min, defaults.prompt_lookup_min)
    if smallest > largest:
        field = "speculation.prompt_lookup_min" if speculation.prompt_lookup_min is not None else "speculation.prompt_lookup_max"
        raise InvalidRequestError(field, f"prompt_lookup_min ({smallest}) must be at most prompt_lookup_max ({largest})")
    return (proposer if strategy in ("sd", "se") else "draft"), (largest, smallest)


def _model_free_method(method: str | None, requested: str | None) -> str | None:
    """sd with a model-free proposal: the deployment's rule unless it is one a one-hot draft
    cannot take (greedy block: then block); a request naming such a rule is refused."""
    if method in MODEL_FREE_METHODS:
        return method
    if requested is not None:
        raise InvalidRequestError(
            "speculation.method", f"predictions and prompt lookup are verified with {' or '.join(MODEL_FREE_METHODS)}, "
            f"not {requested!r}"
        )
    return "block"


def resolve_plan(
    speculation: SpeculationParams, defaults: DecodingDefaults, models: Mapping[str, ModelRole],
    prediction: bool = False,
) -> DecodingPlan:
    """Apply ``defaults`` to the unset fields of ``speculation`` (whose values its model checked)
    and check the result against the deployment's ``models`` (name -> role). ``prediction``:
    the request has a predicted output (sd drafts it first). Raises InvalidRequestError naming
    the field."""
    strategy = _pick(speculation.strategy, defaults.strategy)
    proposer, ngram = _resolve_proposer(speculation, defaults, strategy, models)
    drafted_ensemble = strategy == "se" and proposer != ALTERNATE
    method = (_check_draft_proposer_method(speculation.method, defaults) if drafted_ensemble
              else _check_method(strategy, speculation.method, defaults.method, defaults.strategy))
    prediction = prediction and strategy == "sd"
    if prediction or proposer == "ngram":
        method = _model_free_method(method, speculation.method)
    gamma, adaptive = _resolve_gamma(speculation, defaults, drafted_ensemble)
    num_drafts = _pick(speculation.num_drafts, defaults.num_drafts)
    mu = float(_pick(speculation.mu, defaults.mu))
    target = draft = ensemble = weights = None
    members: tuple[str, ...] = ()
    gammas: tuple[int, ...] = ()
    if strategy not in ENSEMBLE_STRATEGIES:
        target = _role_model(models, "target", strategy)
        if strategy == "multi_draft" or (strategy == "sd" and proposer == "draft" and not prediction):
            draft = _role_model(models, "draft", strategy)
        elif strategy == "sd" and proposer == "draft":  # a prediction first, then the draft model if there is one
            draft = next((name for name, role in models.items() if role == "draft"), None)
    else:
        ensemble = _pick(speculation.ensemble, defaults.ensemble)
        members = _resolve_members(speculation.members, defaults.members, models, strategy, ensemble)
        weights = _resolve_weights(speculation.weights, defaults.weights, members, ensemble)
        if drafted_ensemble:
            if speculation.gammas is not None:
                raise InvalidRequestError(
                    "speculation.gammas",
                    f"gammas are the alternate proposer's lengths; this request's proposer is {proposer!r} "
                    '(give gamma, or proposer "alternate")',
                )
            draft = proposer
        # gamma "auto" of the alternate proposer: the request's gammas (else 1 each) where proposals
        # pay, the plain ensemble's steps where the measured goodput says they do not
        gammas = _resolve_gammas(speculation.gammas, defaults.gammas, members, 1 if adaptive is not None else gamma)
    return DecodingPlan(
        strategy=strategy,
        method=method,
        target=target,
        draft=draft,
        gamma=gamma,
        num_drafts=num_drafts if strategy == "multi_draft" or (drafted_ensemble and method in MULTI_DRAFT_METHODS) else 1,
        ensemble=ensemble,
        members=members,
        weights=weights,
        mu=mu,
        gammas=gammas,
        adaptive=adaptive if strategy in ("sd", "multi_draft", "se") else None,
        proposer=proposer,
        ngram=ngram,
        prediction=prediction,
    )
