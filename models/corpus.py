"""The training corpus of the embedded model family: the ``.py`` files of the running
interpreter's standard library, split by a stable hash of each path (the fixed, committed lists
``models/corpus_files.txt`` and ``models/heldout_files.txt``; ``python -m models.train --stage files``
writes them)."""

from __future__ import annotations

import hashlib
import logging
import pathlib
import sysconfig
from typing import Literal

LOG = logging.getLogger("models.corpus")

MODELS_DIR = pathlib.Path(__file__).resolve().parent
WORK_DIR = MODELS_DIR / "_work"
CORPUS_LIST = MODELS_DIR / "corpus_files.txt"
HELDOUT_LIST = MODELS_DIR / "heldout_files.txt"
MAX_FILE_BYTES = 300_000

Split = Literal["lib", "test", "eval_lib", "eval_test", "prompts"]
SPLITS: tuple[str, ...] = ("lib", "test", "eval_lib", "eval_test", "prompts")


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
