"""What one benchmark run measures: its settings and the list of cases it runs side by side.

A *case* is one way of producing ``max_tokens`` tokens for a prompt, e.g. ``sd`` with block
verification at gamma 4 on separate Ray actors (``ray:sd/block/g4``), the same in one process
(``local:sd/block/g4``), or transformers assisted generation (``hf:peer/assisted/g4``). A gamma
of ``auto`` in ``gammas`` adds the sd cases with the adaptive draft length (``ray:sd/block/gauto``:
``gamma: "auto"``, ``gamma_max`` = ``settings.gamma_max`` or the largest fixed gamma of the run),
sent through the coordinator like any other request; the peer has no such case. Every
case names the case its speedup is measured against (``baseline``): ``ar`` of the same mode for
``sd`` and ``multi_draft``; the standard ensemble of the same kind and members for ``se``;
transformers' own sampling loop for the peer.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from actors.request_schema import GammaValue, SpeculationParams, Strategy
from actors.coordination.plan import STRATEGY_METHODS

Mode = Literal["ray", "local", "hf"]
MODES: tuple[Mode, ...] = ("ray", "local", "hf")
#: The rules the coordinator accepts per strategy (``actors.coordination.plan.STRATEGY_METHODS``).
SINGLE_DRAFT_METHODS: tuple[str, ...] = STRATEGY_METHODS["sd"]
MULTI_DRAFT_METHODS: tuple[str, ...] = STRATEGY_METHODS["multi_draft"]
SE_METHODS: tuple[str, ...] = STRATEGY_METHODS["se"]
#: The coordinator's strategies, and the peer engine.
STRATEGIES: tuple[str, ...] = (*get_args(Strategy), "peer")


class BenchSettings(BaseModel):
    """Everything that defines a benchmark run (recorded in results.json)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_prompts: int | None = Field(None, ge=1, description="Use the first N prompts of the set; None: all of them.")
    max_prompt_tokens: int | None = Field(
        None, ge=1, description="Keep only the last N tokens of each prompt (for small-context models); None: whole prompts."
    )
    max_tokens: int = Field(64, ge=1, description="Tokens generated per prompt by every case (EOS ignored).")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature of every case (no top-k / top-p).")
    seed: int = Field(0, ge=0, description="Base seed: prompt i of repeat r uses seed + 1000 * r + i in every case.")
    repeats: int = Field(1, ge=1, description="Passes over the prompt set (each with its own seeds).")
    warmup_tokens: int = Field(16, ge=1, description="Tokens of the untimed warm-up run of every case.")
    modes: tuple[Mode, ...] = Field(MODES, min_length=1, description="ray (separate actors), local (one process), hf (peer).")
    gammas: tuple[GammaValue, ...] = Field(
        (2, 4, 8), min_length=1,
        description='Draft lengths of sd and of the peer; "auto": sd with the adaptive draft length (no peer case).')
    gamma_max: int | None = Field(
        None, ge=1, description='Largest block of the "auto" cases; None: the largest fixed gamma of the run (the '
        "deployment's default when there is none).")
    sd_methods: tuple[str, ...] = Field(SINGLE_DRAFT_METHODS, description="Single-draft verification rules.")
    multi_draft_methods: tuple[str, ...] | None = Field(
        None, description="Multi-draft verification rules; None: every rule the coordinator accepts for multi_draft."
    )
    num_drafts: tuple[int, ...] = Field((2, 3), description="K values of multi_draft.")
    multi_draft_gamma: int = Field(4, ge=1, description="Draft length of multi_draft.")
    ensemble_sizes: tuple[int, ...] = Field((2, 3), description="Member counts of the weighted ensembles.")
    contrastive_mu: float = Field(0.1, ge=0.0, description="Contrastive strength mu (2 members: expert, amateur).")
    se_gammas: tuple[int, ...] = Field(
        (1, 5), min_length=1,
        description="se variants: proposal length g of every member but the first (the target / expert), which "
        "proposes 1 token (Fu et al. 2025, Sec. 4.1: gamma in {1, 5} for the proposal model, the other fixed at 1; "
        "g = 1 everywhere is Corollary 3.7's never-slower setting).",
    )
    se_method: str = Field("token", description="Verification rule of se (token | block).")
    weighted_members: tuple[str, ...] | None = Field(
        None, description="Members of the weighted ensembles (first n used); None: the target, then the member models."
    )
    contrastive_members: tuple[str, str] | None = Field(
        None, description="(expert, amateur); None: the target and the last member model."
    )
    strategies: tuple[str, ...] = Field(
        STRATEGIES, min_length=1, description="Strategies to run (ar is always run when sd or multi_draft is)."
    )

    @model_validator(mode="after")
    def _known_methods(self) -> BenchSettings:
        for method in self.sd_methods:
            if method not in SINGLE_DRAFT_METHODS:
                raise ValueError(f"sd_methods: unknown method {method!r}; expected {SINGLE_DRAFT_METHODS}")
        for method in self.multi_draft_methods or ():
            if method not in MULTI_DRAFT_METHODS:
                raise ValueError(f"multi_draft_methods: unknown method {method!r}; expected {MULTI_DRAFT_METHODS}")
        unknown = [name for name in self.strategies if name not in STRATEGIES]
        if unknown:
            raise ValueError(f"strategies: unknown {unknown}; expected a subset of {STRATEGIES}")
        if self.se_method not in SE_METHODS:
            raise ValueError(f"se_method: expected token or block, got {self.se_method!r}")
        if len(set(self.gammas)) != len(self.gammas):
            raise ValueError(f"gammas: each draft length once, got {self.gammas}")
        return self

    @property
    def fixed_gammas(self) -> tuple[int, ...]:
        return tuple(g for g in self.gammas if g != "auto")

    def auto_gamma_max(self) -> int | None:
        """``gamma_max`` of the auto cases: the setting, else the largest fixed gamma (None: the deployment's)."""
        if self.gamma_max is not None:
            return self.gamma_max
        return max(self.fixed_gammas) if self.fixed_gammas else None


