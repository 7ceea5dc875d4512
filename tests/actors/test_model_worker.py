"""ModelWorker on a real (tiny random) transformers Llama: KV-cache reuse, rollback, batched
drafts, session lifetime. The worker class is used in-process here (it is a plain class that
Ray wraps as an actor); the Ray path is covered by the coordinator tests."""

from __future__ import annotations

import time

import pytest
import torch

from actors.messages import RowSampling
from actors.model_worker import ModelWorker, SessionNotFoundError
from cluster.config import ModelSpec
from verifiers.sampling import logits_to_probs

PROMPT = [5, 17, 42, 99, 7, 13, 250, 3, 64, 11]
SAMPLING = RowSampling(temperature=1.0)
ATOL = 1e-5  # float32 model: cached vs one-shot attention differ by rounding only


@pytest.fixture(scope="module")
def worker(tiny_checkpoints):
    threads = torch.get_num_threads()
    spec = ModelSpec(name="target", path=str(tiny_checkpoints["target"]), role="target", torch_threads=1)
    yield ModelWorker(spec, idle_timeout_s=600)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def full_rows(worker):
    """Rows computed from scratch (no cache) for any context: the ground truth."""

    @torch.inference_mode()
    def rows(context: list[int]) -> torch.Tensor:
        logits = worker.backend.model(torch.tensor([context])).logits[0].float()  # [L, V]
        return logits_to_probs(logits, temperature=SAMPLING.temperature)

    return rows


def _open(worker, session_id: str, prompt=PROMPT, seeds=None) -> None:
    worker.open_session(session_id, list(prompt), SAMPLING, seeds or {"sample": 1, "verify": 2})


def test_prefix_is_never_recomputed(worker):
    _open(worker, "kv")
    try:
        assert worker.session_stats("kv")["tokens_fed"] == len(PROMPT) - 1  # prefill leaves the last token pending
        proposal = worker.propose("kv", [], 4)
        draft = proposal.tokens[0].tolist()
        # One pending token, then the first three draft tokens (the fourth is never fed).
        assert proposal.timing.tokens_fed == 4 and proposal.timing.forward_calls == 4
        # Accept two draft tokens, then a correction: only the correction needs feeding.
        correction = (draft[2] + 1) % 300
        proposal = worker.propose("kv", draft[:2] + [correction], 3)
        assert proposal.timing.tokens_fed == 1 + 2
        stats = worker.session_stats("kv")
        assert stats["tokens_fed"] == len(PROMPT) - 1 + 4 + 3
        assert stats["context_length"] == len(PROMPT) + 3
        # All accepted + bonus: the cache already holds the first two, so two tokens are fed.
        draft = proposal.tokens[0].tolist()
        proposal = worker.propose("kv", draft + [7], 2)
        assert proposal.timing.tokens_fed == 2 + 1
    finally:
        worker.release("kv")


def test_rolled_back_rows_equal_a_fresh_prefill(worker, full_rows):
    _open(worker, "rollback")
    _open(worker, "fresh-a", seeds={"sample": 1})
    try:
        draft = worker.propose("rollback", [], 5).tokens[0].tolist()
        scored = torch.tensor([draft])
        worker.score("rollback", [], scored)  # the cache now holds the whole draft block
        # Reject after one token: commit draft[0] and a correction, then score a new block.
        accepted = [draft[0], (draft[1] + 3) % 300]
        new_block = torch.tensor([[11, 12, 13]])
        rows_after_rollback = worker.score("rollback", accepted, new_block)  # [1, 4, V]
        _open(worker, "fresh", prompt=PROMPT + accepted)
        rows_fresh = worker.score("fresh", [], new_block)
        torch.testing.assert_close(rows_after_rollback, rows_fresh, atol=ATOL, rtol=0)
        context = PROMPT + accepted + [11, 12, 13]
        expected = full_rows(context)[len(PROMPT) + len(accepted) - 1 :]  # [4, V]
        torch.testing.assert_close(rows_after_rollback[0], expected, atol=ATOL, rtol=0)
    finally:
        for session_id in ("rollback", "fresh", "fresh-a"):
            worker.release(session_id)


