"""Chunked prefill (actors/worker/forward_plan.py, actors/worker/engine.py, actors/coordination/scheduler.py): a
prompt longer than the step's token budget is fed in chunks over several steps, and nothing the user sees changes.

- the budget's split, table-driven (:func:`actors.worker.forward_plan.prefill_grants`);
- every strategy through the in-process Coordinator and Scheduler over the fake models (their
  logits are a function of exactly the columns a token sees, so a wrong column, position or
  mask changes them): the same tokens with and without chunking for the same seeds, also after
  a prefix reuse;
- the embedded Llama target: the row after a chunked prefill, and the keys/values it wrote,
  equal a one-shot prefill's; prompt logits collected over chunks equal one forward's; sd with
  the embedded draft gives the same tokens with and without chunking.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from actors.request_schema import GenerationRequest
from actors.coordination.coordinator import Coordinator
from actors.worker.forward_plan import prefill_grants
from actors.messages import OpenSession, Prefill, RowSampling, WorkItem
from actors.worker.model_worker import ModelWorker
from benchmarks.served.runners import LocalActorHandle
from cluster.config import ConfigError, ModelSpec, parse_app_args
from models import EMBEDDED_ROOT
from tests.actors.fake_models import FAKE_CONTEXT, VOCAB, FunctionModelWorker, fake_group_config
from verifiers.machines.needs import NextLogits

NO_CHUNKS = 100_000  # a budget no prompt here reaches: one-shot prefill
SMALL_BUDGET = 8  # fake prompts of 40 tokens: 5+ chunks
LONG_PROMPT = tuple((i * 7 + 3) % VOCAB for i in range(40))
SHORT_PROMPT = (1, 2, 3)
MAX_TOKENS = 12
assert len(LONG_PROMPT) + MAX_TOKENS <= FAKE_CONTEXT

STRATEGIES = {
    "ar": {"strategy": "ar"},
    "sd": {"strategy": "sd", "method": "token", "gamma": 3},
    "multi_draft": {"strategy": "multi_draft", "method": "spectr", "gamma": 2, "num_drafts": 2},
    "se": {"strategy": "se", "method": "token", "ensemble": "weighted", "members": ["target", "partner"],
           "gammas": [2, 1]},
}


# ------------------------------------------------------------------------- the budget's split
@pytest.mark.parametrize(
    ("other_tokens", "remaining", "budget", "expected"),
    [
        (0, [100], 32, [32]),  # one prompt alone: the whole budget
        (10, [100, 100], 32, [22, 0]),  # running rows first, the rest to the first prompt in line
        (10, [5, 100], 32, [5, 17]),  # a prompt that needs less leaves the rest to the next
        (40, [100, 100], 32, [8, 0]),  # running rows take it all: the first prompt still gets a quarter
        (0, [0, 3], 32, [0, 3]),  # a prompt already in the cache feeds nothing
        (0, [50], 2, [2]),
    ],
)
def test_prefill_grants(other_tokens, remaining, budget, expected):
    assert prefill_grants(other_tokens, remaining, budget) == expected


def test_a_bad_budget_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="engine.max_tokens_per_step"):
        parse_app_args({"models": {"t": {"path": "fake:target", "role": "target"}},
                        "engine": {"max_tokens_per_step": 0}})


# ------------------------------------------------------------------- served, fake models
class _RowLengths:
    """Wraps each fake backend's forward to record the longest row it was given."""

    def __init__(self, workers: dict[str, FunctionModelWorker]):
        self.longest = 0
        for worker in workers.values():
            backend = worker.backend
            backend.forward = self._wrap(backend.forward)

    def _wrap(self, forward):
        def recorded(rows):
            self.longest = max(self.longest, *(len(row) for row in rows))
            return forward(rows)
        return recorded


def _fake_coordinator(budget: int) -> tuple[Coordinator, dict[str, FunctionModelWorker]]:
    config = fake_group_config(overlap=False).model_copy(update={"max_tokens_per_step": budget})
    workers = {m.name: FunctionModelWorker(m, config.session_idle_timeout_s, max_tokens_per_step=budget)
               for m in config.models}
    coordinator = Coordinator({name: LocalActorHandle(w) for name, w in workers.items()}, config, export_to_ray=False)
    return coordinator, workers


def _request(name: str, seed: int, prompt: tuple[int, ...], speculation: dict) -> GenerationRequest:
    return GenerationRequest(request_id=name, prompt_ids=list(prompt), speculation=speculation,
                             sampling={"max_tokens": MAX_TOKENS, "seed": seed, "temperature": 1.0})


def _serve(coordinator: Coordinator, waves: list[list[GenerationRequest]]) -> list[list[int]]:
    """Each wave's requests concurrently, the waves one after the other; every request's tokens."""

    async def collect(request):
        chunks = [chunk async for chunk in coordinator.generate(request)]
        assert chunks[-1].finished and chunks[-1].error is None, chunks[-1]
        return [t for chunk in chunks for t in chunk.token_ids]

    async def run_all():
        try:
            tokens = []
            for wave in waves:
                tokens += await asyncio.gather(*(collect(r) for r in wave))
            return tokens
        finally:
            await coordinator.scheduler.close()

    return asyncio.run(run_all())


