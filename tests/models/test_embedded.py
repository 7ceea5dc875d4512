"""The committed embedded model family loads offline, generates, and shares one tokenizer."""

from __future__ import annotations

import hashlib
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: no network

import pytest
import torch

from models import (
    EMBEDDED_MODELS,
    EMBEDDED_ROOT,
    embedded_model_path,
    is_embedded_spec,
    resolve_model_path,
)

CODE_SAMPLES = [
    "def add(a, b):\n    return a + b\n",
    "class Spam(object):\n\t'''Doc – with ünïcödé ✓.'''\n\n    x = {'k': [1, 2.5e-3]}  # comment\n",
    "    if __name__ == \"__main__\":\n        main()\r\n\n\n",
]
# Parameter bounds (tied embeddings counted once): the model card's sizes with some slack.
PARAMETER_BOUNDS = {
    "target": (10_000_000, 16_000_000),
    "draft": (100_000, 1_050_000),
    "partner": (10_000_000, 16_000_000),
    "partner2": (100_000, 10_000_000),
}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def family():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = {}
    for name in EMBEDDED_MODELS:
        path = embedded_model_path(name)
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        loaded[name] = (model, tokenizer)
    return loaded


def test_resolve_embedded_spec_to_local_directory():
    assert resolve_model_path("embedded:target") == str(EMBEDDED_ROOT / "target")
    assert is_embedded_spec("embedded:draft")
    assert resolve_model_path("meta-llama/Llama-3.2-1B") == "meta-llama/Llama-3.2-1B"
    assert resolve_model_path("/some/local/dir") == "/some/local/dir"


def test_unknown_embedded_name_is_a_clear_error():
    with pytest.raises(ValueError, match="'nope'"):
        embedded_model_path("nope")
    with pytest.raises(ValueError, match="target, draft, partner, partner2"):
        resolve_model_path("embedded:nope")


@pytest.mark.parametrize("name", EMBEDDED_MODELS)
def test_checkpoint_directory_is_complete(name):
    files = {path.name for path in embedded_model_path(name).iterdir()}
    for required in ("config.json", "model.safetensors", "generation_config.json",
                     "tokenizer.json", "tokenizer_config.json"):
        assert required in files, f"{name} lacks {required}"


@pytest.mark.parametrize("name", EMBEDDED_MODELS)
def test_loads_in_float32_with_context_room_and_parameter_bounds(family, name):
    model, _ = family[name]
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.dtype == torch.float32
    assert model.config.max_position_embeddings >= 1024
    low, high = PARAMETER_BOUNDS[name]
    parameters = sum(p.numel() for p in model.parameters())
    assert low <= parameters <= high, f"{name}: {parameters} parameters"


def test_draft_is_much_smaller_than_target(family):
    sizes = {name: sum(p.numel() for p in model.parameters()) for name, (model, _) in family.items()}
    assert sizes["draft"] * 10 <= sizes["target"]
    assert sizes["partner2"] < sizes["target"]


@pytest.mark.parametrize("name", EMBEDDED_MODELS)
def test_generates_tokens_offline(family, name):
    model, tokenizer = family[name]
    inputs = tokenizer("def main():\n    ", return_tensors="pt")
    prompt_length = inputs["input_ids"].shape[1]
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    new_tokens = output[0, prompt_length:]  # [6]
    assert new_tokens.numel() == 6
    assert int(new_tokens.max()) < model.config.vocab_size
    with torch.inference_mode():
        logits = model(inputs["input_ids"]).logits  # [1, L, V]
    assert torch.isfinite(logits).all()
    assert logits.shape[-1] == len(tokenizer)


@pytest.mark.parametrize("text", CODE_SAMPLES)
def test_tokenizer_round_trips_code(family, text):
    _, tokenizer = family["target"]
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode("utf-8"))  # BPE merges actually compress code


def test_family_shares_one_tokenizer_and_vocab(family):
    digests = {
        name: hashlib.sha256((embedded_model_path(name) / "tokenizer.json").read_bytes()).hexdigest()
        for name in EMBEDDED_MODELS
    }
    assert len(set(digests.values())) == 1, digests
    vocab_sizes = {name: model.config.vocab_size for name, (model, _) in family.items()}
    assert set(vocab_sizes.values()) == {4096}, vocab_sizes
    for model, tokenizer in family.values():
        assert len(tokenizer) == model.config.vocab_size
        assert tokenizer.eos_token == "<|endoftext|>"
        assert tokenizer.eos_token_id == model.config.eos_token_id
    encodings = {name: tok(CODE_SAMPLES[1])["input_ids"] for name, (_, tok) in family.items()}
    assert all(ids == encodings["target"] for ids in encodings.values())
