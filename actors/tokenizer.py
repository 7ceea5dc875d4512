"""The model group's tokenizer, loaded once per process.

The coordinator (prompts, output text, stop strings) and the ingress (chat templates, echoed
token-id prompts, token texts of log-probabilities) both need the group's tokenizer; where they
share a process (local runs, benchmarks, tests) they share one instance.
"""

from __future__ import annotations

import functools
from typing import Any


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str) -> Any:
    """``AutoTokenizer.from_pretrained(path)``, once per path in this process (local
    directories never touch the hub)."""
    import os

    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=os.path.isdir(path))


__all__ = ["load_tokenizer"]
