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

Checkpoints (model + optimizer + step) are written to ``models/_work/<name>/ckpt.pt`` every
``--checkpoint-every`` steps; re-running the same command continues from the last one. Batches
are drawn from a generator seeded by ``(seed, step)``, so a resumed run sees the same data as
an uninterrupted one. Finished models are exported in fp16 to ``models/embedded/<name>/``
together with the tokenizer files, so every directory loads stand-alone.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import pathlib
import sysconfig
import time
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from tqdm import tqdm

from models import EMBEDDED_ROOT

LOG = logging.getLogger("models.train")

MODELS_DIR = pathlib.Path(__file__).resolve().parent
WORK_DIR = MODELS_DIR / "_work"
CORPUS_LIST = MODELS_DIR / "corpus_files.txt"
HELDOUT_LIST = MODELS_DIR / "heldout_files.txt"
TOKENIZER_DIR = WORK_DIR / "tokenizer"
DATA_DIR = WORK_DIR / "data"

VOCAB_SIZE = 4096
EOS_TOKEN = "<|endoftext|>"
MAX_FILE_BYTES = 300_000
SEED = 1234

Split = Literal["lib", "test", "eval_lib", "eval_test", "prompts"]
SPLITS: tuple[str, ...] = ("lib", "test", "eval_lib", "eval_test", "prompts")


class ModelSpec(BaseModel):
    """Architecture and training recipe of one family member."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Directory name under models/embedded/.")
    hidden_size: int = Field(description="Residual stream width.")
    num_layers: int = Field(description="Number of decoder layers.")
    intermediate_size: int = Field(description="SwiGLU MLP width.")
    num_heads: int = Field(description="Attention heads (key/value heads are the same number).")
    train_splits: tuple[str, ...] = Field(description="Corpus splits the model trains on.")
    steps: int = Field(gt=0, description="Optimizer steps (fixed, for reproducibility).")
    batch_size: int = Field(gt=0, description="Sequences per step.")
    seq_len: int = Field(default=256, gt=0, description="Tokens per training sequence.")
    lr: float = Field(gt=0, description="Peak AdamW learning rate (cosine decay to 10%).")
    warmup_steps: int = Field(default=15, ge=0, description="Linear warm-up steps.")
    weight_decay: float = Field(default=0.1, ge=0, description="AdamW weight decay.")
    distill_from: str | None = Field(
        default=None, description="Teacher model name; when set, train by KL to its outputs."
    )
    distill_ce_weight: float = Field(
        default=0.1, ge=0, le=1, description="Weight of the next-token CE term when distilling."
    )
    seed: int = Field(default=SEED, description="Seed for initialisation and batch sampling.")
    bf16_autocast: bool = Field(
        default=True,
        description="Run forward/backward matmuls in bfloat16 (CPU autocast; fp32 master weights "
        "and AdamW state). About 2x faster per step on CPUs with AVX512-BF16.",
    )
    max_minutes: float = Field(
        gt=0,
        description="Wall-clock cap. The schedule decays by max(step, time) progress, so a run on "
        "a slow or busy machine still ends its cosine decay and stops at the cap.",
    )


# Step counts were sized from the throughput measured before training (`--stage throughput`:
# ~280 tokens/s for the 12M models, ~400 for the distilled draft, ~600 for partner2 on a
# lightly loaded 2-core CPU, fp32; bf16 autocast roughly doubles that). The machine was shared
# with other jobs (load average up to ~17 on 2 cores), so
# every member also has a wall-clock cap; whichever ends first ends the run (recorded in
# training_meta.json: `steps_completed`, `stopped_by`). On an oversubscribed machine one torch
# thread is much faster than two (a 2-thread OpenMP team stalls at every op when one of its
# threads is descheduled: 13-26 s per target step with 2 threads vs ~1.5 s with 1 at load ~14),
# hence `--threads 1` by default. The target's first 80 steps ran with 2 threads and its step
# count was raised from 400 to 800 at step ~180 while the time cap was already driving its
# schedule (so its learning rate curve did not change). The draft has one layer: a first,
# 2-layer draft (hidden 128, MLP 384) measured only ~4.1x cheaper per cached token than the
# target on this CPU, too close to the required 4x; one layer costs ~0.6 ms less.
FAMILY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="target", hidden_size=384, num_layers=6, intermediate_size=1024, num_heads=6,
            train_splits=("lib",), steps=800, batch_size=4, lr=2e-3, max_minutes=28,
        ),
        ModelSpec(
            name="draft", hidden_size=128, num_layers=1, intermediate_size=512, num_heads=4,
            train_splits=("lib",), steps=800, batch_size=4, lr=3e-3, distill_from="target",
            seed=SEED + 1, max_minutes=8,
        ),
        ModelSpec(
            name="partner", hidden_size=384, num_layers=6, intermediate_size=1024, num_heads=6,
            train_splits=("test",), steps=700, batch_size=4, lr=2e-3, seed=SEED + 2,
            max_minutes=16,
        ),
        ModelSpec(
            name="partner2", hidden_size=192, num_layers=4, intermediate_size=512, num_heads=4,
            train_splits=("lib", "test"), steps=800, batch_size=4, lr=3e-3, seed=SEED + 3,
            max_minutes=7,
        ),
    )
}
TRAIN_ORDER: tuple[str, ...] = ("target", "draft", "partner", "partner2")


# --------------------------------------------------------------------------- corpus files


def stdlib_dir() -> pathlib.Path:
    """The running interpreter's standard-library directory (the corpus root)."""
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def _is_test_file(relative: pathlib.PurePosixPath) -> bool:
    parts = relative.parts
    return (
        "test" in parts[:-1]
        or "tests" in parts[:-1]
        or relative.name.startswith("test_")
    )


