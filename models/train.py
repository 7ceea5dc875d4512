"""Train the embedded default model family on the Python standard library's own source.

Everything here runs offline on a CPU: the corpus is the ``.py`` files of the running
interpreter's standard library (the fixed, committed list in ``models/corpus_files.txt``), the
tokenizer is a byte-level BPE trained with the ``tokenizers`` library, and the models are
``LlamaForCausalLM`` checkpoints saved with ``save_pretrained``.

Stages (run one after another by ``--stage all``; each is resumable):

1. ``tokenizer`` -- byte-level BPE, vocab 4096, ``<|endoftext|>`` as BOS/EOS/pad.
2. ``data``      -- tokenise every split once into ``models/_work/data/<split>.pt``.
3. ``target``    -- the verifier, trained on library code (no tests).
4. ``draft``     -- a ~1M-parameter model distilled from ``target`` (forward KL to the target's
   T = 1 distribution plus a small next-token cross-entropy term; Hinton et al. 2015).
5. ``partner``   -- target-sized, trained on the test-suite slice (``test_*.py`` etc.).
6. ``partner2``  -- a small model trained on library code and tests together.

Usage (meant to run in the background)::

    nohup .venv/bin/python -m models.train --stage all > models/_work/train.log 2>&1 &

The corpus is :mod:`models.corpus`, the tokenizer and token data :mod:`models.tokens`, the
members' recipes :mod:`models.family`; this module trains and exports them.

Checkpoints (model + optimizer + step) are written to ``models/_work/<name>/ckpt.pt`` every
``--checkpoint-every`` steps; re-running the same command continues from the last one. Batches
are drawn from a generator seeded by ``(seed, step)``, so a resumed run sees the same data as
an uninterrupted one. Finished models are exported in fp16 to ``models/embedded/<name>/``
together with the tokenizer files, so every directory loads stand-alone.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import pathlib
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from models import EMBEDDED_ROOT
from models.corpus import WORK_DIR, stdlib_dir, write_file_lists
from models.family import FAMILY, TRAIN_ORDER, ModelSpec
from models.tokens import (
    VOCAB_SIZE,
    load_tokenizer,
    load_tokens,
    sample_batch,
    tokenize_splits,
    train_tokenizer,
    use_portable_tokenizer_class,
)

LOG = logging.getLogger("models.train")


# --------------------------------------------------------------------------- models


def build_model(spec: ModelSpec):
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = load_tokenizer()
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(spec.seed)
    return LlamaForCausalLM(config)


def count_parameters(model) -> int:
    """Unique parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


def training_progress(spec: ModelSpec, step: int, elapsed_seconds: float) -> float:
    """Fraction of the run done: the larger of step progress and wall-clock progress."""
    return max(step / spec.steps, elapsed_seconds / (60.0 * spec.max_minutes))


