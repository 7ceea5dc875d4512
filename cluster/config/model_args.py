"""``models``: each model of the group (path, role, dtype, context)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from cluster.config.base import Frozen

ModelRole = Literal["target", "draft", "member"]
DType = Literal["float32", "float16", "bfloat16"]
Quantization = Literal["int8", "int4", "w8a8"]


class ModelArgs(Frozen):
    """One model of the group; each runs in its own ModelWorker actor."""

    path: str = Field(..., min_length=1, description="Hub id, local checkpoint directory, or embedded:<name>.")
    role: ModelRole = Field(
        ...,
        description="target (the verifier, also ar's baseline), draft (the sd/multi_draft proposer) or member (an ensemble "
        "member, as the target can be too).",
    )
    dtype: DType | None = Field(
        None,
        description="Weights (and KV cache) dtype once loaded; unset: the checkpoint's own (config dtype / torch_dtype) on a "
        "GPU, float32 on CPU.",
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) for hub ids.")
    max_context: int | None = Field(
        None, ge=2, description="Context length override; default: the model's max_position_embeddings."
    )
    quantization: Quantization | None = Field(
        None,
        description="A draft only: int8 / int4 weights or w8a8 (int8 weights and activations, x86) linears, built at"
        " load; path: the target's own for a copy of it as proposer. CPU workers only. Unset: as loaded.",
    )

    @model_validator(mode="after")
    def _quantization_on_a_draft(self) -> ModelArgs:
        if self.quantization is not None and self.role != "draft":
            raise ValueError(f"quantization: {self.quantization!r} is for a draft model (the proposer); a {self.role!r} "
                             f"defines the output law and is served as loaded: drop quantization or set role: draft")
        return self