def _bucket(relative: str) -> int:
    """Stable per-file bucket in [0, 100) from the path's hash (no RNG state involved)."""
    return int(hashlib.sha1(relative.encode()).hexdigest(), 16) % 100


def assign_split(relative: pathlib.PurePosixPath) -> str:
    """Library code: 94% train, 3% eval, 3% benchmark prompts; tests: 97% train, 3% eval."""
    bucket = _bucket(str(relative))
    if _is_test_file(relative):
        return "eval_test" if bucket < 3 else "test"
    if bucket < 3:
        return "eval_lib"
    if bucket < 6:
        return "prompts"
    return "lib"


def build_file_list(root: pathlib.Path) -> list[tuple[str, str]]:
    """Every UTF-8 ``.py`` file under ``root`` (no site-packages, < 300 kB), sorted, with split."""
    entries = []
    for path in sorted(root.rglob("*.py")):
        relative = pathlib.PurePosixPath(path.relative_to(root).as_posix())
        if relative.parts[0] == "site-packages" or path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        entries.append((assign_split(relative), str(relative)))
    return entries


def write_file_lists(root: pathlib.Path) -> None:
    """Write ``corpus_files.txt`` (``split<TAB>path``) and ``heldout_files.txt`` (prompt files)."""
    entries = build_file_list(root)
    header = (
        "# Corpus of the embedded model family: <split>\\t<path relative to the Python stdlib dir>\n"
        "# splits: lib (library code, train), test (test suites, train), eval_lib / eval_test\n"
        "# (held out for loss), prompts (held out for benchmark prompts; see heldout_files.txt)\n"
    )
    CORPUS_LIST.write_text(header + "".join(f"{split}\t{path}\n" for split, path in entries))
    HELDOUT_LIST.write_text(
        "# Held-out library files (never trained on) for benchmark prompts, relative to the stdlib dir\n"
        + "".join(f"{path}\n" for split, path in entries if split == "prompts")
    )
    LOG.info("wrote %d corpus files to %s", len(entries), CORPUS_LIST)


def read_file_list(split: str) -> list[pathlib.Path]:
    """Absolute paths of the committed list's files in ``split`` that exist on this machine."""
    root = stdlib_dir()
    paths, missing = [], 0
    for line in CORPUS_LIST.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        file_split, relative = line.split("\t")
        if file_split != split:
            continue
        path = root / relative
        if path.is_file():
            paths.append(path)
        else:
            missing += 1
    if missing:
        LOG.warning("%d files of split %s are missing under %s", missing, split, root)
    return paths


def read_heldout_files() -> list[pathlib.Path]:
    """Absolute paths of the benchmark-prompt files listed in ``heldout_files.txt``."""
    root = stdlib_dir()
    lines = HELDOUT_LIST.read_text().splitlines()
    return [root / line for line in lines if line and not line.startswith("#") and (root / line).is_file()]


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer() -> None:
    """Byte-level BPE (vocab 4096) on the training splits, saved in transformers format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if (TOKENIZER_DIR / "tokenizer.json").exists():
        LOG.info("tokenizer exists at %s", TOKENIZER_DIR)
        return
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    files = [str(path) for split in ("lib", "test") for path in read_file_list(split)]
    tokenizer.train(files, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        chat_template=CHAT_TEMPLATE,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
    TOKENIZER_DIR.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(TOKENIZER_DIR)
    _use_portable_tokenizer_class(TOKENIZER_DIR)
    LOG.info("tokenizer trained on %d files, vocab %d", len(files), tokenizer.get_vocab_size())


#: The family's chat template: ``"<role>: <content>\n"`` per message (``developer`` as
#: ``system``), then ``"assistant:"`` when a reply is to be generated.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- ('system' if message['role'] == 'developer' else message['role']) + ': ' + message['content'] + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'assistant:' -}}{%- endif -%}"
)


def _use_portable_tokenizer_class(directory: pathlib.Path) -> None:
    """Name the class ``PreTrainedTokenizerFast``: transformers 4.x and 5.x both load that."""
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def load_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


# --------------------------------------------------------------------------- token data


def tokenize_splits() -> None:
    """Tokenise each split to one int16-packed tensor: documents joined by ``<|endoftext|>``."""
    tokenizer = load_tokenizer()
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        out = DATA_DIR / f"{split}.pt"
        if out.exists():
            continue
        ids: list[int] = []
        files = read_file_list(split)
        for path in tqdm(files, desc=f"tokenise {split}", mininterval=5):
            ids.extend(tokenizer(path.read_text(encoding="utf-8"))["input_ids"])
            ids.append(tokenizer.eos_token_id)
        torch.save(torch.tensor(ids, dtype=torch.int16), out)  # vocab 4096 fits in int16
        LOG.info("split %s: %d files, %d tokens", split, len(files), len(ids))


def load_tokens(splits: tuple[str, ...]) -> torch.Tensor:
    """Concatenated token ids of ``splits`` as int64.  # [N]"""
    return torch.cat([torch.load(DATA_DIR / f"{split}.pt").long() for split in splits])


def sample_batch(tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int, step: int):
    """Random windows of ``seq_len + 1`` tokens, determined by ``(seed, step)`` alone."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, tokens.numel() - seq_len - 1, (batch_size,), generator=generator)
    windows = torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])  # [B, L+1]
    return windows[:, :-1], windows[:, 1:]


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
    _use_portable_tokenizer_class(out)
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