def learning_rate(spec: ModelSpec, step: int, progress: float) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine decay from ``lr`` to ``0.1 * lr``.

    The decay follows ``progress`` (see :func:`training_progress`), measured from the end of
    warm-up, so it completes at ``spec.steps`` or at the wall-clock cap, whichever is first.
    """
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    warmup_fraction = spec.warmup_steps / spec.steps
    decay = (progress - warmup_fraction) / max(1e-9, 1.0 - warmup_fraction)
    decay = min(1.0, max(0.0, decay))
    return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * decay)))


def make_optimizer(model, spec: ModelSpec) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": spec.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=spec.lr, betas=(0.9, 0.95))


def load_teacher(name: str):
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(EMBEDDED_ROOT / name, dtype=torch.float32)
    return teacher.eval().requires_grad_(False)


def distillation_loss(student_logits, teacher_logits, targets, ce_weight: float) -> torch.Tensor:
    """Forward KL(teacher || student) at T = 1 plus ``ce_weight`` x next-token cross-entropy.

    Forward KL at the sampling temperature pushes the draft's distribution towards the
    target's, which is what speculative-decoding acceptance sum_v min(p_target, p_draft)
    rewards.
    """
    vocab = student_logits.shape[-1]
    student_logp = F.log_softmax(student_logits.float(), dim=-1).view(-1, vocab)  # [B*L, V]
    teacher_logp = F.log_softmax(teacher_logits.float(), dim=-1).view(-1, vocab)  # [B*L, V]
    kl = F.kl_div(student_logp, teacher_logp, log_target=True, reduction="batchmean")
    ce = F.nll_loss(student_logp, targets.reshape(-1))
    return (1 - ce_weight) * kl + ce_weight * ce


def training_loss(model, teacher, inputs, targets, spec: ModelSpec) -> torch.Tensor:
    """Next-token CE, or the distillation loss when ``teacher`` is given (fp32 reductions)."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=spec.bf16_autocast):
        logits = model(inputs).logits  # [B, L, V]
        if teacher is not None:
            with torch.no_grad():
                teacher_logits = teacher(inputs).logits  # [B, L, V]
    logits = logits.float()
    if teacher is not None:
        return distillation_loss(logits, teacher_logits.float(), targets, spec.distill_ce_weight)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def evaluate_loss(model, tokens: torch.Tensor, seq_len: int = 256, max_windows: int = 64) -> float:
    """Mean next-token cross-entropy (nats) over non-overlapping windows of ``tokens``."""
    model.eval()
    num_windows = min(max_windows, (tokens.numel() - 1) // seq_len)
    stride = (tokens.numel() - 1) // num_windows
    losses = []
    for index in range(num_windows):
        start = index * stride
        window = tokens[start : start + seq_len + 1].unsqueeze(0)  # [1, L+1]
        logits = model(window[:, :-1]).logits  # [1, L, V]
        losses.append(F.cross_entropy(logits[0].float(), window[0, 1:]).item())
    model.train()
    return sum(losses) / len(losses)


def export_model(model, name: str, meta: dict) -> pathlib.Path:
    """Save fp16 weights + tokenizer to ``models/embedded/<name>/``; config says float32.

    The config's ``dtype`` is float32 so ``from_pretrained`` upcasts the fp16 weights on load
    (CPU inference in float32) without the caller passing a dtype.
    """
    from transformers import GenerationConfig

    out = EMBEDDED_ROOT / name
    out.mkdir(parents=True, exist_ok=True)
    half = type(model)(model.config)
    half.load_state_dict(model.state_dict())
    half = half.to(torch.float16)
    half.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.pad_token_id,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=128,
    )
    half.save_pretrained(out, safe_serialization=True)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["dtype"] = "float32"  # save_pretrained records the fp16 storage dtype; load as fp32
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    load_tokenizer().save_pretrained(out)
    use_portable_tokenizer_class(out)
    (out / "training_meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    LOG.info("exported %s to %s", name, out)
    return out


def train_model(spec: ModelSpec, checkpoint_every: int) -> None:
    """Train (or resume) one family member, then export it."""
    done_marker = WORK_DIR / spec.name / "DONE"
    if done_marker.exists():
        LOG.info("%s already trained", spec.name)
        return
    torch.manual_seed(spec.seed)
    model = build_model(spec)
    optimizer = make_optimizer(model, spec)
    tokens = load_tokens(spec.train_splits)
    teacher = load_teacher(spec.distill_from) if spec.distill_from else None
    ckpt_path = WORK_DIR / spec.name / "ckpt.pt"
    ckpt_path.parent.mkdir(parents=True, exist_ok=True)
    start_step, elapsed_before = 0, 0.0
    if ckpt_path.exists():
        state = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_step, elapsed_before = state["step"], state["elapsed"]
        LOG.info("%s: resumed at step %d", spec.name, start_step)
    LOG.info(
        "%s: %d parameters, %d training tokens available, %d steps x %d x %d",
        spec.name, count_parameters(model), tokens.numel(), spec.steps, spec.batch_size, spec.seq_len,
    )
    model.train()
    started = time.perf_counter()
    progress_bar = tqdm(range(start_step, spec.steps), desc=spec.name, initial=start_step,
                        total=spec.steps, mininterval=30)
    steps_completed, stopped_by, loss = start_step, "steps", None
    for step in progress_bar:
        elapsed = elapsed_before + time.perf_counter() - started
        progress = training_progress(spec, step, elapsed)
        if progress >= 1.0:
            stopped_by = "time"
            break
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(spec, step, progress)
        inputs, targets = sample_batch(tokens, spec.batch_size, spec.seq_len, spec.seed, step)
        loss = training_loss(model, teacher, inputs, targets, spec)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        steps_completed = step + 1
        progress_bar.set_postfix(loss=f"{loss.item():.3f}")
        if (step + 1) % checkpoint_every == 0 or step + 1 == spec.steps:
            elapsed = elapsed_before + time.perf_counter() - started
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "step": step + 1, "elapsed": elapsed}, ckpt_path)
            LOG.info("%s step %d/%d loss %.4f (%.0f s)", spec.name, step + 1, spec.steps, loss.item(), elapsed)
    progress_bar.close()
    elapsed = elapsed_before + time.perf_counter() - started
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "step": steps_completed, "elapsed": elapsed}, ckpt_path)
    eval_loss = evaluate_loss(model, load_tokens(("eval_lib",)), spec.seq_len, max_windows=16)
    LOG.info("%s done: %d steps (%s), %.0f s, eval_lib loss %.4f",
             spec.name, steps_completed, stopped_by, elapsed, eval_loss)
    meta = {
        "name": spec.name,
        "spec": spec.model_dump(),
        "parameters": count_parameters(model),
        "steps_completed": steps_completed,
        "stopped_by": stopped_by,
        "training_tokens": steps_completed * spec.batch_size * spec.seq_len,
        "training_seconds": round(elapsed, 1),
        "torch_threads": torch.get_num_threads(),
        "last_train_loss": round(loss.item(), 4) if loss is not None else None,
        "eval_lib_loss_16_windows": round(eval_loss, 4),
    }
    export_model(model, spec.name, meta)
    done_marker.write_text("done\n")


