"""Plain data that moves between the actors of one model group (never to clients).

Work goes to the workers as :class:`WorkItem` lists (one call per worker per scheduler step) and
comes back as :class:`ItemOutcome` lists. Proposals' logits travel from the proposing worker
straight to the worker that verifies them (the scheduler forwards the ObjectRef, not the
array), so for ``sd`` / ``multi_draft`` the coordinator only sees token ids, counts and timings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from actors.wire import pickle_through_wire
from verifiers.machines.needs import MemberBlock, PreDrafted, Sampled
from verifiers.penalties import NO_PENALTIES, Penalties

#: The error of a request whose work was on a worker that died (retryable).
UNAVAILABLE = "model worker {model} is unavailable (restarting); retry the request"


@dataclass(frozen=True)
class RowSampling:
    """How a worker turns its logits into the rows it samples from / verifies against.

    ``vocab_limit`` is the vocabulary shared by every model of the group: logits past it are
    dropped before ``verifiers.penalties.penalized_probs`` (models of one family may pad their
    embedding tables differently; the extra ids are never produced). ``penalties`` are applied
    to every row with the tokens generated before that row's own position. ``precision``: what the
    rows a worker draws from and verifies against are computed in (``engine.sampling_precision``
    settled for the group; ``verifiers.sampling.ROW_DTYPES``).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    vocab_limit: int | None = None
    penalties: Penalties = NO_PENALTIES
    precision: str = "float64"


@dataclass(frozen=True)
class KVPool:
    """A worker's KV block pool as the coordinator plans with it (:mod:`actors.model.kv_cache`):
    ``blocks`` of ``block_size`` tokens; a session holding ``tokens`` tokens holds at most
    :meth:`blocks_for` of them (``reserve``: the scratch columns of its drafts)."""

    blocks: int
    block_size: int
    reserve: int

    def blocks_for(self, tokens: int) -> int:
        """The most blocks a session of ``tokens`` committed tokens holds (one more for the tokens a step appends)."""
        return -(-(tokens + self.reserve) // self.block_size) + 1


@dataclass(frozen=True)
class WorkerInfo:
    """What a ModelWorker reports about itself (``max_context``: the context a request may use
    there, ``engine.max_model_len`` when set; ``kv_slots``: the sessions its KV cache holds)."""

    name: str
    role: str
    vocab_size: int
    max_context: int
    device: str
    gpu_ids: tuple[Any, ...] = ()
    node_id: str = ""
    pid: int = 0
    tokenizer: Any = None  # actors.vocabulary.TokenizerIdentity of the model directory's tokenizer; None: none
    kv_slots: int | None = None  # KV cache slots (sessions it can hold at once); None: not reported
    kv_pool: KVPool | None = None  # its KV block pool; None: not reported (no admission by blocks)
    forward_path: str = ""  # which decoder forward its model runs, in words (SlotBackend.forward_path); "": not reported
    cpu_cores: tuple[int, ...] = ()  # the cores its process runs on (resources.cpu_affinity); (): not reported


@dataclass(frozen=True)
class CallTiming:
    """Where one worker call spent its time (seconds) and how much model work it did."""

    forward_s: float = 0.0
    verify_s: float = 0.0
    forward_calls: int = 0
    tokens_fed: int = 0
    #: The whole call's seconds in the worker (forwards, sampling, verification, row building),
    #: what the step cost model charges per forward; 0: not measured (forward_s then stands in).
    call_s: float = 0.0
    #: The call's seconds up to the end of its first forward round (rows, forward, sampling): with
    #: ``call_s``, what a call of several forwards pays once (its first round, slower: the call's
    #: set-up, the tokens the last verification accepted, caches the other models' forwards
    #: evicted) apart from each further round; 0: not measured.
    first_round_s: float = 0.0
    #: Wall-clock times (``time.time()``) the call had its sources' payloads and rows, and ended its
    #: work: a verifying call's ``sources_at`` less its proposer's ``ended_at`` is the time the
    #: proposals took to move (:mod:`actors.coordination.row_transport`); 0: not stamped.
    sources_at: float = 0.0
    ended_at: float = 0.0


@dataclass(frozen=True)
class OpenSession:
    """Open a session on first use: the prompt, how rows are made, the seeds of the random
    streams this worker owns for the request (``verifiers.randomness.stream_seeds``)."""

    prompt_ids: tuple[int, ...]
    sampling: RowSampling
    seeds: dict[str, int] = field(default_factory=dict)
    #: Keep the logits of every prompt position of the first forward (prompt log-probabilities;
    #: the outcome's ``prompt_logits``). Such a session computes its whole prompt: it reuses no
    #: cached prefix, which would bring no fresh logits.
    prompt_logits: bool = False


@dataclass(frozen=True)
class Prefill:
    """The scheduler's own need (not a decoding machine's): feed the next chunk of a new
    session's prompt on ``model`` (chunked prefill, ``docs/design.md``). The worker feeds as
    many prompt tokens as its per-step token budget leaves once the step's other rows are
    counted, never the prompt's last token (it stays pending, so the decoding machine's first
    need still gets the row after the prompt); the outcome's value is a :class:`PrefillProgress`.
    ``keep_logits``: keep the logits of every position fed (prompt log-probabilities, the
    outcome's ``prompt_logits``)."""

    model: str
    keep_logits: bool = False
    append: tuple[int, ...] = ()  # nothing is committed during a prefill (the machine vocabulary's field)


@dataclass(frozen=True)
class PrefillProgress:
    """What a :class:`Prefill` item did: prompt tokens fed in this step, and those still to feed
    (the prompt's last token, always left pending, is not counted)."""

    fed: int
    remaining: int


@dataclass(frozen=True)
class FailedSource:
    """A proposing call whose payload could not be read (its worker died)."""

    error: str


@dataclass(frozen=True)
class WorkItem:
    """One request's need (:mod:`verifiers.machines`) for one worker's call of a step.

    open: set on the request's first item on this worker (the session is opened, then the need
    runs; the prompt's prefill is the need's first row). proposal_source: for a ScoreVerify,
    ``(i, j)``: the proposal is item j's payload in ``source_payloads[i]``, the i-th source call's.
    """

    session_id: str
    need: Any
    open: OpenSession | None = None
    proposal_source: tuple[int, int] | None = None


@dataclass(frozen=True)
class ItemOutcome:
    """What one work item produced: a value (see each need's result type) or an error
    message (the item's session was freed), and the step's timing for it."""

    value: Any = None
    timing: CallTiming = field(default_factory=CallTiming)
    error: str | None = None
    retryable: bool = False  # the session was gone (the worker restarted): sending the request again works
    #: With ``OpenSession.prompt_logits``: the raw logits ``[P - 1, V]`` (shared vocabulary) at
    #: prompt positions ``0 .. P-2``, row ``j`` predicting prompt token ``j + 1``.
    prompt_logits: Any = None


# The payloads that cross between actors carry tensors: pickled as numpy arrays (actors.wire).
pickle_through_wire(ItemOutcome, Sampled, PreDrafted, MemberBlock)
