"""ModelWorker on a real (tiny random) transformers Llama: the batched step, KV-cache reuse,
rollback, K drafts in one row, session lifetime. The worker class is used in-process here (it
is a plain class that Ray wraps as an actor); the Ray path is covered by the coordinator tests."""

from __future__ import annotations

import os
import time

import pytest
import torch

from actors.messages import OpenSession, RowSampling, WorkItem
from actors.worker.cpu_binding import bind_process, torch_thread_count
from actors.worker.device_worker import DeviceWorker
from actors.worker.model_worker import ModelWorker
from actors.worker.sessions import SessionNotFoundError
from cluster.config import ModelSpec
from verifiers.machines.needs import Extend, NextLogits, Sample, Sampled, ScoreVerify
from verifiers.sampling import logits_to_probs

PROMPT = [5, 17, 42, 99, 7, 13, 250, 3, 64, 11]
SAMPLING = RowSampling(temperature=1.0)
SHARP = RowSampling(temperature=0.01)  # target rows close to one-hot on the greedy token
ATOL = 1e-5  # float32 model: cached vs one-shot attention differ by rounding only


@pytest.fixture(scope="module")
def worker(tiny_checkpoints):
    threads = torch.get_num_threads()
    spec = ModelSpec(name="target", path=str(tiny_checkpoints["target"]), role="target",
                     num_gpus=0, num_cpus=0.25, torch_threads=1, resources={})
    yield ModelWorker(spec, idle_timeout_s=600, max_sessions=32)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def full_logits(worker):
    """Logits computed from scratch (no cache) for any context: the ground truth."""

    @torch.inference_mode()
    def logits(context: list[int]) -> torch.Tensor:
        return worker.backend.model(torch.tensor([context])).logits[0].float()  # [L, V]

    return logits


def _open(prompt=PROMPT, sampling=SAMPLING, seeds=None) -> OpenSession:
    return OpenSession(tuple(prompt), sampling, seeds if seeds is not None else {"sample": 1, "verify": 2})


def _run(worker, *items: WorkItem, releases=(), source_payloads=()):
    outcomes, payloads = worker.run_step(list(items), source_payloads=list(source_payloads), releases=list(releases))
    for outcome in outcomes:
        assert outcome.error is None, outcome.error
    return outcomes, payloads


def session_stats(worker, session_id: str) -> dict:
    """Counters of one of ``worker``'s sessions: committed length, cached length, tokens fed, forwards."""
    session = worker.engine.sessions.get(session_id)
    return {
        "context_length": len(session.context),
        "cache_length": session.base,
        "tokens_fed": session.tokens_fed,
        "forward_calls": session.forward_calls,
    }


def _value(worker, item: WorkItem):
    return _run(worker, item)[0][0].value


def test_prefix_is_never_recomputed(worker):
    try:
        outcome = _run(worker, WorkItem("kv", Sample("target", (), 4), open=_open()))[0][0]
        draft = outcome.value.tokens[0].tolist()
        # The prompt, then the first three draft tokens (the fourth is never fed): 4 forwards.
        assert outcome.timing.tokens_fed == len(PROMPT) + 3 and outcome.timing.forward_calls == 4
        # Accept two draft tokens, then a correction: only the correction needs feeding.
        correction = (draft[2] + 1) % 300
        outcome = _run(worker, WorkItem("kv", Sample("target", (*draft[:2], correction), 3)))[0][0]
        assert outcome.timing.tokens_fed == 1 + 2
        stats = session_stats(worker, "kv")
        assert stats["tokens_fed"] == len(PROMPT) + 3 + 3
        assert stats["context_length"] == len(PROMPT) + 3
        # All accepted + bonus: the cache already holds the first two, so two tokens are fed.
        draft = outcome.value.tokens[0].tolist()
        outcome = _run(worker, WorkItem("kv", Sample("target", (*draft, 7), 2)))[0][0]
        assert outcome.timing.tokens_fed == 2 + 1
    finally:
        worker.release("kv")


