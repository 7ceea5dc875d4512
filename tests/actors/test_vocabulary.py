"""The group vocabulary check: one tokenizer, padded rows masked, short or foreign vocabularies refused."""

from __future__ import annotations

import asyncio
import copy
from types import SimpleNamespace

import pytest

from actors.messages import WorkerInfo
from actors.vocabulary import VocabularyMismatchError, group_vocabulary, tokenizer_identity
from tests.conftest import _build_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return _build_tokenizer(tmp_path_factory.mktemp("vocabulary_tokenizer"))


def _identity(tokenizer):
    return tokenizer_identity(tokenizer)


def test_group_vocabulary_masks_padding_and_refuses_mismatches(tokenizer):
    real = len(tokenizer)
    same = _identity(tokenizer)
    other = copy.deepcopy(tokenizer)
    other.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    assert _identity(other) != same and _identity(copy.deepcopy(tokenizer)) == same
    # Padded rows (the Qwen2.5 0.5B / 7B case): the law is over the tokenizer's tokens.
    assert group_vocabulary({"target": real + 128, "draft": real + 64}, {"target": same, "draft": same}, same) == real
    assert group_vocabulary({"target": real + 128, "draft": real}, {"target": same, "draft": None}, None) == real
    assert group_vocabulary({"target": 50, "draft": 50}, {"target": None, "draft": None}, None) == 50
    refused = [
        (({"target": real + 128, "draft": real - 1}, {"target": same, "draft": same}, same),
         f"models ['draft'] have fewer embedding rows ({{'draft': {real - 1}}}) than the tokenizer's {real} tokens"),
        (({"target": real, "draft": real}, {"target": same, "draft": _identity(other)}, same),
         "models ['draft'] ship a tokenizer that differs from the group's"),
        (({"target": real, "draft": real}, {"target": same, "draft": same}, _identity(other)),
         "models ['draft', 'target'] ship a tokenizer that differs from the group's"),
        (({"target": 60, "draft": 50}, {"target": None, "draft": None}, None),
         "no tokenizer says which ids are real tokens"),
    ]
    for arguments, message in refused:
        with pytest.raises(VocabularyMismatchError) as error:
            group_vocabulary(*arguments)
        assert message in str(error.value)


class _InfoHandle:
    """A worker handle answering only ``info.remote()``."""

    def __init__(self, info: WorkerInfo):
        async def info_call() -> WorkerInfo:
            return info

        self.info = SimpleNamespace(remote=info_call)


def test_coordinator_refuses_a_group_without_one_vocabulary():
    """Bring-up awaits the coordinator's infos before serving: there the group is refused."""
    from actors.coordination.coordinator import Coordinator
    from tests.actors.fake_models import fake_group_config

    config = fake_group_config()
    sizes = {"target": 60, "draft": 50, "partner": 60, "partner2": 60}
    workers = {name: _InfoHandle(WorkerInfo(name, role, sizes[name], 128, "cpu"))
               for name, role in config.roles.items()}
    coordinator = Coordinator(workers, config, export_to_ray=False)
    with pytest.raises(VocabularyMismatchError, match="no tokenizer says which ids are real tokens"):
        asyncio.run(coordinator.infos())
    sizes["draft"] = 60
    workers = {name: _InfoHandle(WorkerInfo(name, role, sizes[name], 128, "cpu"))
               for name, role in config.roles.items()}
    coordinator = Coordinator(workers, config, export_to_ray=False)
    asyncio.run(coordinator.infos())
    assert coordinator.vocab_limit == 60


def test_concurrent_first_requests_fetch_the_infos_once():
    """A burst of first requests (16 clients at start) waits for one fetch of the workers' infos and
    one vocabulary check, not one each; a fetch that failed is made again by the next caller."""
    from actors.coordination.coordinator import Coordinator
    from tests.actors.fake_models import fake_group_config

    config = fake_group_config()
    calls = {"info": 0, "fail": True}

    class CountingHandle:
        def __init__(self, info: WorkerInfo):
            async def info_call() -> WorkerInfo:
                calls["info"] += 1
                await asyncio.sleep(0.01)  # the other callers arrive while it runs
                if calls["fail"]:
                    raise ConnectionError("worker not up yet")
                return info

            self.info = SimpleNamespace(remote=info_call)

    workers = {name: CountingHandle(WorkerInfo(name, role, 60, 128, "cpu")) for name, role in config.roles.items()}
    coordinator = Coordinator(workers, config, export_to_ray=False)

    async def burst(count: int) -> list:
        return await asyncio.gather(*(coordinator.infos() for _ in range(count)), return_exceptions=True)

    failed = asyncio.run(burst(16))
    assert all(isinstance(result, ConnectionError) for result in failed)
    assert calls["info"] == len(workers)  # one fetch for the 16, failed for all of them
    calls["fail"] = False
    answered = asyncio.run(burst(16))
    assert calls["info"] == 2 * len(workers)  # retried once, for all 16
    assert all(result is answered[0] for result in answered) and set(answered[0]) == set(workers)
    assert coordinator.vocab_limit == 60
