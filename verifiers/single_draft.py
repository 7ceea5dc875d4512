"""Single-draft verification rules: token, block and greedy block verification.

Vocabulary: see :mod:`verifiers.types` (draft / accepted / recovered / bonus tokens).
Every rule has one signature, batched over a leading batch dim ``B``::

    verify_X(draft_tokens   [B, gamma]          int64,
             draft_probs    [B, gamma, V]       rows the draft tokens were sampled from,
             target_probs   [B, gamma+1, V]     target rows after each draft prefix,
             *, generator, state=None) -> VerifyResult

``draft_probs[b, i]`` is the draft's law of ``draft_tokens[b, i]`` given the context plus
``draft_tokens[b, :i]``; ``target_probs[b, i]`` is the target's law at the same position,
and ``target_probs[b, gamma]`` the target's law after the whole block (the bonus row).
Rows are the exact post-temperature / top-k / top-p rows of :func:`verifiers.sampling.logits_to_probs`.

Arithmetic runs in the rows' precision: float64 (the exactness harness's), or float32 when both
rows come in float32 (a GPU worker's, ``engine.sampling_precision``); every random choice goes
through the
:class:`~verifiers.randomness.RandomSource` (``generator`` may be a ``torch.Generator``), so
:func:`verifiers.reference.exact.exact_law` enumerates these very functions. Inputs are never modified.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verifiers.randomness import RandomSource, as_random_source, bernoulli_rows
from verifiers.types import PAD_TOKEN, VerifyResult, validated_verify_inputs


@dataclass(frozen=True)
class _Block:
    """Validated views of one verification call's inputs (float64, or float32 rows)."""

    draft_tokens: torch.Tensor  # [B, gamma] int64
    draft_probs: torch.Tensor  # [B, gamma, V] float64 or float32
    target_probs: torch.Tensor  # [B, gamma+1, V] same dtype

    @property
    def dtype(self) -> torch.dtype:
        """The rows' precision, which every computation of the call keeps."""
        return self.draft_probs.dtype

    @property
    def batch(self) -> int:
        return self.draft_tokens.shape[0]

    @property
    def gamma(self) -> int:
        return self.draft_tokens.shape[1]

    def draft_token_probs(self) -> torch.Tensor:
        """Draft probability of each draft token ``[B, gamma]``."""
        return self.draft_probs.gather(-1, self.draft_tokens.unsqueeze(-1)).squeeze(-1)

    def target_token_probs(self) -> torch.Tensor:
        """Target probability of each draft token at its position ``[B, gamma]``."""
        rows = self.target_probs[:, : self.gamma]  # [B, gamma, V]
        return rows.gather(-1, self.draft_tokens.unsqueeze(-1)).squeeze(-1)


def _validated_block(
    draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor
) -> _Block:
    return _Block(*validated_verify_inputs(draft_tokens, draft_probs, target_probs, lead_dims=("B",),
                                           allow_float32=True))


def _assemble(
    draft_tokens: torch.Tensor, num_accepted: torch.Tensor, last_tokens: torch.Tensor
) -> torch.Tensor:
    """``tokens [B, gamma+1]``: the accepted draft prefix, the correction-or-bonus token, PAD."""
    batch, gamma = draft_tokens.shape
    positions = torch.arange(gamma + 1).expand(batch, gamma + 1)  # [B, gamma+1]
    padded_draft = torch.cat([draft_tokens, torch.full((batch, 1), PAD_TOKEN)], dim=1)
    tokens = torch.where(positions < num_accepted.unsqueeze(1), padded_draft, PAD_TOKEN)
    return tokens.scatter(1, num_accepted.unsqueeze(1), last_tokens.unsqueeze(1))


