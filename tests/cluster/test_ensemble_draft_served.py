"""se with a draft proposer served through HTTP (proxy -> ingress -> coordinator -> a worker per
model), 16 clients at once: the sampled law of 2-token completions is the ensemble's (chi-square
against the exact law computed here from the tiny checkpoints with transformers), and the
response's ``speculation`` block says which proposer ran and its block efficiency."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch

from tests.verifiers.tiny_models import chi_square_pvalue
from verifiers.reference.exact import sequence_law
from verifiers.reference.ensemble import ensemble_next_token_probs

CLIENTS = 16
SAMPLES = 480
LENGTH = 2
TOP_K = 3  # 9 outcomes over 2 tokens: enough samples per cell at this count
SIGNIFICANCE = 1e-3  # fixed seeds: the outcome is deterministic; alpha bounds a false alarm
SPECULATION = {"strategy": "se", "ensemble": "weighted", "members": ["target", "partner"], "weights": [0.6, 0.4],
               "proposer": "draft", "method": "block", "gamma": 2}


def _member_fn(checkpoint_dir, vocab: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.float32).eval()

    def logits(context: tuple[int, ...]) -> torch.Tensor:
        with torch.inference_mode():
            return model(torch.tensor([list(context)])).logits[0, -1, :vocab].to(torch.float64)  # [V]

    return logits


def _completion(client: httpx.Client, prompt_ids: list[int], seed: int) -> dict:
    response = client.post("/v1/completions", json={
        "prompt": prompt_ids, "max_tokens": LENGTH, "temperature": 1.0, "top_k": TOP_K, "seed": seed,
        "ignore_eos": True, "return_token_ids": True, "speculation": SPECULATION,
    })
    assert response.status_code == 200, response.text
    return response.json()


def test_served_drafted_ensemble_samples_the_ensemble_law(serve_app, tiny_checkpoints, greedy_reference):
    prompt_ids = greedy_reference.encode("def main(argv=None):\n")
    vocab = len(greedy_reference.tokenizer)
    members = [_member_fn(tiny_checkpoints[name], vocab) for name in SPECULATION["members"]]
    law = sequence_law(ensemble_next_token_probs(members, weights=SPECULATION["weights"], top_k=TOP_K),
                       tuple(prompt_ids), LENGTH)
    with httpx.Client(base_url=serve_app.http_url, timeout=120.0) as client, ThreadPoolExecutor(CLIENTS) as pool:
        bodies = list(pool.map(lambda seed: _completion(client, prompt_ids, 7_000 + seed), range(SAMPLES)))
    samples = [tuple(body["choices"][0]["token_ids"]) for body in bodies]
    assert Counter(len(sample) for sample in samples) == {LENGTH: SAMPLES}
    assert chi_square_pvalue(samples, law) > SIGNIFICANCE
    speculation = bodies[0]["speculation"]
    assert speculation["proposer"] == "draft" and speculation["strategy"] == "se"
    assert speculation["model_calls"]["partner"] >= 1 and speculation["block_efficiency"] > 0
