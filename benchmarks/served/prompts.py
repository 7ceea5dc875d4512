"""The fixed benchmark prompt set: held-out standard-library code and English prose.

The prompts are committed in ``benchmarks/served/prompts.jsonl`` (one JSON object per line:
``id``, ``kind`` = ``code`` | ``prose``, ``source``, ``text``) so every run measures the same
text on every machine, whatever Python version is installed there. This module loads that
file and, with ``python -m benchmarks.served.prompts --build``, regenerates it deterministically:

* ``code``: for each file of ``models/heldout_files.txt`` (standard-library files the
  embedded models never saw in training, paths relative to the stdlib directory), the
  source from the first ``def`` found in the last two thirds of the file, cut at a line
  boundary once it reaches ``CODE_PROMPT_CHARS`` characters (a function header plus the
  start of its body, so the model continues real code);
* ``prose``: the opening sentences (at least ``PROSE_PROMPT_CHARS`` characters) of each
  paragraph of ``benchmarks/served/prose.txt``.

The order interleaves the two kinds so any prefix of the set (``--quick``) holds both.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import re
import sysconfig

from pydantic import BaseModel, ConfigDict, Field

logger = logging.getLogger(__name__)

BENCH_DIR = pathlib.Path(__file__).resolve().parent
PROMPTS_PATH = BENCH_DIR / "prompts.jsonl"
PROSE_PATH = BENCH_DIR / "prose.txt"
HELDOUT_LIST_PATH = BENCH_DIR.parents[1] / "models" / "heldout_files.txt"

CODE_PROMPT_CHARS = 480
PROSE_PROMPT_CHARS = 160
MAX_CODE_PROMPTS = 12
DEF_LINE = re.compile(r"^\s*(async\s+)?def\s+\w+")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


class Prompt(BaseModel):
    """One benchmark prompt."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(..., description="Stable identifier, e.g. 'code-03-json_decoder'.")
    kind: str = Field(..., pattern="^(code|prose)$", description="code | prose.")
    source: str = Field(..., description="Where the text comes from (stdlib path or prose paragraph).")
    text: str = Field(..., min_length=1, description="The prompt text given to every strategy.")


def load_prompts(path: pathlib.Path | str = PROMPTS_PATH, limit: int | None = None) -> list[Prompt]:
    """Read the committed prompt set (the first ``limit`` prompts when given)."""
    lines = pathlib.Path(path).read_text(encoding="utf-8").splitlines()
    prompts = [Prompt.model_validate_json(line) for line in lines if line.strip()]
    if not prompts:
        raise ValueError(f"prompt file {path} holds no prompts")
    return prompts if limit is None else prompts[:limit]


def code_prompt(source_text: str) -> str | None:
    """A function header plus the start of its body from the last two thirds of a file."""
    lines = source_text.splitlines(keepends=True)
    for start in range(len(lines) // 3, len(lines)):
        if not DEF_LINE.match(lines[start]):
            continue
        text = ""
        for line in lines[start:]:
            text += line
            if len(text) >= CODE_PROMPT_CHARS:
                break
        if len(text) >= CODE_PROMPT_CHARS // 2:
            return text
    return None


def prose_prompts(prose_text: str) -> list[str]:
    """The opening sentences (>= ``PROSE_PROMPT_CHARS`` characters) of each paragraph."""
    prompts = []
    for paragraph in (p.strip() for p in prose_text.split("\n\n")):
        if not paragraph:
            continue
        text = ""
        for sentence in SENTENCE_END.split(paragraph):
            text = f"{text} {sentence}".strip()
            if len(text) >= PROSE_PROMPT_CHARS:
                break
        prompts.append(text)
    return prompts


def build_prompts(
    heldout_list: pathlib.Path = HELDOUT_LIST_PATH,
    stdlib_dir: pathlib.Path | None = None,
    prose_path: pathlib.Path = PROSE_PATH,
) -> list[Prompt]:
    """Build the prompt set from the held-out stdlib files and the prose paragraphs."""
    stdlib = pathlib.Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    relative_paths = [
        line.strip() for line in heldout_list.read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    code = []
    for relative in relative_paths:
        text = code_prompt((stdlib / relative).read_text(encoding="utf-8", errors="replace"))
        if text is None:
            logger.info("no usable function in %s; skipped", relative)
            continue
        code.append((relative, text))
        if len(code) == MAX_CODE_PROMPTS:
            break
    prose = prose_prompts(prose_path.read_text(encoding="utf-8"))
    return _interleave(code, prose)


def _interleave(code: list[tuple[str, str]], prose: list[str]) -> list[Prompt]:
    """Two code prompts, then one prose prompt, repeated; leftovers at the end."""
    prompts: list[Prompt] = []
    code_iter, prose_iter = iter(enumerate(code)), iter(enumerate(prose))
    while True:
        added = 0
        for _ in range(2):
            item = next(code_iter, None)
            if item is not None:
                index, (relative, text) = item
                stem = pathlib.Path(relative).with_suffix("").as_posix().replace("/", "_")
                prompts.append(Prompt(id=f"code-{index:02d}-{stem}", kind="code", source=relative, text=text))
                added += 1
        item = next(prose_iter, None)
        if item is not None:
            index, text = item
            prompts.append(Prompt(id=f"prose-{index:02d}", kind="prose", source=f"prose.txt paragraph {index + 1}", text=text))
            added += 1
        if not added:
            return prompts


def write_prompts(prompts: list[Prompt], path: pathlib.Path = PROMPTS_PATH) -> None:
    """Write the prompt set as JSON lines."""
    path.write_text("".join(json.dumps(p.model_dump(), ensure_ascii=False) + "\n" for p in prompts), encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Show or rebuild the benchmark prompt set.")
    parser.add_argument("--build", action="store_true", help="Rebuild benchmarks/served/prompts.jsonl from the held-out files.")
    parser.add_argument("--heldout-list", type=pathlib.Path, default=HELDOUT_LIST_PATH)
    parser.add_argument("--stdlib-dir", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    if args.build:
        write_prompts(build_prompts(args.heldout_list, args.stdlib_dir))
    for prompt in load_prompts():
        logger.info("%-32s %-5s %4d chars  %s", prompt.id, prompt.kind, len(prompt.text), prompt.source)


if __name__ == "__main__":
    main()