QUICK_SETTINGS = {"num_prompts": 4, "max_tokens": 48, "warmup_tokens": 8}
"""Overrides of ``--quick``: the same cases on fewer prompts and tokens."""


class BenchCase(BaseModel):
    """One way of generating: a strategy (or the peer) in one execution mode."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Mode = Field(..., description="ray | local | hf.")
    label: str = Field(..., description="Mode-independent name, e.g. 'sd/block/g4'.")
    group: str = Field(..., description="ar | sd | multi_draft | ensemble | se | peer (table grouping).")
    speculation: SpeculationParams | None = Field(None, description="Request overrides (ray and local modes).")
    peer_gamma: int | None = Field(None, description="Assistant tokens per iteration (peer); None: plain sampling.")
    baseline: str | None = Field(None, description="Key of the case this one's speedup is measured against.")

    @property
    def key(self) -> str:
        return f"{self.mode}:{self.label}"


def resolve_members(settings: BenchSettings, roles: dict[str, str]) -> tuple[tuple[str, ...], tuple[str, str] | None]:
    """Weighted-ensemble members (in order) and the contrastive (expert, amateur) pair."""
    target = [name for name, role in roles.items() if role == "target"]
    members = [name for name, role in roles.items() if role == "member"]
    weighted = settings.weighted_members or tuple(target + members)
    contrastive = settings.contrastive_members
    if contrastive is None and target and members:
        contrastive = (target[0], members[-1])
    return tuple(weighted), contrastive


def build_cases(settings: BenchSettings, roles: dict[str, str]) -> list[BenchCase]:
    """Every case of the run, in a fixed order (the harness shuffles it per prompt)."""
    has_draft = "draft" in roles.values()
    cases: list[BenchCase] = []
    for mode in settings.modes:
        if mode == "hf":
            if "peer" in settings.strategies and has_draft:
                cases.extend(_peer_cases(settings))
            continue
        cases.extend(_strategy_cases(settings, roles, mode, has_draft))
    return cases


def _strategy_cases(settings: BenchSettings, roles: dict[str, str], mode: Mode, has_draft: bool) -> list[BenchCase]:
    wanted = set(settings.strategies)
    ar_key = f"{mode}:ar"
    cases = []
    if wanted & {"ar", "sd", "multi_draft"}:
        cases.append(BenchCase(mode=mode, label="ar", group="ar", speculation=SpeculationParams(strategy="ar"),
                               baseline=ar_key))
    if has_draft and "sd" in wanted:
        for method in settings.sd_methods:
            for gamma in settings.gammas:
                limit = settings.auto_gamma_max() if gamma == "auto" else None
                cases.append(BenchCase(
                    mode=mode, label=f"sd/{method}/g{gamma}", group="sd", baseline=ar_key,
                    speculation=SpeculationParams(strategy="sd", method=method, gamma=gamma, gamma_max=limit),
                ))
    if has_draft and "multi_draft" in wanted:
        for method in settings.multi_draft_methods or MULTI_DRAFT_METHODS:
            for num_drafts in settings.num_drafts:
                cases.append(BenchCase(
                    mode=mode, label=f"multi_draft/{method}/k{num_drafts}/g{settings.multi_draft_gamma}",
                    group="multi_draft", baseline=ar_key,
                    speculation=SpeculationParams(
                        strategy="multi_draft", method=method, gamma=settings.multi_draft_gamma, num_drafts=num_drafts
                    ),
                ))
    if wanted & {"ensemble", "se"}:
        cases.extend(_ensemble_cases(settings, roles, mode))
    return cases


def _ensemble_cases(settings: BenchSettings, roles: dict[str, str], mode: Mode) -> list[BenchCase]:
    """The standard ensemble (always: it is se's baseline) and se, per ensemble configuration."""
    weighted, contrastive = resolve_members(settings, roles)
    ensembles: list[tuple[str, dict]] = []
    for size in settings.ensemble_sizes:
        if len(weighted) >= size:
            members = list(weighted[:size])
            ensembles.append((f"weighted/n{size}", {"ensemble": "weighted", "members": members,
                                                    "weights": [1.0 / size] * size}))
    if contrastive is not None:
        ensembles.append(("contrastive/n2", {"ensemble": "contrastive", "members": list(contrastive),
                                             "mu": settings.contrastive_mu}))
    cases = []
    for name, params in ensembles:
        ensemble_key = f"{mode}:ensemble/{name}"
        cases.append(BenchCase(mode=mode, label=f"ensemble/{name}", group="ensemble", baseline=ensemble_key,
                               speculation=SpeculationParams(strategy="ensemble", **params)))
        if "se" not in settings.strategies:
            continue
        for gamma in settings.se_gammas:
            gammas = [1] + [gamma] * (len(params["members"]) - 1)
            cases.append(BenchCase(
                mode=mode, label=f"se/{name}/g{gamma}", group="se", baseline=ensemble_key,
                speculation=SpeculationParams(strategy="se", method=settings.se_method, proposer="alternate",
                                              gammas=gammas, **params),
            ))
    return cases


def _peer_cases(settings: BenchSettings) -> list[BenchCase]:
    ar_key = "hf:peer/ar"
    cases = [BenchCase(mode="hf", label="peer/ar", group="peer", baseline=ar_key)]
    for gamma in settings.fixed_gammas:  # transformers has no "auto" of this kind
        cases.append(BenchCase(mode="hf", label=f"peer/assisted/g{gamma}", group="peer", peer_gamma=gamma, baseline=ar_key))
    return cases