def test_explicit_rollback_matches_a_fresh_prefill(worker):
    _open(worker, "explicit")
    try:
        worker.score("explicit", [1, 2, 3], torch.tensor([[4, 5, 6]]))
        assert worker.rollback("explicit", len(PROMPT) + 1) == len(PROMPT)  # keeps PROMPT + [1], last unfed
        rows = worker.score("explicit", [9], torch.tensor([[8]]))
        _open(worker, "fresh", prompt=PROMPT + [1, 9])
        torch.testing.assert_close(rows, worker.score("fresh", [], torch.tensor([[8]])), atol=ATOL, rtol=0)
        with pytest.raises(ValueError, match="context_length"):
            worker.rollback("explicit", 0)
    finally:
        worker.release("explicit")
        worker.release("fresh")


def test_proposal_rows_are_the_rows_tokens_were_drawn_from(worker, full_rows):
    _open(worker, "rows")
    try:
        proposal = worker.propose("rows", [], 4, num_drafts=3)
        assert proposal.tokens.shape == (3, 4) and proposal.logits.shape[:2] == (3, 4)
        assert proposal.logits.dtype == torch.float32  # the smallest exact form of the rows
        probs = logits_to_probs(proposal.logits, temperature=SAMPLING.temperature)  # [3, 4, V]
        for k in range(3):
            context = PROMPT + proposal.tokens[k].tolist()
            expected = full_rows(context)[len(PROMPT) - 1 : len(PROMPT) + 3]  # [4, V]
            torch.testing.assert_close(probs[k], expected, atol=ATOL, rtol=0)
            drawn = probs[k].gather(-1, proposal.tokens[k][:, None])
            assert bool((drawn > 0).all())
    finally:
        worker.release("rows")


def test_batched_multi_draft_scores_equal_single_draft_scores(worker):
    _open(worker, "batched")
    _open(worker, "single")
    try:
        drafts = torch.tensor([[1, 2, 3], [1, 2, 9], [40, 41, 42]])  # [K=3, gamma=3]
        batched = worker.score("batched", [], drafts)  # [3, 4, V]
        assert batched.shape[:2] == (3, 4)
        for k in range(3):
            single = worker.score("single", [], drafts[k : k + 1])
            torch.testing.assert_close(batched[k : k + 1], single, atol=ATOL, rtol=0)
        # The session keeps working after a batched call: commit draft 1's prefix and go on.
        rows = worker.score("batched", [1, 2, 5], torch.tensor([[6]]))
        _open(worker, "fresh", prompt=PROMPT + [1, 2, 5])
        torch.testing.assert_close(rows, worker.score("fresh", [], torch.tensor([[6]])), atol=ATOL, rtol=0)
    finally:
        for session_id in ("batched", "single", "fresh"):
            worker.release(session_id)


def test_member_extend_rows_match_full_forward(worker, full_rows):
    _open(worker, "member")
    try:
        block = worker.extend("member", [], [8, 9], 3)
        assert block.queued_logits.shape[0] == 2 and block.tokens.shape == (3,)
        context = PROMPT + [8, 9] + block.tokens.tolist()
        expected = full_rows(context)[len(PROMPT) - 1 :]  # rows predicting 8, 9, t0, t1, t2
        got = logits_to_probs(torch.cat([block.queued_logits, block.token_logits]), temperature=1.0)
        torch.testing.assert_close(got, expected[:5], atol=ATOL, rtol=0)
    finally:
        worker.release("member")


def test_failed_call_frees_the_session(worker):
    _open(worker, "fails", seeds={"verify": 3})
    with pytest.raises(ValueError, match="random stream"):
        worker.propose("fails", [], 2, stream="sample")  # this session owns no sampling stream
    with pytest.raises(SessionNotFoundError):
        worker.session_stats("fails")


def test_idle_sessions_are_reaped(worker):
    _open(worker, "idle")
    _open(worker, "busy")
    worker.idle_timeout_s = 0.2
    try:
        time.sleep(0.3)
        worker.propose("busy", [], 1)  # touching a session keeps it alive
        assert worker.reap_idle_sessions() == ["idle"]
        assert worker.session_ids() == ["busy"]
    finally:
        worker.idle_timeout_s = 600
        worker.release("busy")
    assert worker.num_sessions() == 0