def verify_token(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    *,
    generator: torch.Generator | RandomSource,
    state: None = None,
) -> VerifyResult:
    """Token verification (Leviathan et al. 2023, arXiv:2211.17192; Alg. 1 of Sun et al.,
    "Block Verification Accelerates Speculative Decoding", arXiv:2403.10444).

    Position by position, draft token ``X_i`` is accepted with probability
    ``min(1, target(X_i) / draft(X_i))``; at the first rejection a recovered token is drawn
    from ``norm(max(target_i - draft_i, 0))`` (Eq. (2)); if all ``gamma`` are accepted the
    bonus token is drawn from ``target_probs[:, gamma]``.

    Random stream (part of the reproducibility contract): for ``i = 1..gamma`` one
    ``bernoulli`` call over the rows still accepting (in batch order), then one
    ``categorical`` call over all rows ``[B, V]`` for the correction-or-bonus tokens.
    Stateless: ``state`` must be None and the result's ``state`` is None.
    """
    _require_no_state("verify_token", state)
    source = as_random_source(generator)
    block = _validated_block(draft_tokens, draft_probs, target_probs)
    # min(1, target/draft); draft > 0 was validated, so the ratio is finite.
    accept_probs = torch.clamp(block.target_token_probs() / block.draft_token_probs(), max=1.0)  # [B, gamma]

    num_accepted = torch.zeros(block.batch, dtype=torch.int64)  # [B]
    still_accepting = torch.ones(block.batch, dtype=torch.bool)  # [B]
    for position in range(block.gamma):
        rows = still_accepting.nonzero().squeeze(1)  # [A]
        if rows.numel() == 0:
            break
        accepted_here = bernoulli_rows(source, accept_probs[rows, position], rows)  # [A]
        num_accepted[rows[accepted_here]] += 1
        still_accepting[rows[~accepted_here]] = False

    unit_weights = torch.zeros(block.batch, block.gamma + 1, dtype=block.dtype)  # log 1: Eq. (2)
    last_rows = _correction_or_bonus_rows(block, _rows_at(block.target_probs, num_accepted), num_accepted, unit_weights)
    last_tokens = source.categorical(last_rows)  # [B]
    return VerifyResult(tokens=_assemble(block.draft_tokens, num_accepted, last_tokens), num_accepted=num_accepted)


def verify_block(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    *,
    generator: torch.Generator | RandomSource,
    state: None = None,
) -> VerifyResult:
    """Block verification (Sun et al., ICLR 2025, arXiv:2403.10444: Alg. 2 with Eq. (3), (4)).

    With ``p_0 = 1`` and ``p_i = min(1, p_{i-1} * target(X_i) / draft(X_i))`` (Alg. 2 line 4),
    sub-block ``X^i`` is accepted with probability ``h_i`` (Eq. (4)):
    ``h_gamma = p_gamma`` and, for ``i < gamma``,
    ``h_i = S_i / (S_i + 1 - p_i)`` where ``S_i = sum_x max(p_i target_i(x) - draft_i(x), 0)``.
    The accepted prefix is the LONGEST accepted sub-block (``tau``; 0 when none is); the
    correction token is drawn from ``norm(max(p_tau target_tau - draft_tau, 0))`` (Eq. (3)),
    or the bonus token from ``target_probs[:, gamma]`` when ``tau = gamma``. Lossless by
    Theorem 1 of the paper (proved here by exact enumeration in the tests).

    ``p_i`` is kept in log space (products of ratios of tiny probabilities). A sub-block
    with ``S_i + 1 - p_i = 0`` (``p_i = 1`` and ``target_i == draft_i``) is accepted with
    probability 1, which is what ``Pr[X^i kept] = draft(X^i) p_i`` (Lemma 3) requires.

    Random stream: the sub-blocks are decided from the longest down (``i = gamma, ...,
    1``), one ``bernoulli`` call per ``i`` over the rows not yet decided (the first success
    is the longest accepted sub-block, so this is the same law as Alg. 2's independent
    uniforms), then one ``categorical`` call over all rows ``[B, V]``. Stateless.
    """
    _require_no_state("verify_block", state)
    source = as_random_source(generator)
    block = _validated_block(draft_tokens, draft_probs, target_probs)
    log_token_ratios = torch.log(block.target_token_probs()) - torch.log(block.draft_token_probs())  # [B, gamma]
    log_p = _log_capped_ratios(log_token_ratios)  # [B, gamma+1]; log p_0 = 0
    p = torch.exp(log_p)  # [B, gamma+1], in [0, 1]

    inner = slice(1, block.gamma)  # i = 1 .. gamma-1, all at once
    surplus = _surpluses(block, p)  # [B, gamma-1]: S_i
    denominator = surplus + (1.0 - p[:, inner])  # [B, gamma-1]
    sub_block_probs = torch.where(denominator > 0, surplus / torch.where(denominator > 0, denominator, 1.0), 1.0)
    last = p[:, block.gamma:] if block.gamma > 0 else p[:, :0]  # [B, 1]: h_gamma = p_gamma (none for an empty block)
    accept_probs = torch.cat([sub_block_probs.clamp(max=1.0), last], dim=1)  # [B, gamma]; h_1..h_gamma

    num_accepted = _longest_accepted(source, accept_probs)  # [B]
    last_rows = _correction_or_bonus_rows(block, _rows_at(block.target_probs, num_accepted), num_accepted, log_p)
    last_tokens = source.categorical(last_rows)  # [B]
    return VerifyResult(tokens=_assemble(block.draft_tokens, num_accepted, last_tokens), num_accepted=num_accepted)