def _served_tokens(budget: int, waves: list[list[GenerationRequest]]) -> tuple[list[list[int]], int, dict]:
    coordinator, workers = _fake_coordinator(budget)
    lengths = _RowLengths(workers)
    return _serve(coordinator, waves), lengths.longest, workers


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_tokens_are_the_same_with_and_without_chunked_prefill(strategy):
    speculation = STRATEGIES[strategy]
    # Short-prompt streams running while two long prompts arrive (one per seed, same prompt).
    wave = [_request(f"short-{seed}", seed, SHORT_PROMPT, speculation) for seed in range(3)]
    wave += [_request(f"long-{seed}", seed, LONG_PROMPT, speculation) for seed in (7, 8)]
    whole, whole_longest, _ = _served_tokens(NO_CHUNKS, [wave])
    chunked, chunked_longest, _ = _served_tokens(SMALL_BUDGET, [wave])
    assert chunked == whole
    assert whole_longest >= len(LONG_PROMPT) and chunked_longest <= SMALL_BUDGET  # the prompts were chunked


def test_a_chunked_prefill_after_a_prefix_reuse_gives_the_same_tokens():
    speculation = STRATEGIES["sd"]
    donor = _request("donor", 1, LONG_PROMPT, speculation)
    reuser = _request("reuser", 2, LONG_PROMPT[:30] + (4, 0, 5, 1, 2, 3, 4, 5, 0, 1), speculation)
    whole, _, _ = _served_tokens(NO_CHUNKS, [[donor], [reuser]])
    chunked, _, workers = _served_tokens(SMALL_BUDGET, [[donor], [reuser]])
    assert chunked == whole
    for name in ("target", "draft"):  # the reuser's 30 shared tokens came from the donor's parked slot
        assert workers[name].engine.prefix_cache.reused_tokens_total >= 30


# ------------------------------------------------------------------------- the embedded Llama
def _embedded_worker(name: str, budget: int) -> ModelWorker:
    spec = ModelSpec(name=name, path=str(EMBEDDED_ROOT / name), role="target", num_gpus=0, num_cpus=0.25,
                     torch_threads=1, resources={})
    return ModelWorker(spec, idle_timeout_s=600, max_sessions=4, prefix_caching=False, max_tokens_per_step=budget)


@pytest.fixture(scope="module")
def llama():
    threads = torch.get_num_threads()
    yield _embedded_worker("target", budget=64)
    torch.set_num_threads(threads)


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(1, 4000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _open(prompt: list[int]) -> OpenSession:
    return OpenSession(tuple(prompt), RowSampling())


def test_a_chunked_prefill_writes_the_keys_values_and_row_of_a_one_shot_prefill(llama):
    prompt = _prompt(300, seed=3)
    one_shot = llama.run_step([WorkItem("one-shot", NextLogits("target", ()), open=_open(prompt))])[0][0]
    steps, opened = 0, _open(prompt)
    while True:  # the chunks, one step each, then the row after the prompt
        outcome = llama.run_step([WorkItem("chunked", Prefill("target"), open=opened)])[0][0]
        assert outcome.error is None, outcome.error
        assert outcome.value.fed <= llama.engine.max_tokens_per_step
        opened, steps = None, steps + 1
        if outcome.value.remaining == 0:
            break
    assert steps == 5  # 299 tokens in chunks of 64
    chunked = llama.run_step([WorkItem("chunked", NextLogits("target", ()))])[0][0]
    assert (chunked.value - one_shot.value).abs().max().item() < 1e-5  # [V]
    cache, sessions = llama.backend.cache, llama.engine.sessions
    one_shot_slot, chunked_slot = (sessions.get(name).slot for name in ("one-shot", "chunked"))
    columns = range(len(prompt))  # the prompt's keys/values, the last token's from NextLogits
    difference = cache.read_columns(one_shot_slot, columns) - cache.read_columns(chunked_slot, columns)  # [2, layers, H, n, D]
    assert difference.abs().max().item() < 1e-5
    llama.release("one-shot")
    llama.release("chunked")


def test_prompt_logits_are_collected_from_every_chunk(llama):
    prompt = _prompt(200, seed=4)
    chunked = llama.prompt_logits("score-chunked", prompt)  # 199 positions in chunks of 64
    whole_worker = llama.engine.max_tokens_per_step
    llama.engine.max_tokens_per_step = 10_000
    try:
        whole = llama.prompt_logits("score-whole", prompt)  # one forward
    finally:
        llama.engine.max_tokens_per_step = whole_worker
    assert chunked.shape == whole.shape == (len(prompt) - 1, llama.backend.vocab_size)
    assert (chunked - whole).abs().max().item() < 1e-4
    assert llama.num_sessions() == 0


def test_sd_on_the_embedded_models_gives_the_same_tokens_with_and_without_chunking():
    threads = torch.get_num_threads()
    prompt = _prompt(150, seed=5)
    config = parse_app_args({
        "models": {"target": {"path": str(EMBEDDED_ROOT / "target"), "role": "target"},
                   "draft": {"path": str(EMBEDDED_ROOT / "draft"), "role": "draft"}},
        "defaults": {"strategy": "sd", "method": "token", "gamma": 3},
        "resources": {"gpus_per_model": 0, "cpus_per_model": 0.25},
        "engine": {"overlap": False, "goodput_gamma": False},
    }).freeze().model_copy(update={"tokenizer_path": None})
    outputs = {}
    try:
        for budget in (NO_CHUNKS, 32):
            workers = {m.name: LocalActorHandle(ModelWorker(m, 600, max_sessions=4, max_tokens_per_step=budget))
                       for m in config.models}
            coordinator = Coordinator(workers, config.model_copy(update={"max_tokens_per_step": budget}),
                                      export_to_ray=False)
            wave = [_request(f"r{seed}", seed, tuple(prompt if seed else prompt[:5]), {"strategy": "sd"})
                    for seed in range(3)]
            outputs[budget] = _serve(coordinator, [wave])
    finally:
        torch.set_num_threads(threads)
    assert outputs[32] == outputs[NO_CHUNKS]
