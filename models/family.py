"""The members of the embedded model family: architecture and training recipe of each
(:class:`ModelSpec`), and the order they are trained in."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

SEED = 1234


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