def test_one_step_batches_sessions_and_matches_full_forwards(worker, full_logits):
    """Sessions with different prompts and needs share each forward of one step; every row
    equals a forward of the whole context, and the tokens equal each session run alone."""
    prompts = [PROMPT, PROMPT[:3], PROMPT * 3, [9, 8]]
    items = [WorkItem(f"b{i}", Sample("target", (), 3, return_logits=True), open=_open(p, seeds={"sample": 10 + i}))
             for i, p in enumerate(prompts)]
    try:
        outcomes, payloads = _run(worker, *items)
        # The prompts' forward is split where padding costs more than a forward
        # (forward_groups: rows of 30, 10 and 3 + 2 tokens), then two draft positions with all four
        # sessions in one forward each.
        assert worker.engine.rows_per_forward[-5:] == [1, 1, 2, 4, 4]
        for i, (prompt, payload) in enumerate(zip(prompts, payloads)):
            tokens = payload.tokens[0].tolist()
            expected = full_logits(prompt + tokens)[len(prompt) - 1: len(prompt) + 2]  # [3, V]
            torch.testing.assert_close(payload.logits[0], expected, atol=ATOL, rtol=0)
            assert outcomes[i].value.logits is None  # logits travel only in the payload
            alone = _value(worker, WorkItem(f"alone{i}", Sample("target", (), 3), open=_open(prompt, seeds={"sample": 10 + i})))
            assert alone.tokens.tolist() == payload.tokens.tolist()
    finally:
        for i in range(len(prompts)):
            worker.release(f"b{i}")
            worker.release(f"alone{i}")


def test_rolled_back_rows_equal_a_fresh_prefill(worker):
    try:
        draft = _value(worker, WorkItem("rollback", Sample("target", (), 5), open=_open())).tokens[0].tolist()
        _value(worker, WorkItem("rollback", Extend("target", (), tuple(draft), 0)))  # the cache holds the block
        # Reject after one token: commit draft[0] and a correction, then score a new block.
        accepted = (draft[0], (draft[1] + 3) % 300)
        rolled = _value(worker, WorkItem("rollback", Extend("target", accepted, (11, 12, 13), 1)))
        fresh = _value(worker, WorkItem("fresh", Extend("target", (), (11, 12, 13), 1), open=_open(PROMPT + list(accepted))))
        torch.testing.assert_close(rolled.queued_logits, fresh.queued_logits, atol=ATOL, rtol=0)
        torch.testing.assert_close(rolled.token_logits, fresh.token_logits, atol=ATOL, rtol=0)
    finally:
        worker.release("rollback")
        worker.release("fresh")


def test_k_drafts_in_one_row_then_the_winner_continues(worker, full_logits):
    """Multi-draft verification scores K drafts in ONE row after one copy of the prefix; the
    winning draft's entries (draft 1 here: not the one already next to the prefix) are copied
    next to the prefix, and the session goes on exactly as a forward of the whole context."""
    greedy = full_logits(PROMPT).argmax(-1)[-1].item()
    greedy2 = full_logits(PROMPT + [greedy]).argmax(-1)[-1].item()
    garbage = [(greedy + 1) % 300, 4, 4]
    drafts = torch.tensor([garbage, [greedy, greedy2, (greedy2 + 7) % 300]])  # [K=2, gamma=3]
    proposal = Sampled(drafts, torch.zeros(2, 3, worker.backend.vocab_size))  # uniform draft rows: any draft is possible
    try:
        outcome = worker.run_step(
            [WorkItem("multi", ScoreVerify("target", (), draft_need=0, method="spectr"), open=_open(sampling=SHARP, seeds={"verify": 3}),
                      proposal_source=(0, 0))],
            source_payloads=[[proposal]],
        )[0][0]
        assert outcome.error is None, outcome.error
        verified = outcome.value
        assert verified.draft_index == 1 and verified.num_accepted >= 2  # the greedy draft wins (fixed seed)
        assert verified.emitted[: verified.num_accepted] == drafts[1, : verified.num_accepted].tolist()
        after = _value(worker, WorkItem("multi", NextLogits("target", ())))
        torch.testing.assert_close(after, full_logits(PROMPT + verified.emitted)[-1], atol=ATOL, rtol=0)
    finally:
        worker.release("multi")


