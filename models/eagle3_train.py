"""Train the embedded target's EAGLE-3 head (``models/embedded/eagle3``) on the family's corpus.

The head (:mod:`actors.model.eagle3`) reads the embedded target's layer inputs
:data:`AUX_LAYERS` and shares its input embeddings (not shipped). It is trained on the library
split (:mod:`models.corpus`, tokenized with the target's own tokenizer) by distillation from the
target at T = 1, with EAGLE-3's training-time test: ``STEPS`` unrolled steps where step ``s`` at
position ``j`` reads its own step ``s - 1`` feature of position ``j - 1`` and attends to step 0's
keys up to ``j - s`` and to each later step's key on its diagonal -- exactly the attention of a
chain of ``s`` drafted tokens after a committed prefix ending at ``j - s``
(:func:`unroll_mask`). Each step's loss is the forward KL from the target's next-token law
restricted to the draft vocabulary (the :data:`DRAFT_VOCAB` most frequent tokens of the split),
weighted ``0.8 ** s``.

Usage (CPU, one thread, minutes)::

    python -m models.eagle3_train --minutes 25
    python -m models.eagle3_train --resume --minutes 5 --lr 5e-4
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time

import torch
import torch.nn.functional as F

from actors.model.eagle3 import Eagle3Config, Eagle3Head, save_head
from models import EMBEDDED_ROOT
from models.corpus import WORK_DIR, read_file_list
from models.tokens import sample_batch

LOG = logging.getLogger("models.eagle3_train")

#: The target layers whose inputs the head reads (low, mid, high of the 6-layer target).
AUX_LAYERS = (1, 3, 5)
#: The draft vocabulary: the most frequent tokens of the library split.
DRAFT_VOCAB = 2048
#: Training-time test: unrolled steps per position, and the weight of step s's loss.
STEPS, STEP_DECAY = 3, 0.8
SEED, BATCH, SEQ_LEN, LR, WARMUP = 4242, 4, 256, 2e-3, 20
TOKENS_FILE = WORK_DIR / "data" / "lib_target_tokenizer.pt"


def library_tokens() -> torch.Tensor:
    """The library split tokenized with the embedded target's tokenizer ``[N]`` (cached)."""
    if TOKENS_FILE.exists():
        return torch.load(TOKENS_FILE).long()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_ROOT / "target")
    ids: list[int] = []
    for path in read_file_list("lib"):
        ids.extend(tokenizer(path.read_text(encoding="utf-8"))["input_ids"])
        ids.append(tokenizer.eos_token_id)
    TOKENS_FILE.parent.mkdir(parents=True, exist_ok=True)
    torch.save(torch.tensor(ids, dtype=torch.int16), TOKENS_FILE)
    return torch.tensor(ids, dtype=torch.long)


def draft_vocabulary(tokens: torch.Tensor, vocab: int, size: int) -> torch.Tensor:
    """The ``size`` most frequent token ids of ``tokens``, ascending ``[size]``."""
    counts = torch.bincount(tokens, minlength=vocab)  # [V]
    return counts.topk(size).indices.sort().values


def build_head(target, draft_ids: torch.Tensor) -> Eagle3Head:
    """A fresh head for ``target``: its lm_head starts from the target's rows of the draft
    vocabulary, its final norm from the target's; ``d2t`` / ``t2d`` map the draft ids."""
    c = target.config
    config = Eagle3Config(
        hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads, head_dim=c.hidden_size // c.num_attention_heads, rms_norm_eps=c.rms_norm_eps,
        rope_theta=float((getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10000.0)), vocab_size=c.vocab_size,
        draft_vocab_size=int(draft_ids.numel()), target_hidden_size=c.hidden_size, aux_layers=AUX_LAYERS,
        max_position_embeddings=c.max_position_embeddings,
    )
    torch.manual_seed(SEED)
    head = Eagle3Head(config, target.get_input_embeddings())
    with torch.no_grad():
        for name, parameter in head.named_parameters():
            if parameter.dim() == 2 and not name.startswith("embed_tokens"):
                torch.nn.init.normal_(parameter, 0.0, 0.02)
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[draft_ids])
        head.norm.weight.copy_(target.model.norm.weight)
        head.d2t.copy_(draft_ids - torch.arange(draft_ids.numel()))
        head.t2d.zero_()
        head.t2d[draft_ids] = True
    head.embed_tokens.requires_grad_(False)
    return head


def unroll_mask(length: int, step: int) -> torch.Tensor:
    """Attention of unrolled step ``step`` over the keys of steps ``0 .. step`` (each ``length``
    positions, in that order) -> bool ``[1, 1, length, (step + 1) * length]``. Query ``q`` sees
    step 0's keys ``<= q - step`` and step ``t``'s key ``q - step + t``; a query with no committed
    prefix (``q < step``) sees only its own key (its loss is masked)."""
    q = torch.arange(length)[:, None]  # [L, 1]
    k = torch.arange(length)[None, :]  # [1, L]
    blocks = [k <= q - step] + [k == q - step + t for t in range(1, step + 1)]
    mask = torch.cat(blocks, dim=1)  # [L, (s+1) L]
    if step:
        mask[:step] = False
        mask[torch.arange(step), step * length + torch.arange(step)] = True
    return mask[None, None]