# --------------------------------------------------------------------------- CLI


def measure_throughput(spec: ModelSpec, steps: int = 5) -> float:
    """Training tokens per second for ``spec`` (timing only; nothing is saved)."""
    model = build_model(spec)
    optimizer = make_optimizer(model, spec)
    tokens = torch.randint(0, VOCAB_SIZE, (100_000,))
    teacher = build_model(FAMILY[spec.distill_from]).eval() if spec.distill_from else None
    times = []
    for step in range(steps + 1):
        started = time.perf_counter()
        inputs, targets = sample_batch(tokens, spec.batch_size, spec.seq_len, spec.seed, step)
        loss = training_loss(model, teacher, inputs, targets, spec)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step:
            times.append(time.perf_counter() - started)
    per_step = sorted(times)[len(times) // 2]
    return spec.batch_size * spec.seq_len / per_step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", default="all",
                        choices=["all", "files", "tokenizer", "data", "throughput", *TRAIN_ORDER])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--checkpoint-every", type=int, default=20)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(args.threads)
    if args.stage == "files":
        write_file_lists(stdlib_dir())
        return
    if args.stage == "throughput":
        for name in TRAIN_ORDER:
            LOG.info("%s: %.0f training tokens/s", name, measure_throughput(FAMILY[name]))
        return
    if args.stage in ("all", "tokenizer"):
        train_tokenizer()
    if args.stage in ("all", "data"):
        tokenize_splits()
    names = TRAIN_ORDER if args.stage == "all" else [args.stage] if args.stage in FAMILY else []
    for name in names:
        train_model(FAMILY[name], args.checkpoint_every)


if __name__ == "__main__":
    main()
