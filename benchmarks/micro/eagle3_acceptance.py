"""Acceptance of the embedded target's EAGLE-3 head against its draft model (not a test).

Runs the reference speculative loop (the state machine the engine drives, :mod:`verifiers.reference`;
each model's rows from a KV cache cropped to the context's common prefix) on the committed prompt set, the same prompts and
seeds for both proposers, interleaved: the embedded draft model, and the EAGLE-3 head
(``models/embedded/eagle3``, :mod:`actors.model.eagle3`) fed the target's aux states of the
committed tokens and its own features along the chain. Prints, per proposer, the block efficiency
(tokens emitted per target call: the accepted length plus one, averaged over iterations) pooled
over the prompts (recorded), and the median over prompts. Defaults: 18 prompts x 48 tokens,
``block`` verification, gamma 4, T = 1, seed = the prompt's index.

    python -m benchmarks.micro.eagle3_acceptance
    python -m benchmarks.micro.eagle3_acceptance --prompts 18 --max-tokens 48 --gamma 4 --method block --record eagle3-acceptance
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

from actors.model.eagle3 import Eagle3Head, load_head
from models import EMBEDDED_ROOT
from verifiers.machines.speculative import SpeculativeMachine
from verifiers.randomness import TorchRandomSource, split_sources
from verifiers.reference.executor import LocalExecutor, layout_sources, run_machine


class _HeadExecutor(LocalExecutor):
    """The reference executor whose draft rows are the head's, after the draft's committed context."""

    def __init__(self, head_rows: Callable[[tuple[int, ...], tuple[int, ...]], torch.Tensor], *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.head_rows = head_rows

    def _logits(self, model: str, context: tuple[int, ...]) -> torch.Tensor:
        if model != "draft" or self.head_rows is None:
            return super()._logits(model, context)
        committed = self.contexts["draft"]
        return self.head_rows(committed, context[len(committed):])


class IncrementalModel:
    """A causal LM's rows over one growing context, its KV cache cropped to the common prefix of
    each new context (the loop asks for a context, its extensions by a chain, then a context that
    shares the accepted prefix): ``context -> [V]`` float64 logits, and the aux states of the
    tokens fed so far."""

    def __init__(self, model, aux_layers: tuple[int, ...] = ()):
        from transformers import DynamicCache

        self.model, self.aux_layers = model, aux_layers
        self.cache, self.tokens = DynamicCache(), []
        self.logits: list[torch.Tensor] = []  # [V] per position fed
        self.aux: list[torch.Tensor] = []  # [3H] per position fed

    @torch.no_grad()
    def feed(self, context: tuple[int, ...]) -> None:
        """Make the cache hold exactly ``context``."""
        keep = 0
        for a, b in zip(self.tokens, context):
            if a != b:
                break
            keep += 1
        keep = min(keep, len(context) - 1)  # at least one token is fed, for its row
        if keep < len(self.tokens):
            self.cache.crop(keep - len(self.tokens))  # a negative count: the tokens removed
        del self.tokens[keep:], self.logits[keep:], self.aux[keep:]
        new = list(context[keep:])
        out = self.model(input_ids=torch.tensor([new]), cache=self.cache, use_cache=True,
                         position_ids=torch.arange(keep, len(context))[None], output_hidden_states=bool(self.aux_layers))
        self.tokens.extend(new)
        self.logits.extend(out.logits[0].double())
        if self.aux_layers:
            self.aux.extend(torch.cat([out.hidden_states[i] for i in self.aux_layers], dim=-1)[0])

    def __call__(self, context: tuple[int, ...]) -> torch.Tensor:
        if tuple(self.tokens) != tuple(context):
            self.feed(context)
        return self.logits[-1]

    def aux_states(self, context: tuple[int, ...]) -> torch.Tensor:
        """The aux states of ``context`` ``[len, 3H]`` (fed first unless a prefix of what is held)."""
        if tuple(self.tokens[: len(context)]) != tuple(context):
            self.feed(context)
        return torch.stack(self.aux[: len(context)])


class HeadRows:
    """The head's rows with its chain state cached: ``(committed, chain) -> [V]`` logits."""

    def __init__(self, target: IncrementalModel, head: Eagle3Head):
        self.target, self.head = target, head
        self.states: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple] = {}

    @torch.no_grad()
    def __call__(self, committed: tuple[int, ...], chain: tuple[int, ...]) -> torch.Tensor:
        key = (committed, chain)
        if key not in self.states:
            if not chain:
                self.states.clear()  # a new block: earlier chains are done
                aux = self.target.aux_states(committed[:-1])  # [n-1, 3H]
                self.states[key] = self.head.prefill(torch.tensor(committed), aux)
            else:
                parent = (committed, chain[:-1])
                if parent not in self.states:
                    self(*parent)
                prenorm, cache = self.states[parent]
                token = torch.tensor([chain[-1]])
                out, cache = self.head.extend(token, prenorm[None], len(committed) + len(chain) - 1, cache)
                self.states[key] = (out[0], cache)
        return self.head.target_logits(self.states[key][0]).double()


