"""ModelWorker: one causal LM (draft, target or ensemble member) in its own Ray actor.

Each request opens a *session* on every worker it uses. A session keeps the committed context
(prompt + accepted tokens) and a KV cache that is REUSED across iterations: a call brings the
tokens committed since the previous call (``append_tokens``), the worker finds the longest
prefix of the new context that its cache already holds, crops the cache back to it (the
rollback after a rejection) and feeds only what is missing. The last committed token is always
left unfed ("pending"), so every call feeds at least one token and gets the row of the next
position from it; nothing is ever recomputed.

Calls:
- ``open_session``: prefill the prompt (all but its last token).
- ``propose``: sample ``n`` tokens for each of ``K`` drafts in one call (K drafts batched in
  one forward per step), returning the tokens and the exact rows they were drawn from
  (``verifiers.sampling.logits_to_probs`` with the request's temperature / top-k / top-p).
- ``score``: the rows of ``gamma + 1`` positions of each of K draft blocks, one forward.
- ``score_and_verify``: score a :class:`~actors.messages.Proposal` (received as an ObjectRef
  straight from the proposer) and run the registry's verifier on it here, next to the target
  rows, returning only the emitted tokens (rows never travel back).
- ``next_logits``: the logits of the next position (ensembles combine members' logits).
- ``rollback``: cut the committed context back explicitly (calls that bring ``append_tokens``
  roll back implicitly, saving the extra call).
- ``release``: free the session. Sessions are also freed when a call on them fails and after
  ``idle_timeout_s`` without a call.

Random streams: each session owns the streams the request's seed layout assigns to this
worker (``verifiers.randomness.stream_seeds``), e.g. ``{"sample": seed0}`` on the draft and
``{"verify": seed1}`` on the target for speculative decoding.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from actors.backends import ModelBackend, TransformersBackend
from actors.messages import CallTiming, MemberBlock, Proposal, RowSampling, VerifyOutcome, WorkerInfo
from verifiers.randomness import TorchRandomSource
from verifiers.registry import get_verifier
from verifiers.sampling import logits_to_probs

logger = logging.getLogger(__name__)

REAPER_PERIOD_S = 5.0


class SessionNotFoundError(KeyError):
    """The session does not exist (never opened, released, failed, or expired)."""


@dataclass
class _Session:
    context: list[int]
    cache: Any
    cached_rows: list[list[int]]  # tokens whose keys/values each cache row holds
    sampling: RowSampling
    sources: dict[str, TorchRandomSource]
    verify_state: Any = None
    last_used: float = field(default_factory=time.monotonic)
    tokens_fed: int = 0
    forward_calls: int = 0


def _common_prefix(a: list[int], b: list[int]) -> int:
    length = 0
    for x, y in zip(a, b):
        if x != y:
            break
        length += 1
    return length


class ModelWorker:
    """Hosts one model; use as a Ray actor: ``ray.remote(ModelWorker).options(...).remote(spec)``.

    ``spec`` is a :class:`cluster.config.ModelSpec` (name, path, role, dtype, revision,
    max_context, num_gpus, torch_threads). On a GPU the worker uses the GPU Ray assigned it;
    on CPU it caps torch to ``spec.torch_threads`` threads.
    """

    def __init__(self, spec: Any, idle_timeout_s: float = 300.0):
        self.spec = spec
        self.idle_timeout_s = float(idle_timeout_s)
        self.device = self._pick_device()
        if self.device == "cpu":
            torch.set_num_threads(max(1, int(getattr(spec, "torch_threads", 1))))
        self.backend: ModelBackend = self._load_backend()
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.RLock()
        self._reaper = threading.Thread(target=self._reap_forever, name="session-reaper", daemon=True)
        self._reaper.start()

    # ------------------------------------------------------------------ set-up
    def _pick_device(self) -> str:
        gpu_ids = self._gpu_ids()
        if gpu_ids and torch.cuda.is_available():
            return "cuda"  # Ray sets CUDA_VISIBLE_DEVICES to the GPU it assigned this actor
        if gpu_ids:
            logger.warning("Ray assigned GPUs %s but torch sees no CUDA device; using CPU", gpu_ids)
        return "cpu"

    @staticmethod
    def _gpu_ids() -> tuple[Any, ...]:
        try:
            import ray

            return tuple(ray.get_gpu_ids()) if ray.is_initialized() else ()
        except RuntimeError:
            return ()

    def _load_backend(self) -> ModelBackend:
        spec = self.spec
        return TransformersBackend.load(
            spec.path, dtype=spec.dtype, revision=spec.revision, device=self.device, max_context=spec.max_context
        )

    def info(self) -> WorkerInfo:
        """Name, role, vocabulary, context length and placement of this worker."""
        node_id = ""
        try:
            import ray

            if ray.is_initialized():
                node_id = ray.get_runtime_context().get_node_id()
        except RuntimeError:
            pass
        return WorkerInfo(
            name=self.spec.name,
            role=self.spec.role,
            vocab_size=self.backend.vocab_size,
            max_context=self.backend.max_context,
            device=self.device,
            gpu_ids=self._gpu_ids(),
            node_id=node_id,
            pid=os.getpid(),
        )

    # ------------------------------------------------------------------ sessions
    def open_session(
        self, session_id: str, prompt_ids: list[int], sampling: RowSampling, seeds: dict[str, int] | None = None
    ) -> CallTiming:
        """Create a session and prefill the prompt (all but its last token)."""
        with self._lock:
            if session_id in self._sessions:
                raise ValueError(f"session {session_id!r} already open on {self.spec.name}")
            if not prompt_ids:
                raise ValueError("prompt_ids must not be empty")
            sources = {
                stream: TorchRandomSource(torch.Generator().manual_seed(int(seed))) for stream, seed in (seeds or {}).items()
            }
            session = _Session(
                context=[int(t) for t in prompt_ids],
                cache=self.backend.new_cache(),
                cached_rows=[[]],
                sampling=sampling,
                sources=sources,
            )
            self._sessions[session_id] = session
            return self._guarded(session_id, self._prefill, session)

    def rollback(self, session_id: str, context_length: int) -> int:
        """Cut the committed context back to ``context_length`` tokens and crop the cache to
        match (calls that bring ``append_tokens`` do this implicitly); returns the cache length."""
        with self._lock:
            session = self._get(session_id)
            if not 1 <= context_length <= len(session.context):
                raise ValueError(f"context_length must be in [1, {len(session.context)}], got {context_length}")
            del session.context[context_length:]
            self._sync(session, [])
            return self.backend.cache_length(session.cache)

    def release(self, session_id: str) -> bool:
        """Free a session; True if it existed."""
        with self._lock:
            return self._sessions.pop(session_id, None) is not None

    def num_sessions(self) -> int:
        with self._lock:
            return len(self._sessions)

    def session_ids(self) -> list[str]:
        with self._lock:
            return sorted(self._sessions)

    def session_stats(self, session_id: str) -> dict[str, Any]:
        """Counters of one session: committed length, cached length, tokens fed, forwards."""
        with self._lock:
            session = self._get(session_id)
            return {
                "context_length": len(session.context),
                "cache_length": self.backend.cache_length(session.cache),
                "tokens_fed": session.tokens_fed,
                "forward_calls": session.forward_calls,
            }

    # ------------------------------------------------------------------ model calls
    def propose(
        self,
        session_id: str,
        append_tokens: list[int],
        num_tokens: int,
        num_drafts: int = 1,
        return_logits: bool = True,
        stream: str = "sample",
    ) -> Proposal:
        """Sample ``num_tokens`` tokens for each of ``num_drafts`` drafts, one categorical call
        per step over the K rows (the reference loops' draft-stream contract). With
        ``return_logits`` the Proposal carries the logits the rows were computed from."""
        with self._lock:
            return self._guarded(
                session_id, self._propose, self._get(session_id), append_tokens, num_tokens, num_drafts, return_logits, stream
            )

    def score(self, session_id: str, append_tokens: list[int], draft_tokens: torch.Tensor) -> torch.Tensor:
        """Rows ``[K, gamma+1, V]`` after the committed context followed by each draft
        ``draft_tokens [K, gamma]`` (one batched forward)."""
        with self._lock:
            rows, _ = self._guarded(session_id, self._score, self._get(session_id), append_tokens, draft_tokens)
            return rows

    def score_and_verify(
        self, session_id: str, append_tokens: list[int], proposal: Proposal, method: str
    ) -> VerifyOutcome:
        """Score ``proposal`` and verify it here with ``verifiers.registry.get_verifier(method)``
        (stream ``verify``; a stateful rule's state is kept in the session). The emitted
        tokens are committed to this session's context."""
        with self._lock:
            return self._guarded(
                session_id, self._score_and_verify, self._get(session_id), append_tokens, proposal, method
            )

    def extend(
        self, session_id: str, append_tokens: list[int], queued_tokens: list[int], num_tokens: int, stream: str = "sample"
    ) -> MemberBlock:
        """Ensemble member call: logits at every queued position and after the queue (one
        forward over pending + queued tokens), then draw ``num_tokens`` tokens after the queue
        (the first from the row after it; one more forward per further token)."""
        with self._lock:
            return self._guarded(
                session_id, self._extend, self._get(session_id), append_tokens, queued_tokens, num_tokens, stream
            )

    def next_logits(self, session_id: str, append_tokens: list[int]) -> tuple[torch.Tensor, CallTiming]:
        """Logits ``[V]`` (truncated to the shared vocabulary, model dtype) of the next position."""
        with self._lock:
            return self._guarded(session_id, self._next_logits, self._get(session_id), append_tokens)

    # ------------------------------------------------------------------ internals
    def _get(self, session_id: str) -> _Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionNotFoundError(f"no session {session_id!r} on worker {self.spec.name!r}")
        session.last_used = time.monotonic()
        return session

    def _guarded(self, session_id: str, function, *args):
        """Run ``function``; a failure frees the session before the error propagates."""
        try:
            return function(*args)
        except Exception:
            self._sessions.pop(session_id, None)
            logger.exception("%s: call on session %s failed; session freed", self.spec.name, session_id)
            raise

    def _feed(self, session: _Session, input_ids: torch.Tensor) -> torch.Tensor:
        """Feed ``input_ids [B, L]`` after the cache; returns logits ``[B, L, V]``."""
        logits, session.cache = self.backend.forward(input_ids, session.cache)
        session.tokens_fed += int(input_ids.numel())
        session.forward_calls += 1
        return logits

    def _rows(self, session: _Session, logits: torch.Tensor) -> torch.Tensor:
        """The one logits -> rows path: shared-vocabulary truncation, then logits_to_probs."""
        sampling = session.sampling
        if sampling.vocab_limit is not None:
            logits = logits[..., : sampling.vocab_limit]
        return logits_to_probs(logits, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)

    def _prefill(self, session: _Session) -> CallTiming:
        started = time.perf_counter()
        fed_before = session.tokens_fed
        if len(session.context) > 1:
            self._feed(session, torch.tensor([session.context[:-1]], dtype=torch.int64))
            session.cached_rows = [list(session.context[:-1])]
        return CallTiming(
            forward_s=time.perf_counter() - started,
            forward_calls=int(len(session.context) > 1),
            tokens_fed=session.tokens_fed - fed_before,
        )

    def _sync(self, session: _Session, append_tokens: list[int]) -> list[int]:
        """Commit ``append_tokens``, roll the cache back to the longest prefix of the context it
        holds (keeping the best row if it holds several drafts) and return the pending tokens
        (committed but not yet fed; at least one)."""
        session.context.extend(int(t) for t in append_tokens)
        context = session.context
        prefixes = [_common_prefix(row, context) for row in session.cached_rows]  # per cache row
        best_row = max(range(len(prefixes)), key=lambda r: prefixes[r])
        if len(session.cached_rows) > 1:
            session.cache = self.backend.select(session.cache, best_row)
        keep = min(prefixes[best_row], len(context) - 1)
        session.cache = self.backend.crop(session.cache, keep)
        session.cached_rows = [list(context[:keep])]
        return context[keep:]

    def _propose(
        self, session: _Session, append_tokens: list[int], num_tokens: int, num_drafts: int, return_logits: bool, stream: str
    ) -> Proposal:
        if num_tokens < 1 or num_drafts < 1:
            raise ValueError(f"num_tokens and num_drafts must be >= 1, got {num_tokens}, {num_drafts}")
        source = session.sources.get(stream)
        if source is None:
            raise ValueError(f"session has no random stream {stream!r} on worker {self.spec.name!r}")
        started = time.perf_counter()
        fed_before, calls_before = session.tokens_fed, session.forward_calls
        pending = self._sync(session, append_tokens)
        logits = self._shared_vocab(session, self._feed(session, torch.tensor([pending], dtype=torch.int64))[:, -1])  # [1, V]
        if num_drafts > 1:
            session.cache = self.backend.repeat(session.cache, num_drafts)
            logits = logits.expand(num_drafts, -1)  # [K, V]: the K drafts share the first row
        step_tokens: list[torch.Tensor] = []
        step_logits: list[torch.Tensor] = []
        for step in range(num_tokens):
            rows = self._rows(session, logits)  # [K, V]
            tokens = source.categorical(rows)  # [K]
            step_tokens.append(tokens)
            if return_logits:
                step_logits.append(logits)
            if step + 1 < num_tokens:
                logits = self._shared_vocab(session, self._feed(session, tokens[:, None])[:, -1])  # [K, V]
        tokens = torch.stack(step_tokens, dim=1)  # [K, n]
        # The cache now holds the context plus the first n-1 tokens of each draft.
        session.cached_rows = [session.context + row[:-1] for row in tokens.tolist()]
        timing = CallTiming(
            forward_s=time.perf_counter() - started,
            forward_calls=session.forward_calls - calls_before,
            tokens_fed=session.tokens_fed - fed_before,
        )
        logits = torch.stack(step_logits, dim=1) if return_logits else None  # [K, n, V]
        return Proposal(model=self.spec.name, tokens=tokens, logits=logits, timing=timing)

    def _score(self, session: _Session, append_tokens: list[int], draft_tokens: torch.Tensor) -> tuple[torch.Tensor, CallTiming]:
        started = time.perf_counter()
        fed_before, calls_before = session.tokens_fed, session.forward_calls
        draft_tokens = torch.as_tensor(draft_tokens, dtype=torch.int64)  # [K, gamma]
        num_drafts, gamma = draft_tokens.shape
        pending = self._sync(session, append_tokens)
        session.cache = self.backend.repeat(session.cache, num_drafts)
        pending_ids = torch.tensor([pending], dtype=torch.int64).expand(num_drafts, -1)  # [K, P]
        logits = self._feed(session, torch.cat([pending_ids, draft_tokens], dim=1))  # [K, P+gamma, V]
        rows = self._rows(session, logits[:, len(pending) - 1 :])  # [K, gamma+1, V]
        session.cached_rows = [session.context + row for row in draft_tokens.tolist()]
        timing = CallTiming(
            forward_s=time.perf_counter() - started,
            forward_calls=session.forward_calls - calls_before,
            tokens_fed=session.tokens_fed - fed_before,
        )
        return rows, timing

    def _score_and_verify(
        self, session: _Session, append_tokens: list[int], proposal: Proposal, method: str
    ) -> VerifyOutcome:
        spec = get_verifier(method)
        source = session.sources.get("verify")
        if source is None:
            raise ValueError(f"session has no 'verify' stream on worker {self.spec.name!r}")
        if proposal.logits is None:
            raise ValueError("verification needs the proposal's logits")
        target_probs, timing = self._score(session, append_tokens, proposal.tokens)  # [K, gamma+1, V]
        started = time.perf_counter()
        # The draft's rows, recomputed bit for bit from its logits by the same transform it
        # sampled with (same request sampling parameters, same code, CPU float64).
        draft_probs = self._rows(session, proposal.logits)  # [K, gamma, V]
        if spec.multi_draft:
            batched = (proposal.tokens[None], draft_probs[None], target_probs[None])  # B = 1
        else:
            batched = (proposal.tokens, draft_probs, target_probs)  # K = 1 is the batch of 1
        result = spec.verify(*batched, generator=source, state=session.verify_state)
        verify_s = time.perf_counter() - started
        session.verify_state = result.state
        emitted = result.emitted(0)
        session.context.extend(emitted)
        return VerifyOutcome(
            emitted=emitted,
            num_accepted=int(result.num_accepted[0]),
            draft_index=None if result.draft_index is None else int(result.draft_index[0]),
            timing=CallTiming(
                forward_s=timing.forward_s, verify_s=verify_s, forward_calls=timing.forward_calls, tokens_fed=timing.tokens_fed
            ),
            proposal_timing=proposal.timing,
            bytes_moved=proposal.nbytes,
        )

    def _next_logits(self, session: _Session, append_tokens: list[int]) -> tuple[torch.Tensor, CallTiming]:
        started = time.perf_counter()
        fed_before = session.tokens_fed
        pending = self._sync(session, append_tokens)
        logits = self._feed(session, torch.tensor([pending], dtype=torch.int64))[0, -1]  # [V]
        session.cached_rows = [list(session.context)]
        timing = CallTiming(
            forward_s=time.perf_counter() - started, forward_calls=1, tokens_fed=session.tokens_fed - fed_before
        )
        return self._shared_vocab(session, logits).clone(), timing

    def _shared_vocab(self, session: _Session, logits: torch.Tensor) -> torch.Tensor:
        limit = session.sampling.vocab_limit
        return logits if limit is None else logits[..., :limit]

    def _extend(
        self, session: _Session, append_tokens: list[int], queued_tokens: list[int], num_tokens: int, stream: str
    ) -> MemberBlock:
        source = session.sources.get(stream)
        if num_tokens > 0 and source is None:
            raise ValueError(f"session has no random stream {stream!r} on worker {self.spec.name!r}")
        started = time.perf_counter()
        fed_before, calls_before = session.tokens_fed, session.forward_calls
        pending = self._sync(session, append_tokens)
        queued = [int(t) for t in queued_tokens]
        logits = self._feed(session, torch.tensor([pending + queued], dtype=torch.int64))[0]  # [P+Q, V]
        logits = self._shared_vocab(session, logits[len(pending) - 1 :])  # [Q+1, V]
        queued_logits, next_logits = logits[:-1], logits[-1]  # [Q, V], [V]
        tokens: list[int] = []
        token_logits: list[torch.Tensor] = []
        for step in range(num_tokens):
            token = int(source.categorical(self._rows(session, next_logits)[None])[0])  # one draw, row [1, V]
            tokens.append(token)
            token_logits.append(next_logits)
            if step + 1 < num_tokens:
                next_logits = self._shared_vocab(session, self._feed(session, torch.tensor([[token]]))[0, -1])  # [V]
        session.cached_rows = [session.context + queued + tokens[:-1]] if tokens else [session.context + queued]
        vocab = queued_logits.shape[-1]
        timing = CallTiming(
            forward_s=time.perf_counter() - started,
            forward_calls=session.forward_calls - calls_before,
            tokens_fed=session.tokens_fed - fed_before,
        )
        return MemberBlock(
            model=self.spec.name,
            queued_logits=queued_logits.clone(),
            tokens=torch.tensor(tokens, dtype=torch.int64),
            token_logits=torch.stack(token_logits) if token_logits else torch.empty(0, vocab, dtype=queued_logits.dtype),
            timing=timing,
        )

    # ------------------------------------------------------------------ idle sessions
    def reap_idle_sessions(self) -> list[str]:
        """Free sessions idle for longer than ``idle_timeout_s``; returns their ids."""
        now = time.monotonic()
        with self._lock:
            expired = [sid for sid, s in self._sessions.items() if now - s.last_used > self.idle_timeout_s]
            for session_id in expired:
                del self._sessions[session_id]
        if expired:
            logger.warning("%s: freed %d idle sessions: %s", self.spec.name, len(expired), expired)
        return expired

    def _reap_forever(self) -> None:
        period = min(REAPER_PERIOD_S, self.idle_timeout_s / 2)
        while True:
            time.sleep(period)
            self.reap_idle_sessions()