def test_member_extend_rows_match_full_forward(worker, full_logits):
    try:
        block = _value(worker, WorkItem("member", Extend("target", (), (8, 9), 3), open=_open()))
        assert block.queued_logits.shape[0] == 2 and block.tokens.shape == (3,)
        context = PROMPT + [8, 9] + block.tokens.tolist()
        expected = full_logits(context)[len(PROMPT) - 1:]  # rows predicting 8, 9, t0, t1, t2
        got = torch.cat([block.queued_logits, block.token_logits])
        torch.testing.assert_close(got, expected[:5], atol=ATOL, rtol=0)
        rows = logits_to_probs(got, temperature=1.0)
        assert bool((rows[2:].gather(-1, block.tokens[:, None]) > 0).all())
    finally:
        worker.release("member")


def test_failed_item_frees_its_session_and_spares_the_others(worker):
    outcomes, _ = worker.run_step(
        [WorkItem("fails", Sample("target", (), 2), open=_open(seeds={"verify": 3})),  # owns no sampling stream
         WorkItem("fine", Sample("target", (), 2), open=_open())],
    )
    assert "random stream" in outcomes[0].error
    assert outcomes[1].error is None and outcomes[1].value.tokens.shape == (1, 2)
    with pytest.raises(SessionNotFoundError):
        session_stats(worker, "fails")
    worker.release("fine")


def test_released_sessions_free_their_slots(worker):
    _run(worker, WorkItem("r1", NextLogits("target", ()), open=_open()))
    assert "r1" in worker.engine.sessions.ids()
    _run(worker, releases=["r1"])
    assert "r1" not in worker.engine.sessions.ids()


def test_idle_sessions_are_reaped(worker):
    _run(worker, WorkItem("idle", NextLogits("target", ()), open=_open()), WorkItem("busy", NextLogits("target", ()), open=_open()))
    worker.engine.sessions.idle_timeout_s = 0.2
    try:
        time.sleep(0.3)
        _run(worker, WorkItem("busy", Sample("target", (), 1)))  # touching a session keeps it alive
        assert worker.reap_idle_sessions() == ["idle"]
        assert worker.engine.sessions.ids() == ["busy"]
        assert worker.engine.sessions.parked() == ["idle"]  # resumable until released
        assert worker.release("idle") and worker.engine.sessions.parked() == []
    finally:
        worker.engine.sessions.idle_timeout_s = 600
        worker.release("busy")
    assert worker.num_sessions() == 0


def test_rows_after_a_prefix_reuse_equal_a_full_forward(worker, full_logits):
    """A prompt sharing 30 tokens with a finished request's prompt copies them (every layer's
    keys and values, from the parked slot) and feeds only the rest; its rows equal a forward of
    the whole context from scratch, and its seeded tokens equal those of a run that computes
    the whole prompt."""
    generator = torch.Generator().manual_seed(5)
    shared = torch.randint(1, 300, (30,), generator=generator).tolist()
    first = shared + torch.randint(1, 300, (10,), generator=generator).tolist()
    second = shared + torch.randint(1, 300, (6,), generator=generator).tolist()
    cache = worker.engine.prefix_cache
    try:
        _run(worker, WorkItem("pc1", Sample("target", (), 2), open=_open(first)))
        worker.release("pc1")
        reused = cache.reused_tokens_total
        outcomes, payloads = _run(worker, WorkItem("pc2", Sample("target", (), 3, return_logits=True),
                                                   open=_open(second, seeds={"sample": 9})))
        assert cache.reused_tokens_total - reused == len(shared)
        assert outcomes[0].timing.tokens_fed == len(second) - len(shared) + 2
        tokens = payloads[0].tokens[0].tolist()
        expected = full_logits(second + tokens)[len(second) - 1: len(second) + 2]  # [3, V]
        torch.testing.assert_close(payloads[0].logits[0], expected, atol=ATOL, rtol=0)
        cache.enabled = False
        computed = _value(worker, WorkItem("pc3", Sample("target", (), 3), open=_open(second, seeds={"sample": 9})))
        assert computed.tokens[0].tolist() == tokens
    finally:
        cache.enabled = True
        for session_id in ("pc1", "pc2", "pc3"):
            worker.release(session_id)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="CPU binding needs Linux affinity and two cores")