def block_lengths(prompt: list[int], seed: int, target_fn, draft_fn, head_rows, args) -> list[int]:
    """Tokens emitted per iteration of one request (accepted + 1), the last block cut at max tokens."""
    draft_source, verify_source = split_sources(TorchRandomSource(torch.Generator().manual_seed(seed)), 2)
    machine = SpeculativeMachine("draft", "target", method=args.method, gamma=args.gamma, num_drafts=1,
                                 max_new_tokens=args.max_tokens)
    executor = _HeadExecutor(head_rows, {"draft": draft_fn, "target": target_fn}, prompt,
                             layout_sources(machine.streams(), [draft_source, verify_source]),
                             temperature=args.temperature, top_k=0, top_p=1.0)
    run_machine(machine, executor)
    return [a + 1 for a in machine.accepted_lengths]


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.served.prompts import load_prompts

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=18, help="Prompts of the committed set (default 18).")
    parser.add_argument("--max-tokens", type=int, default=48, help="Tokens a request (default 48).")
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--method", default="block", help="Verification rule (default block).")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--record", default=None, metavar="CASE", help="Write the figures into the results store.")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = AutoModelForCausalLM.from_pretrained(EMBEDDED_ROOT / "target", dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(EMBEDDED_ROOT / "draft", dtype=torch.float32).eval()
    head = load_head(EMBEDDED_ROOT / "eagle3", target, head_name="embedded:eagle3")
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_ROOT / "target")
    prompts = [tokenizer(p.text)["input_ids"] for p in load_prompts(limit=args.prompts)]
    target_fn, draft_fn = IncrementalModel(target, head.config.aux_layers), IncrementalModel(draft)
    lengths: dict[str, list[list[int]]] = {"draft model": [], "eagle3 head": []}
    for i, prompt in enumerate(prompts):  # interleaved: both proposers on prompt i, seed i
        lengths["draft model"].append(block_lengths(prompt, i, target_fn, draft_fn, None, args))
        lengths["eagle3 head"].append(block_lengths(prompt, i, target_fn, None, HeadRows(target_fn, head), args))
        print(f"prompt {i}: " + ", ".join(f"{name} {statistics.mean(v[-1]):.2f}" for name, v in lengths.items()), flush=True)
    rows = []
    for name, per_prompt in lengths.items():
        pooled = statistics.mean(length for request in per_prompt for length in request)
        median = statistics.median(statistics.mean(request) for request in per_prompt)
        rows.append({"proposer": name, "block efficiency": round(pooled, 3)})
        print(f"{name}: block efficiency {pooled:.3f} (median over prompts {median:.3f})")
    if args.record:
        _record(args, rows, argv)


def _record(args: argparse.Namespace, rows: list[dict], argv: list[str] | None) -> None:
    import sys

    from benchmarks.reports.store import make_record
    from benchmarks.reports.tables import update

    command = "python -m benchmarks.micro.eagle3_acceptance " + " ".join(argv if argv is not None else sys.argv[1:])
    title = "EAGLE-3 head against the draft model (reference loop)"
    if (args.prompts, args.max_tokens, args.gamma, args.method, args.temperature) != (18, 48, 4, "block", 1.0):
        title = title[:-1] + f", {args.method} gamma {args.gamma}, T = {args.temperature:g})"
    print(f"recorded {update(make_record(args.record, title, command, rows, section='Engine'))}")


if __name__ == "__main__":
    main()