@dataclass(frozen=True)
class GreedyBlockState:
    """The distribution modification greedy block verification owes the next iteration
    (Alg. 5 / Eq. (23) of arXiv:2403.10444, composed over iterations as in Alg. 6 line 6).

    One "level" per earlier iteration whose modification still covers upcoming positions;
    levels are ordered oldest first and apply in that order (Alg. 6 modifies the already
    modified target again). For batch row ``b`` and level ``l``:

    * ``horizon[b, l]``: the modification covers the next call's positions
      ``0 .. horizon - 1`` (0 = inactive padding);
    * ``log_ratio[b, l]``: ``log rho``, where ``rho`` is the ratio of JOINT probabilities
      ``target^{(l)}(emitted | c_l) / draft(emitted | c_l)`` of everything emitted since
      the start context ``c_l`` of the iteration that created the level, under the target
      that iteration verified against and the draft. (``+inf`` is allowed: a prefix the
      draft could not produce.)

    At a position ``j`` of the next call with ``j < horizon`` the level turns the row it
    receives (``target^{(l)}``) into
    ``norm(max(rho_j * target^{(l)}_j - draft_j, 0))`` with
    ``rho_j = rho * prod_{i<j} target^{(l)}_i(X_{i+1}) / draft_i(X_{i+1})`` along the new draft
    path, i.e. Eq. (23) with joint probabilities of the whole continuation (divided by the
    common draft joint). Plain data: pass it back as ``state=`` for the same request and
    batch row order; :meth:`rows` / :meth:`concat` re-batch it.
    """

    log_ratio: torch.Tensor  # [B, L] float64
    horizon: torch.Tensor  # [B, L] int64

    @staticmethod
    def empty(batch: int) -> GreedyBlockState:
        """No pending modification (a fresh request)."""
        return GreedyBlockState(
            log_ratio=torch.zeros(batch, 0, dtype=torch.float64), horizon=torch.zeros(batch, 0, dtype=torch.int64)
        )

    @property
    def batch(self) -> int:
        return self.log_ratio.shape[0]

    def rows(self, index: list[int] | torch.Tensor) -> GreedyBlockState:
        """The state of the given batch rows (e.g. one request's row)."""
        index = torch.as_tensor(index, dtype=torch.int64)
        return GreedyBlockState(log_ratio=self.log_ratio[index], horizon=self.horizon[index])

    @staticmethod
    def concat(states: list[GreedyBlockState]) -> GreedyBlockState:
        """Stack the rows of several states (levels padded with inactive entries)."""
        width = max((s.log_ratio.shape[1] for s in states), default=0)

        def padded(tensor: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.pad(tensor, (0, width - tensor.shape[1]))

        return GreedyBlockState(
            log_ratio=torch.cat([padded(s.log_ratio) for s in states]),
            horizon=torch.cat([padded(s.horizon) for s in states]),
        )


def verify_greedy_block(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    *,
    generator: torch.Generator | RandomSource,
    state: GreedyBlockState | None = None,
) -> VerifyResult:
    """Greedy block verification with distribution modification (Sun et al., Block Verification (arXiv:2403.10444),
    appendix C: Alg. 4, Alg. 5 / Eq. (23), loop of Alg. 6). Stateful.

    1. The target rows this call verifies against are the raw ``target_probs`` modified by
       ``state`` (the levels of :class:`GreedyBlockState`, oldest first), evaluated along
       this call's draft path (Alg. 6 footnote 6: score with the original model, then
       modify).
    2. Alg. 4 on those rows: ``p~_i = prod_{j<=i} target(X_j) / draft(X_j)`` (joint ratio, no
       min); sub-block ``X^i`` (``i < gamma``) is accepted with probability ``min(1, h_i)``,
       ``h_i = sum_x max(p~_i target_i(x) - draft_i(x), 0) / sum_x max(draft_i(x) - p~_i
       target_i(x), 0)`` (``h_i = 1`` when the denominator is 0); ``X^gamma`` with
       ``min(1, p~_gamma)``. ``tau`` = the longest accepted sub-block; correction from
       ``norm(max(p~_tau target_tau - draft_tau, 0))`` (Eq. (22)), or the bonus token from
       ``target_gamma`` when ``tau = gamma``.
    3. The returned state: the surviving levels advanced past the ``tau + 1`` emitted tokens,
       plus a new level with horizon ``gamma - tau - 1`` and ``rho = p~_tau * target_tau(Y) /
       draft_tau(Y)`` (Alg. 5: the joint ratio of ``(X^tau, Y)``).

    Eq. (23)'s ``M_b``/``M_s`` are read as JOINT probabilities of the continuation from the
    iteration's start context (that is what the proof of Lemma 6, step (34), uses); the
    tests prove this reading exact over several iterations by enumeration. A modified row
    whose positive part is empty belongs to a context that cannot be reached (on a
    reachable context ``rho_j > 1``); it is left unmodified so no NaN appears.

    Random stream: as :func:`verify_block` (``bernoulli`` from ``i = gamma`` down to 1 over
    undecided rows, then one ``categorical`` over ``[B, V]``).
    """
    source = as_random_source(generator)
    block = _validated_block(draft_tokens, draft_probs, target_probs)
    state = _validated_greedy_state(state, block)
    stages = _modified_target_stages(block, state)  # L + 1 lists of gamma+1 rows [B, V]
    target_rows = stages[-1]  # what this iteration verifies against, per position [B, V]

    log_token_ratios = _log_path_ratios(block, target_rows)  # [B, gamma]
    log_p_tilde = torch.cat(
        [torch.zeros(block.batch, 1, dtype=block.dtype), torch.cumsum(log_token_ratios, dim=1)], dim=1
    )  # [B, gamma+1]

    accept_probs = torch.empty(block.batch, block.gamma, dtype=block.dtype)  # [B, gamma]
    if block.gamma > 0:
        accept_probs[:, -1] = torch.exp(log_p_tilde[:, block.gamma]).clamp(max=1.0)
    for i in range(1, block.gamma):
        difference = _scaled_difference(log_p_tilde[:, i], target_rows[i], block.draft_probs[:, i])  # [B, V]
        remaining = difference.clamp(min=0.0).sum(dim=-1)  # [B]: p_remain (Eq. 24), scaled
        rejected = (-difference).clamp(min=0.0).sum(dim=-1)  # [B]: p_rej (Eq. 25), same scale
        accept_probs[:, i - 1] = torch.where(
            rejected > 0, remaining / torch.where(rejected > 0, rejected, 1.0), 1.0
        ).clamp(max=1.0)

    num_accepted = _longest_accepted(source, accept_probs)  # [B]
    target_at_tau = _rows_at(target_rows, num_accepted)  # [B, V]
    last_rows = _correction_or_bonus_rows(block, target_at_tau, num_accepted, log_p_tilde)
    last_tokens = source.categorical(last_rows)  # [B]
    tokens = _assemble(block.draft_tokens, num_accepted, last_tokens)
    next_state = _next_greedy_state(block, state, stages, log_p_tilde, num_accepted, last_tokens, target_at_tau)
    return VerifyResult(tokens=tokens, num_accepted=num_accepted, state=next_state)


# ----------------------------------------------------------------------------- helpers


def _require_no_state(name: str, state: object) -> None:
    if state is not None:
        raise ValueError(f"{name} is stateless; state must be None, got {type(state).__name__}")


def _scaled_difference(log_ratio: torch.Tensor, target_rows: torch.Tensor, draft_rows: torch.Tensor) -> torch.Tensor:
    """``ratio * target - draft`` up to a positive factor, without overflow: returns
    ``min(1, ratio) * target - min(1, 1/ratio) * draft`` for ``log_ratio [N]`` (``+-inf``
    allowed) and rows ``[N, V]``. Positive parts and their ratios are what the rules use,
    and both are invariant to the factor."""
    target_weight = torch.exp(torch.clamp(log_ratio, max=0.0)).unsqueeze(-1)  # [N, 1]
    draft_weight = torch.exp(torch.clamp(-log_ratio, max=0.0)).unsqueeze(-1)  # [N, 1]
    # A weight of exactly 1 (one side's always is) scales nothing: its product is skipped, bit for bit.
    draft_part = draft_rows if bool((draft_weight == 1).all()) else torch.mul(draft_rows, draft_weight)  # [N, V]
    if bool((target_weight == 1).all()):
        return torch.sub(target_rows, draft_part)  # [N, V], a new tensor
    return torch.mul(target_rows, target_weight).sub_(draft_part)  # [N, V], a new tensor


def _surpluses(block: _Block, p: torch.Tensor) -> torch.Tensor:
    """``S_i = sum_x max(p_i target_i(x) - draft_i(x), 0)`` for ``i = 1 .. gamma-1`` -> ``[B, gamma-1]``
    (Eq. (4); ``p [B, gamma+1]`` in [0, 1], so this is ``_scaled_difference``'s positive part with
    its draft weight 1). Every position at once with ONE ``[B, gamma-1, V]`` temporary, the
    subtraction and the clamp in place (more temporaries of that size cost more than a loop over
    positions at large vocabularies, ``python -m benchmarks.micro.verify_micro``)."""
    inner = slice(1, block.gamma)
    product = torch.mul(block.target_probs[:, inner], p[:, inner].unsqueeze(-1))  # [B, gamma-1, V]
    return product.sub_(block.draft_probs[:, inner]).clamp_(min=0.0).sum(dim=-1)


def _log_capped_ratios(log_token_ratios: torch.Tensor) -> torch.Tensor:
    """``log p_i`` for ``p_0 = 1``, ``p_i = min(1, p_{i-1} * ratio_i)`` (Alg. 2 line 4) from the
    log ratios ``[B, gamma]`` -> ``[B, gamma+1]``. Unrolled, ``log p_i = S_i - max_{j <= i} S_j``
    with ``S`` the prefix sums of the log ratios (``S_0 = 0``): one cumulative sum and one
    cumulative max instead of a loop over positions (``-inf`` ratios stay ``-inf``; the max is
    at least ``S_0 = 0``, so never ``-inf``)."""
    zero = torch.zeros(log_token_ratios.shape[0], 1, dtype=log_token_ratios.dtype)  # [B, 1]
    prefix = torch.cat([zero, torch.cumsum(log_token_ratios, dim=1)], dim=1)  # [B, gamma+1]: S
    return prefix - torch.cummax(prefix, dim=1).values


def _positive_part_rows(difference: torch.Tensor, fallback_rows: torch.Tensor) -> torch.Tensor:
    """``norm(max(difference, 0))`` per row ``[N, V]``; an empty row (no positive mass, which
    has probability 0 of being used in exact arithmetic) becomes ``fallback_rows``. No
    epsilon is added. Works in place on ``difference`` (a fresh tensor of the caller's, from
    :func:`_scaled_difference`), which holds the rows after: the values of the out-of-place
    clamp, division and selection, bit for bit, without three more ``[N, V]`` tensors."""
    positive = difference.clamp_(min=0.0)  # [N, V]
    mass = positive.sum(dim=-1, keepdim=True)  # [N, 1]
    has_mass = mass > 0  # [N, 1]
    if bool(has_mass.all()):
        return positive.div_(mass)
    positive.div_(torch.where(has_mass, mass, 1.0))
    empty = ~has_mass.squeeze(-1)  # [N]
    positive[empty] = fallback_rows[empty]
    return positive


def _log_path_ratios(block: _Block, target_rows: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """``log target_i(X_{i+1}) - log draft_i(X_{i+1})`` along the draft path ``[B, gamma]``
    (``-inf`` where the target gives the draft token zero mass; draft mass is > 0).
    ``target_rows`` is ``[B, gamma+1, V]`` or a list of per-position rows ``[B, V]``."""
    index = block.draft_tokens.unsqueeze(-1)  # [B, gamma, 1]
    if isinstance(target_rows, torch.Tensor):
        target_token = target_rows[:, : block.gamma].gather(-1, index).squeeze(-1)  # [B, gamma]
    else:
        target_token = _gather_path(target_rows, block.draft_tokens)
    return torch.log(target_token) - torch.log(block.draft_token_probs())


def _gather_path(rows: list[torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """``rows[j][b, tokens[b, j]]`` for every position ``j < tokens.shape[1]`` -> ``[B, gamma]``."""
    if tokens.shape[1] == 0:
        return torch.zeros(tokens.shape, dtype=torch.float64)
    return torch.cat([rows[j].gather(-1, tokens[:, j : j + 1]) for j in range(tokens.shape[1])], dim=1)


def _rows_at(target_rows: torch.Tensor | list[torch.Tensor], positions: torch.Tensor) -> torch.Tensor:
    """Row ``positions[b]`` of batch row ``b`` -> ``[B, V]`` (from ``[B, gamma+1, V]`` or a
    list of per-position rows ``[B, V]``)."""
    batch_index = torch.arange(positions.shape[0])
    if isinstance(target_rows, torch.Tensor):
        return target_rows[batch_index, positions]
    return torch.stack([target_rows[int(position)][row] for row, position in enumerate(positions.tolist())])


def _longest_accepted(source: RandomSource, accept_probs: torch.Tensor) -> torch.Tensor:
    """``tau`` = the longest sub-block accepted when sub-block ``X^i`` is accepted
    independently with probability ``accept_probs[:, i-1]`` ``[B, gamma]``; 0 if none is.
    Decided from ``i = gamma`` down, one ``bernoulli`` per ``i`` over the undecided rows (kept
    as a list: a few rows, no tensor bookkeeping per position)."""
    batch, gamma = accept_probs.shape
    num_accepted = [0] * batch
    undecided = list(range(batch))
    for i in range(gamma, 0, -1):
        if not undecided:
            break
        rows = torch.tensor(undecided, dtype=torch.int64)  # [A]
        accepted_here = bernoulli_rows(source, accept_probs[rows, i - 1], rows).tolist()  # [A]
        for row, accepted in zip(undecided, accepted_here):
            if accepted:
                num_accepted[row] = i
        undecided = [row for row, accepted in zip(undecided, accepted_here) if not accepted]
    return torch.tensor(num_accepted, dtype=torch.int64)  # [B]


def _correction_or_bonus_rows(
    block: _Block, target_at_tau: torch.Tensor, num_accepted: torch.Tensor, log_weights: torch.Tensor
) -> torch.Tensor:
    """Rows ``[B, V]`` of the token emitted after the accepted prefix. ``target_at_tau [B, V]``
    is the target row at position ``tau``: the bonus row when ``tau = gamma``, else the
    residual ``norm(max(w_tau * target_tau - draft_tau, 0))`` with
    ``w = exp(log_weights) [B, gamma+1]`` (token: ``w = 1``, Eq. (2); block: ``p_tau``,
    Eq. (3); greedy: ``p~_tau``, Eq. (22))."""
    full = num_accepted == block.gamma  # [B]
    if bool(full.all()):
        return target_at_tau
    batch_index = torch.arange(block.batch)
    rejected_at = num_accepted.clamp(max=block.gamma - 1)  # [B]; rows with full=True are masked below
    log_weight = log_weights[batch_index, rejected_at]  # [B]
    difference = _scaled_difference(log_weight, target_at_tau, block.draft_probs[batch_index, rejected_at])
    rows = _positive_part_rows(difference, target_at_tau)  # [B, V]: the residuals
    if bool(full.any()):
        rows[full] = target_at_tau[full]  # the bonus rows
    return rows


def _validated_greedy_state(state: GreedyBlockState | None, block: _Block) -> GreedyBlockState:
    if state is None:
        return GreedyBlockState.empty(block.batch)
    if not isinstance(state, GreedyBlockState):
        raise TypeError(f"state must be a GreedyBlockState from the previous call, got {type(state).__name__}")
    if state.batch != block.batch:
        raise ValueError(f"state has {state.batch} rows but the call has batch {block.batch}")
    if bool((state.horizon >= max(block.gamma, 1)).any()):
        raise ValueError(
            f"state covers {int(state.horizon.max())} positions, more than gamma - 1 = {block.gamma - 1}: "
            "was gamma changed within a request?"
        )
    return state


def _modified_target_stages(block: _Block, state: GreedyBlockState) -> list[list[torch.Tensor]]:
    """``[raw, after level 0, after level 1, ...]``: each stage is the list of the
    ``gamma + 1`` target rows ``[B, V]`` along the draft path; each level applies Eq. (23)
    to the rows of the previous stage at the positions it covers (only those are
    recomputed, the others are shared, not copied)."""
    stages = [list(block.target_probs.unbind(dim=1))]
    for level in range(state.log_ratio.shape[1]):
        rows = stages[-1]
        horizon = state.horizon[:, level]  # [B]
        covered_positions = int(horizon.max()) if horizon.numel() else 0
        if covered_positions <= 0:
            stages.append(rows)
            continue
        path_log_ratio = torch.cumsum(_log_path_ratios(block, rows), dim=1)  # [B, gamma]
        modified = list(rows)
        for j in range(covered_positions):  # j < horizon <= gamma - 1: a draft row exists
            # log rho_j = log rho + sum_{i<j} log rows_i(X_{i+1}) / draft_i(X_{i+1})
            log_rho = state.log_ratio[:, level] + (path_log_ratio[:, j - 1] if j > 0 else 0.0)  # [B]
            # NaN (inf - inf) or an empty positive part happen only on unreachable contexts:
            # such rows are kept as they are.
            usable = (j < horizon) & ~torch.isnan(log_rho)  # [B]
            safe_log_rho = torch.where(usable, log_rho, 0.0)
            difference = _scaled_difference(safe_log_rho, rows[j], block.draft_probs[:, j])  # [B, V]
            modified[j] = torch.where(usable.unsqueeze(1), _positive_part_rows(difference, rows[j]), rows[j])
        stages.append(modified)
    return stages


def _next_greedy_state(
    block: _Block,
    state: GreedyBlockState,
    stages: list[list[torch.Tensor]],
    log_p_tilde: torch.Tensor,
    num_accepted: torch.Tensor,
    last_tokens: torch.Tensor,
    target_at_tau: torch.Tensor,
) -> GreedyBlockState:
    """Advance the surviving levels past the ``tau + 1`` emitted tokens and add this
    iteration's level (Alg. 5)."""
    batch_index = torch.arange(block.batch)
    emitted_count = num_accepted + 1  # [B]
    log_ratios, horizons = [], []
    if block.gamma == 0:
        return GreedyBlockState.empty(block.batch)
    # Emitted path X_1..X_tau, Y: all at positions < gamma whenever a level survives.
    at = num_accepted.clamp(max=block.gamma - 1)  # [B]
    emitted = block.draft_tokens.clone()  # [B, gamma]
    emitted[batch_index, at] = torch.where(num_accepted < block.gamma, last_tokens, emitted[batch_index, at])
    on_path = torch.arange(block.gamma).unsqueeze(0) < emitted_count.unsqueeze(1)  # [B, gamma]
    log_draft = torch.log(block.draft_probs.gather(-1, emitted.unsqueeze(-1)).squeeze(-1))  # [B, gamma]

    for level in range(state.log_ratio.shape[1]):
        horizon = state.horizon[:, level] - emitted_count  # [B]
        alive = horizon > 0
        if not bool(alive.any()):
            continue
        log_target = torch.log(_gather_path(stages[level], emitted))  # the rows this level modified
        step = torch.where(on_path, log_target - log_draft, 0.0)  # [B, gamma]
        log_ratios.append(torch.where(alive, state.log_ratio[:, level] + step.sum(dim=1), 0.0))
        horizons.append(torch.where(alive, horizon, 0))

    # New level: rho = p~_tau * target_tau(Y) / draft_tau(Y) under this call's target rows.
    new_horizon = block.gamma - emitted_count  # [B]; <= 0 when tau = gamma
    if bool((new_horizon > 0).any()):
        target_y = target_at_tau.gather(-1, last_tokens.unsqueeze(1)).squeeze(1)  # [B]
        draft_y = block.draft_probs[batch_index, at, last_tokens]  # [B]
        new_log_ratio = log_p_tilde[batch_index, at] + torch.log(target_y) - torch.log(draft_y)
        log_ratios.append(torch.where(new_horizon > 0, new_log_ratio, 0.0))
        horizons.append(new_horizon.clamp(min=0))
    if not log_ratios:
        return GreedyBlockState.empty(block.batch)
    return _compact(GreedyBlockState(log_ratio=torch.stack(log_ratios, dim=1), horizon=torch.stack(horizons, dim=1)))


def _compact(state: GreedyBlockState) -> GreedyBlockState:
    """Drop level columns that are inactive in every row (keeps the state from growing)."""
    active_columns = (state.horizon > 0).any(dim=0)  # [L]
    return GreedyBlockState(log_ratio=state.log_ratio[:, active_columns], horizon=state.horizon[:, active_columns])
