"""What a serving-load run measures: its settings (recorded in results.json) and its cases, the
``speculation`` object each level's requests carry (:mod:`benchmarks.served.serve_load` runs them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SERVE_LOAD_STRATEGIES = ("ar", "sd", "multi_draft", "ensemble", "se")


class ServeLoadSettings(BaseModel):
    """Everything that defines a serving-load run (recorded in results.json)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    concurrency: tuple[int, ...] = Field((1, 4, 16, 32), min_length=1, description="Concurrent clients per level.")
    strategies: tuple[str, ...] = Field(("ar", "sd", "multi_draft", "se"), min_length=1,
                                        description=f"Subset of {SERVE_LOAD_STRATEGIES}.")
    max_tokens: int = Field(48, ge=1, description="Tokens per request (EOS ignored).")
    requests_per_level: int | None = Field(
        None, ge=1, description="Measured requests per level; None: max(32, 4 x concurrency).")
    warmup_tokens: int = Field(16, ge=1, description="Tokens of the untimed warm-up request of each level.")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature (no top-k / top-p).")
    seed: int = Field(0, ge=0, description="Request i of a level uses seed + i.")
    num_prompts: int | None = Field(None, ge=1, description="Use the first N prompts of the set; None: all.")
    sd_method: str = "block"
    sd_gamma: int = Field(4, ge=1)
    sd_gammas: tuple[int | Literal["auto"], ...] = Field(
        (), description="sd cases, one per block length (an int, or auto: gamma \"auto\" up to gamma_max); "
        "empty: one case of sd_gamma.")
    gamma_max: int = Field(8, ge=1, description="Largest block of the sd auto case.")
    multi_draft_method: str = "spectr"
    num_drafts: int = Field(2, ge=1)
    multi_draft_gamma: int = Field(4, ge=1)
    se_method: str = "token"
    se_gamma: int | Literal["auto"] = Field(
        1, description='Proposal length of the alternate se\'s non-first member (the first proposes 1), or "auto": '
        "gamma auto (gammas 1 each, plain ensemble steps where the measured goodput says proposals do not pay).")
    se_proposers: tuple[str, ...] = Field(
        ("alternate",), min_length=1,
        description='se cases, one per proposer: "alternate" (the members in turn, gammas [1, se_gamma]) or a model '
        "of the config (a draft or a member: blocks of se_draft_gamma verified against the ensemble law).")
    se_draft_method: str = Field("block", description="Verification rule of se with a model proposer.")
    se_draft_gamma: int | Literal["auto"] = Field(
        4, description='Block length of se with a model proposer, or "auto" (up to gamma_max).')
    request_timeout_s: float = Field(300.0, gt=0, description="Bound on one request, end to end.")
    level_timeout_s: float = Field(1200.0, gt=0, description="No request of a level starts after this long.")
    start_timeout_s: float = Field(600.0, gt=0, description="Bound on the server's start-up (until /health is 200).")
    worker_class: str = Field(
        "ModelWorker,DeviceWorker",
        description="Ray actor classes of the model workers (process titles), comma-separated: a model's own "
        "worker, and the worker that hosts the models placed on one device.")
    overlap: tuple[bool, ...] | None = Field(
        None, description="Run every level once per setting of args.engine.overlap (a server per setting, off "
        "first); None: one pass with the YAML as it is.")
    prefix_caching: bool | None = Field(
        None, description="Force args.engine.prefix_caching on or off (a copy of the YAML in the output directory); "
        "None: the YAML as it is.")
    direct_http: bool = Field(False, description="Send the requests to the replica's own HTTP server (`specserve serve "
                              "--direct-http-port`, Serve's proxy skipped) instead of the proxy.")
    bare_limit: bool = Field(True, description="Measure each level's bare-model limit (benchmarks.served.bare_limit) after "
                             "the servers stop and report served tokens/s against it.")
    bare_repeats: int = Field(7, ge=1, description="Timed forwards per shape of the bare-model limit (median).")

    @model_validator(mode="after")
    def _known(self) -> ServeLoadSettings:
        unknown = [s for s in self.strategies if s not in SERVE_LOAD_STRATEGIES]
        if unknown:
            raise ValueError(f"strategies: {unknown} cannot run in serve-load mode; expected a subset of "
                             f"{SERVE_LOAD_STRATEGIES}")
        if any(c < 1 for c in self.concurrency):
            raise ValueError(f"concurrency: every level needs at least one client, got {self.concurrency}")
        if self.overlap is not None and (not self.overlap or len(set(self.overlap)) != len(self.overlap)):
            raise ValueError(f"overlap: one or two distinct settings, got {self.overlap}")
        return self

    def overlap_passes(self) -> list[bool | None]:
        """The server passes: None (the YAML as it is) or each overlap setting, off first."""
        return [None] if self.overlap is None else sorted(self.overlap)

    def requests_for(self, concurrency: int) -> int:
        return self.requests_per_level or max(32, 4 * concurrency)


