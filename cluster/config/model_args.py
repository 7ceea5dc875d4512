"""``models``: each model of the group (path, role, dtype, context)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from cluster.config.base import Frozen

ModelRole = Literal["target", "draft", "member"]
DType = Literal["float32", "float16", "bfloat16"]


class ModelArgs(Frozen):
    """One model of the group; each runs in its own ModelWorker actor."""

    path: str = Field(..., min_length=1, description="Hub id, local checkpoint directory, or embedded:<name>.")
    role: ModelRole = Field(
        ...,
        description="target (the verifier, also the ar baseline), draft (the sd/multi_draft proposer) "
        "or member (an ensemble member; the target can be an ensemble member too).",
    )
    dtype: DType | None = Field(
        None,
        description="Weights (and KV cache) dtype once loaded; unset: the checkpoint's own (config dtype / "
        "torch_dtype, e.g. bfloat16) on a GPU, float32 on CPU.",
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) for hub ids.")
    max_context: int | None = Field(
        None, ge=2, description="Context length override; default: the model's max_position_embeddings."
    )
