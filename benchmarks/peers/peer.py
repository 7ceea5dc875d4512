"""The peer: transformers assisted generation on the same models, prompts and temperature.

``target.generate(assistant_model=draft, do_sample=True, ...)`` is transformers' speculative
sampling (token verification, Leviathan et al. Alg. 1, in ``_speculative_sampling``), run in
the benchmark process, so it is compared with specserve's ``sd`` at the same gamma.

How transformers 5.x spells the options (checked against 5.23's source, and by counting
forward calls): the number of draft tokens per iteration, its schedule and the confidence
threshold are read from the *assistant's* ``generation_config``
(``AssistedCandidateGenerator.__init__`` copies ``assistant_model.generation_config``);
``num_assistant_tokens=`` / ``num_assistant_tokens_schedule=`` given to ``target.generate``
land in the target's config and are silently ignored. The assistant's defaults are 20 tokens
and ``assistant_confidence_threshold=0.4``, which stops drafting early whenever the draft's
top probability is below the threshold. So the peer sets, on the assistant's config,
``num_assistant_tokens=gamma``, ``num_assistant_tokens_schedule="constant"`` and
``assistant_confidence_threshold=0`` (off), which gives exactly gamma draft tokens per
iteration like specserve's ``sd``. Sampling is plain temperature sampling on both sides
(``top_k=0``: transformers' default top-k of 50 is off; ``top_p=1``) and EOS is ignored (the
models' ``eos_token_id`` is unset in the benchmark's copies), so every case produces exactly
``max_tokens`` tokens.

Forward calls and the time spent in them are measured with forward hooks on the two models;
the accepted length of each iteration is read from the target's KV-cache length at the start
of its next forward (transformers crops the cache to the accepted prefix after each
verification).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from benchmarks.reports.records import RunRecord
from benchmarks.served.suite import BenchCase

logger = logging.getLogger(__name__)


@dataclass
class ForwardMeter:
    """Counts the forward calls of one model, their time and the cache length before each."""

    calls: int = 0
    seconds: float = 0.0
    cache_lengths: list[int] = field(default_factory=list)
    _started: float | None = None

    def attach(self, model: torch.nn.Module) -> None:
        model.register_forward_pre_hook(self._before, with_kwargs=True)
        model.register_forward_hook(self._after, with_kwargs=True)

    def reset(self) -> None:
        self.calls, self.seconds, self._started = 0, 0.0, None
        self.cache_lengths = []

    def _before(self, module, args, kwargs) -> None:
        cache = kwargs.get("past_key_values")
        self.cache_lengths.append(int(cache.get_seq_length()) if cache is not None else 0)
        self._started = time.perf_counter()

    def _after(self, module, args, kwargs, output) -> None:
        self.seconds += time.perf_counter() - (self._started or time.perf_counter())
        self.calls += 1


def accepted_lengths_from_cache(cache_lengths: list[int], prompt_len: int, total_len: int) -> list[int]:
    """Accepted draft tokens per iteration from the target's cache length before each forward.

    Before iteration i > 0 the sequence holds ``cache_lengths[i] + 1`` tokens (the last sampled
    token is not cached yet); before iteration 0 it holds the prompt. Iteration i emits the
    difference to the next iteration's start (to ``total_len`` for the last one), of which one
    token is the correction or bonus token.
    """
    starts = [prompt_len] + [length + 1 for length in cache_lengths[1:]]
    ends = starts[1:] + [total_len]
    return [end - start - 1 for start, end in zip(starts, ends)]


class PeerRunner:
    """Runs the ``hf`` cases in this process (torch threads as set by the harness)."""

    mode = "hf"

    def __init__(self, target_path: str, draft_path: str, *, temperature: float):
        from transformers import AutoModelForCausalLM

        self.temperature = temperature
        self.target = self._load(AutoModelForCausalLM, target_path)
        self.draft = self._load(AutoModelForCausalLM, draft_path)
        self.target_meter, self.draft_meter = ForwardMeter(), ForwardMeter()
        self.target_meter.attach(self.target)
        self.draft_meter.attach(self.draft)

    @staticmethod
    def _load(auto_class, path: str) -> torch.nn.Module:
        model = auto_class.from_pretrained(path, dtype=torch.float32).eval()
        config = model.generation_config
        # EOS ignored, as in every specserve case (SamplingParams.ignore_eos=True).
        pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
        config.eos_token_id = None
        config.pad_token_id = pad if pad is not None else 0
        return model

    def _configure_assistant(self, gamma: int) -> None:
        assistant_config = self.draft.generation_config
        assistant_config.num_assistant_tokens = gamma
        assistant_config.num_assistant_tokens_schedule = "constant"
        assistant_config.assistant_confidence_threshold = 0.0

    def run(self, case: BenchCase, prompt_ids: list[int], *, seed: int, max_tokens: int,
            prompt_id: str, prompt_kind: str, repeat: int) -> RunRecord:
        input_ids = torch.tensor([prompt_ids], dtype=torch.long)  # [1, L]
        options = dict(
            do_sample=True, temperature=self.temperature, top_k=0, top_p=1.0,
            max_new_tokens=max_tokens, attention_mask=torch.ones_like(input_ids),
        )
        if case.peer_gamma is not None:
            self._configure_assistant(case.peer_gamma)
            options["assistant_model"] = self.draft
        self.target_meter.reset()
        self.draft_meter.reset()
        torch.manual_seed(seed)
        started = time.perf_counter()
        with torch.inference_mode():
            output = self.target.generate(input_ids, **options)  # [1, L + max_tokens]
        wall_s = time.perf_counter() - started
        num_tokens = int(output.shape[1]) - len(prompt_ids)
        accepted = []
        if case.peer_gamma is not None:
            accepted = accepted_lengths_from_cache(self.target_meter.cache_lengths, len(prompt_ids), int(output.shape[1]))
        return RunRecord(
            case=case.key, prompt_id=prompt_id, prompt_kind=prompt_kind, repeat=repeat, seed=seed,
            completion_tokens=num_tokens, wall_s=wall_s,
            target_calls=self.target_meter.calls,
            iterations=self.target_meter.calls,
            accepted_lengths=accepted,
            model_calls={"target": self.target_meter.calls, "draft": self.draft_meter.calls},
            time_draft_s=self.draft_meter.seconds,
            time_target_s=self.target_meter.seconds,
            time_verify_s=0.0,
            time_coordination_s=max(0.0, wall_s - self.draft_meter.seconds - self.target_meter.seconds),
            bytes_moved=0,
        )

    def close(self) -> None:
        """Nothing to release (the models live in this process)."""