def unrolled_loss(head: Eagle3Head, tokens: torch.Tensor, aux: torch.Tensor, target_logp: torch.Tensor) -> tuple:
    """Training-time test over windows: ``tokens [B, L]``, ``aux [B, L, 3H]``, the target's
    next-token log-probabilities over the draft vocabulary ``target_logp [B, L, Vd]`` (renormalized)
    -> (weighted loss, per-step top-1 agreement)."""
    batch, length = tokens.shape
    n = length - 1  # head positions 1 .. L-1
    positions = torch.arange(1, length)[None].expand(batch, n)  # [B, n]
    inputs = tokens[:, 1:]  # [B, n]: x_j
    features = head.fc(aux[:, :-1])  # [B, n, H]: fc(a_{j-1})
    cache, total, agreement = None, 0.0, []
    weights = [STEP_DECAY ** s for s in range(STEPS)]
    for s in range(STEPS):
        prenorm, cache = head.layer(inputs, features, positions, cache, unroll_mask(n, s))  # [B, n, H]
        logp = F.log_softmax(head.draft_logits(prenorm).float(), dim=-1)  # [B, n, Vd]
        goal = target_logp[:, 1:]  # [B, n, Vd]: the law of x_{j+1}
        valid = torch.arange(n) >= s  # [n]
        kl = (goal.exp() * (goal - logp)).sum(-1)[:, valid]  # [B, n - s]
        total = total + weights[s] * kl.mean()
        agreement.append(float((logp.argmax(-1) == goal.argmax(-1))[:, valid].float().mean()))
        # Next step: position j reads this step's feature of position j - 1.
        features = torch.cat((prenorm[:, :1], prenorm[:, :-1]), dim=1)
    return total / sum(weights), agreement


def resumed_head(target) -> tuple[Eagle3Head, dict]:
    """The exported head, trainable again, and its training record."""
    from actors.model.eagle3 import load_head

    head = load_head(EMBEDDED_ROOT / "eagle3", target).train()
    for name, parameter in head.named_parameters():
        parameter.requires_grad_(not name.startswith("embed_tokens"))
    return head, json.loads((EMBEDDED_ROOT / "eagle3" / "training_meta.json").read_text())


def train(minutes: float, max_steps: int, threads: int, *, resume: bool = False, lr: float = LR) -> dict:
    """Train for ``minutes`` (or ``max_steps``) and export to ``models/embedded/eagle3``; ``resume``:
    continue the exported head (a new schedule from ``lr``; the record sums both runs)."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    target = AutoModelForCausalLM.from_pretrained(EMBEDDED_ROOT / "target", dtype=torch.float32).eval()
    target.requires_grad_(False)
    tokens = library_tokens()
    earlier: dict = {}
    if resume:
        head, earlier = resumed_head(target)
        draft_ids = torch.arange(head.config.draft_vocab_size) + head.d2t  # [Vd]
    else:
        draft_ids = draft_vocabulary(tokens, target.config.vocab_size, DRAFT_VOCAB)
        head = build_head(target, draft_ids)
    parameters = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    started, step, history = time.monotonic(), 0, []
    while step < max_steps:
        elapsed = time.monotonic() - started
        progress = max(step / max_steps, elapsed / (60 * minutes))
        if progress >= 1:
            break
        rate = lr * min(1.0, (step + 1) / WARMUP) * 0.5 * (1 + math.cos(math.pi * progress))
        for group in optimizer.param_groups:
            group["lr"] = rate
        inputs, _ = sample_batch(tokens, BATCH, SEQ_LEN, SEED, earlier.get("steps_completed", 0) + step)  # [B, L]
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            out = target(inputs, output_hidden_states=True)
            aux = torch.cat([out.hidden_states[i] for i in AUX_LAYERS], dim=-1).float()  # [B, L, 3H]
            logits = out.logits.float()  # [B, L, V]
        target_logp = F.log_softmax(logits[..., draft_ids], dim=-1)  # [B, L, Vd]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, agreement = unrolled_loss(head, inputs, aux, target_logp)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        step += 1
        if step % 20 == 0:
            LOG.info("step %d  %.0fs  lr %.2e  loss %.4f  top-1 agreement %s", step, elapsed, rate, float(loss),
                     [round(a, 3) for a in agreement])
            history.append({"step": step, "loss": round(float(loss), 4), "agreement": [round(a, 3) for a in agreement]})
    out = save_head(head, EMBEDDED_ROOT / "eagle3")
    seconds = round(time.monotonic() - started)
    runs = earlier.get("runs", []) + [{"steps": step, "seconds": seconds, "lr": lr}]
    meta = {"name": "eagle3", "target": "target", "steps_completed": sum(r["steps"] for r in runs),
            "training_seconds": sum(r["seconds"] for r in runs), "runs": runs,
            "aux_layers": list(AUX_LAYERS), "draft_vocab_size": DRAFT_VOCAB, "unrolled_steps": STEPS, "batch_size": BATCH,
            "seq_len": SEQ_LEN, "seed": SEED, "torch_threads": threads, "last": history[-1] if history else None,
            "parameters_shipped": sum(p.numel() for n, p in head.named_parameters() if not n.startswith("embed_tokens"))}
    (out / "training_meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    LOG.info("exported the head to %s: %s", out, meta)
    return meta


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=25.0, help="Wall-clock cap of the training (default 25).")
    parser.add_argument("--steps", type=int, default=100_000, help="Step cap (default: the time cap ends it).")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1).")
    parser.add_argument("--lr", type=float, default=LR, help=f"Peak learning rate (default {LR}).")
    parser.add_argument("--resume", action="store_true", help="Continue the exported head (a new schedule).")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    train(args.minutes, args.steps, args.threads, resume=args.resume, lr=args.lr)


if __name__ == "__main__":
    main()
