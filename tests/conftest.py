"""Fixtures shared by the whole test suite.

* ``ray_session``: ONE local Ray instance per test session (started on first use, shut down at
  the end). Tests that need Ray take this fixture; nothing else calls ``ray.init``.
* ``tiny_checkpoints``: a directory of tiny random Llama checkpoints (``target``, ``draft``,
  ``partner``, ``partner2``) sharing one byte-level BPE tokenizer, built once per session in a
  tmp dir (nothing is downloaded). ``draft`` and ``partner`` are perturbed copies of ``target``
  so speculative blocks are often accepted (exercising cache rollback at many lengths).
* ``tiny_app_args``: the specserve application ``args`` (as a plain dict, the YAML form) that
  serve those checkpoints on CPU.
"""

from __future__ import annotations

import logging
import os
import pathlib

import pytest

# Nothing in the test suite may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

logger = logging.getLogger(__name__)

#: Logical CPUs of the shared test Ray instance. Larger than the machine's 2 cores on purpose:
#: actors here are mostly idle between calls, and model workers cap their torch threads.
RAY_TEST_NUM_CPUS = 8

TINY_CONTEXT = 256

_TOKENIZER_CORPUS = [
    "def main(argv=None):\n    parser = argparse.ArgumentParser(description='tool')\n    return 0\n",
    "class Counter(dict):\n    def __missing__(self, key):\n        return 0\n",
    "import os\nimport sys\n\nfor name in sorted(os.listdir('.')):\n    print(name)\n",
    "The quick brown fox jumps over the lazy dog. Über naïve café — ünïcödé ✓ 你好\n",
    "if __name__ == '__main__':\n    raise SystemExit(main(sys.argv[1:]))\n",
    "    # comment: return the value of x + y * z when ready\n    result = [i ** 2 for i in range(10)]\n",
]


#: The tiny tokenizer's chat template: unlike the server's fallback, it starts with a special
#: token and reads a template variable (``brief``), so tests see which rendering was used.
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% if brief %}(brief){% endif %}{% endif %}"
)


def _build_tokenizer(directory: pathlib.Path):
    """A small byte-level BPE tokenizer saved in transformers format (AutoTokenizer loads it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_TOKENIZER_CORPUS * 4, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", bos_token="<|endoftext|>", unk_token=None,
        chat_template=TINY_CHAT_TEMPLATE,
    )
    wrapped.save_pretrained(directory)
    return wrapped


def _tiny_llama(vocab_size: int, hidden: int, layers: int, seed: int, eos_token_id: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=TINY_CONTEXT,
        initializer_range=0.2,  # spread-out logits: greedy argmax ties are then vanishingly rare
        tie_word_embeddings=False,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def _perturbed_copy(model, scale: float, seed: int):
    import copy

    import torch

    clone = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in clone.parameters():
            parameter.add_(scale * parameter.std() * torch.randn(parameter.shape, generator=generator))
    return clone


def build_tiny_checkpoints(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Write tiny random Llama checkpoints + tokenizer under ``root``; return name -> dir."""
    tokenizer_dir = root / "tokenizer"
    tokenizer = _build_tokenizer(tokenizer_dir)
    vocab_size = len(tokenizer)
    eos = tokenizer.eos_token_id
    target = _tiny_llama(vocab_size, hidden=64, layers=2, seed=1, eos_token_id=eos)
    checkpoints = {
        "target": target,
        "draft": _perturbed_copy(target, scale=0.15, seed=2),
        "partner": _perturbed_copy(target, scale=0.5, seed=3),
        "partner2": _tiny_llama(vocab_size, hidden=32, layers=1, seed=4, eos_token_id=eos),
    }
    paths = {}
    for name, model in checkpoints.items():
        directory = root / name
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        paths[name] = directory
    logger.info("built tiny checkpoints under %s (vocab %d)", root, vocab_size)
    return paths


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, pathlib.Path]:
    """name -> directory of a tiny random Llama checkpoint (with tokenizer files)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return build_tiny_checkpoints(tmp_path_factory.mktemp("tiny_checkpoints"))
    finally:
        torch.set_num_threads(threads)


def tiny_args_dict(checkpoints: dict[str, pathlib.Path], **defaults) -> dict:
    """The application ``args`` (YAML form) for a group over ``checkpoints``."""
    roles = {"target": "target", "draft": "draft", "partner": "member", "partner2": "member"}
    return {
        "models": {name: {"path": str(path), "role": roles[name]} for name, path in checkpoints.items()},
        "defaults": {"strategy": "sd", "method": "block", "gamma": 4, "members": ["target", "partner"], **defaults},
        "resources": {"cpus_per_model": 0.25, "torch_threads": 1},
        "limits": {"max_concurrent_requests": 16, "session_idle_timeout_s": 120},
    }


@pytest.fixture(scope="session")
def tiny_app_args(tiny_checkpoints) -> dict:
    """specserve ``args`` serving the tiny checkpoints (sd / block by default)."""
    return tiny_args_dict(tiny_checkpoints)


@pytest.fixture(scope="session")
def ray_session():
    """The one Ray instance of the test session (local, no dashboard)."""
    import ray

    from cluster.serving.bringup import set_slow_start_defaults

    started_here = False
    if not ray.is_initialized():
        set_slow_start_defaults()  # a loaded runner must not fail Serve's proxy start
        ray.init(
            num_cpus=RAY_TEST_NUM_CPUS,
            include_dashboard=False,
            log_to_driver=True,
            runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}},
        )
        started_here = True
    yield ray
    if started_here:
        ray.shutdown()


def pytest_configure(config):
    """Under pytest-xdist (``make test-fast``), each worker's torch gets its share of the cores:
    two workers of two threads each on two cores oversubscribe them, and a loaded machine then
    runs some forwards tens of times slower."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1 and os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


# Modules whose tests start servers or Ray in subprocesses (no ray_session fixture to see).
_SERVER_MODULES = ("test_serve_command", "test_app_serve_command", "test_ray_cli", "test_multinode", "test_bringup")


def pytest_collection_modifyitems(config, items):
    """Mark every test that needs Ray or a server ``ray`` (``make test-fast`` leaves them out):
    those whose fixtures reach ``ray_session``, and the modules that start their own."""
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module is not None else ""
        if "ray_session" in getattr(item, "fixturenames", ()) or module in _SERVER_MODULES:
            item.add_marker(pytest.mark.ray)