def test_a_worker_started_with_cores_runs_on_them_and_reports_them(tiny_checkpoints):
    """``cpu_cores`` (resources.cpu_affinity) binds the worker's whole process at start (a ModelWorker's,
    a DeviceWorker's); in process here, so the test's own threads are bound back afterwards."""
    original = sorted(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    spec = ModelSpec(name="draft", path=str(tiny_checkpoints["draft"]), role="draft", num_gpus=0, num_cpus=0.25,
                     torch_threads=1, resources={})
    try:
        info = ModelWorker(spec, max_sessions=1, cpu_cores=[original[-1]]).info()
        assert info.cpu_cores == (original[-1],)
        tasks = os.listdir("/proc/self/task")
        assert all(os.sched_getaffinity(int(tid)) == {original[-1]} for tid in tasks)  # every thread, not only this one
        assert torch.get_num_threads() == 1  # the configured thread count is kept
        unbound = ModelWorker(spec, max_sessions=1, cpu_cores=[10_000])  # no such core: a warning, not a failure
        assert unbound.info().cpu_cores == (original[-1],)
        hosted = DeviceWorker([spec], max_sessions=1, cpu_cores=[original[0]])  # models sharing a worker: its process
        assert hosted.info("draft").cpu_cores == (original[0],)
    finally:
        bind_process(original, "test process")
        torch.set_num_threads(threads)
    assert sorted(os.sched_getaffinity(0)) == original


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="CPU binding needs Linux affinity and two cores")
def test_a_worker_runs_as_many_torch_threads_as_configured_or_its_cores_under_auto(tiny_checkpoints):
    """``resources.torch_threads``: a count is set as given; ``"auto"`` is the cores of the worker's
    process once bound (all of them when it is not bound)."""
    original = sorted(os.sched_getaffinity(0))
    threads = torch.get_num_threads()

    def spec(torch_threads):
        return ModelSpec(name="draft", path=str(tiny_checkpoints["draft"]), role="draft", num_gpus=0, num_cpus=0.25,
                         torch_threads=torch_threads, resources={})
    try:
        ModelWorker(spec(2), max_sessions=1)
        assert torch.get_num_threads() == 2
        ModelWorker(spec("auto"), max_sessions=1)
        assert torch.get_num_threads() == len(original)  # not bound: every core this process may use
        ModelWorker(spec("auto"), max_sessions=1, cpu_cores=[original[-1]])
        assert torch.get_num_threads() == 1  # bound to one core: one thread
        assert torch_thread_count("auto") == 1 and torch_thread_count(3) == 3
    finally:
        bind_process(original, "test process")
        torch.set_num_threads(threads)
    assert sorted(os.sched_getaffinity(0)) == original


def test_a_call_reports_its_first_forward_round_apart(worker):
    """A call of several forwards times its first round (rows, forward, sampling) apart from the
    whole call; a call of one forward has only that round. The step cost model prices a draft's
    block as its first round plus one further round per draft from these."""
    try:
        _run(worker, WorkItem("rounds", Sample("target", (), 1), open=_open()))
        several = _run(worker, WorkItem("rounds", Sample("target", (), 4)))[0][0].timing
        assert several.forward_calls == 4
        assert 0.0 < several.first_round_s < several.call_s
        single = _run(worker, WorkItem("rounds", Sample("target", (), 1)))[0][0].timing
        assert single.forward_calls == 1
        assert 0.0 < single.first_round_s <= single.call_s
    finally:
        worker.release("rounds")


def test_a_first_round_counts_the_rows_built_before_its_forward(worker, monkeypatch):
    """The first round is timed from the call's start: building its rows (slowed here by 30 ms)
    is part of it, not of the further rounds."""
    from actors.worker.step import Step

    build_rows = Step._rows

    def slow_rows(self, live):
        time.sleep(0.03)
        return build_rows(self, live)

    try:
        _run(worker, WorkItem("rows", Sample("target", (), 1), open=_open()))
        monkeypatch.setattr(Step, "_rows", slow_rows)
        timing = _run(worker, WorkItem("rows", Sample("target", (), 1)))[0][0].timing
        assert timing.first_round_s >= 0.03
    finally:
        worker.release("rows")