@dataclass(frozen=True)
class LoadCase:
    strategy: str
    label: str
    speculation: dict[str, Any]


def serve_load_cases(settings: ServeLoadSettings, roles: dict[str, str]) -> list[LoadCase]:
    """The speculation object of each strategy, in the order of ``settings.strategies``."""
    target = [name for name, role in roles.items() if role == "target"]
    members = [name for name, role in roles.items() if role == "member"]
    has_draft = "draft" in roles.values()
    cases = []
    for strategy in settings.strategies:
        if strategy in ("sd", "multi_draft") and not has_draft:
            raise ValueError(f"{strategy} needs a draft model; the config has roles {roles}")
        if strategy in ("ensemble", "se") and not (target and members):
            raise ValueError(f"{strategy} needs the target and a member model; the config has roles {roles}")
        if strategy == "ar":
            cases.append(LoadCase("ar", "ar", {"strategy": "ar"}))
        elif strategy == "sd":
            for gamma in settings.sd_gammas or (settings.sd_gamma,):
                speculation = {"strategy": "sd", "method": settings.sd_method, "gamma": gamma}
                if gamma == "auto":
                    speculation["gamma_max"] = settings.gamma_max
                cases.append(LoadCase("sd", f"sd/{settings.sd_method}/g{gamma}", speculation))
        elif strategy == "multi_draft":
            cases.append(LoadCase(
                "multi_draft", f"multi_draft/{settings.multi_draft_method}/k{settings.num_drafts}/g{settings.multi_draft_gamma}",
                {"strategy": "multi_draft", "method": settings.multi_draft_method, "num_drafts": settings.num_drafts,
                 "gamma": settings.multi_draft_gamma},
            ))
        else:
            pair = [target[0], members[0]]
            ensemble = {"ensemble": "weighted", "members": pair, "weights": [0.5, 0.5]}
            if strategy == "ensemble":
                cases.append(LoadCase("ensemble", "ensemble/weighted/n2", {"strategy": "ensemble", **ensemble}))
            else:
                cases.extend(_se_case(settings, proposer, ensemble) for proposer in settings.se_proposers)
    return cases


def _se_case(settings: ServeLoadSettings, proposer: str, ensemble: dict[str, Any]) -> LoadCase:
    """se with ``proposer``: the alternate proposer (gammas [1, se_gamma]) or a model drafting
    blocks of ``se_draft_gamma`` for the ensemble law."""
    if proposer == "alternate":
        lengths = {"gamma": "auto"} if settings.se_gamma == "auto" else {"gammas": [1, settings.se_gamma]}
        return LoadCase("se", f"se/weighted/n2/g{settings.se_gamma}",
                        {"strategy": "se", "method": settings.se_method, "proposer": "alternate", **lengths, **ensemble})
    speculation = {"strategy": "se", "method": settings.se_draft_method, "proposer": proposer,
                   "gamma": settings.se_draft_gamma, **ensemble}
    if settings.se_draft_gamma == "auto":
        speculation["gamma_max"] = settings.gamma_max
    return LoadCase("se", f"se/{proposer}/weighted/n2/g{settings.se_draft_gamma}", speculation)
