"""Cheaper pickling of the tensors that cross between actors.

Every Ray call between the coordinator and the model workers pickles its arguments and returns.
torch pickles a tensor through its storage (a few hundred microseconds of Python per tensor);
Ray pickles a numpy array as an out-of-band buffer (protocol 5), far cheaper. Measured here, an
actor-to-actor call returning one draft payload (tokens ``[1, 4]`` and logits ``[1, 4, 4096]``,
float32): 1.5-1.7 ms round trip as torch tensors, 1.1 ms with this module (the same call returning
bare numpy arrays: 0.9 ms). ``python -m benchmarks.served.ray_overhead`` measures the hops.

:func:`pickle_through_wire` registers a dataclass with a reducer (``copyreg``, which Ray's
pickler honours) that hands its CPU tensors to the pickler as numpy arrays and turns them back
into tensors when unpickled (copied where the buffer is read-only, as Ray's zero-copy buffers
are). Values are unchanged: same dtype, shape and numbers. Tensors numpy cannot hold (bfloat16,
a device other than the CPU, with autograd) keep torch's own pickling. The payload types are
registered where the messages between actors are declared (:mod:`actors.messages`), so the
math that defines them (:mod:`verifiers.machines`) knows nothing of pickling.
"""

from __future__ import annotations

import copyreg
import dataclasses
from typing import Any

import numpy as np
import torch

#: dtypes numpy holds exactly (torch.bfloat16 is not one of them).
_NUMPY_DTYPES = frozenset({
    torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool,
})


class _WireArray:
    """A tensor in transit as a numpy array (marks it, so arrays that were arrays stay arrays)."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray):
        self.array = array

    def __reduce__(self):
        return _tensor_from_wire, (self.array,)


def _tensor_from_wire(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(array if array.flags.writeable else array.copy())


def to_wire(value: Any) -> Any:
    """``value`` as it should be pickled: a CPU tensor numpy can hold becomes a numpy array that
    unpickles back into an equal tensor; anything else is returned unchanged."""
    if (isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.dtype in _NUMPY_DTYPES
            and not value.requires_grad and type(value) is torch.Tensor):
        return _WireArray(value.numpy())
    return value


def _rebuild(cls: type, values: tuple[Any, ...]) -> Any:
    return cls(*values)


def _reduce_fields(value: Any) -> tuple[Any, ...]:
    """A field whose metadata says it does not travel (``{"travels": False}``) arrives as None."""
    return _rebuild, (type(value), tuple(to_wire(getattr(value, f.name)) if f.metadata.get("travels", True) else None
                                         for f in dataclasses.fields(value)))


def pickle_through_wire(*classes: type) -> None:
    """Pickle instances of these dataclasses (all fields ``init`` fields, which may hold
    tensors) field by field through :func:`to_wire` (None for a field that does not travel). Registered per exact class, as ``copyreg``
    registrations are."""
    for cls in classes:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls.__name__} is not a dataclass")
        copyreg.pickle(cls, _reduce_fields)
