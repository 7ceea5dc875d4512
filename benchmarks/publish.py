"""Put a benchmark run into the docs: ``python -m benchmarks.publish bench-out/full``.

Copies the run's plots to ``docs/img/`` (prefixed ``bench_``) and replaces the part of
``docs/benchmarks.md`` between ``<!-- results:start -->`` and ``<!-- results:end -->`` with the
run's ``results.md`` (headings moved one level down, plot links pointing at ``img/``). The
hand-written text around the markers (method, analysis) stays as it is.
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import re
import shutil

from benchmarks.report import PLOT_FILES

logger = logging.getLogger(__name__)

DOCS_DIR = pathlib.Path(__file__).resolve().parent.parent / "docs"
START, END = "<!-- results:start -->", "<!-- results:end -->"
IMAGE_PREFIX = "bench_"


def results_section(results_markdown: str) -> str:
    """``results.md`` as a section of the docs page: headings one level down, plots under img/."""
    text = re.sub(r"^(#+) ", lambda m: "#" + m.group(1) + " ", results_markdown, flags=re.MULTILINE)
    for name in PLOT_FILES:
        text = re.sub(rf"\]\((?:[^)]*/)?{re.escape(name)}\)", f"](img/{IMAGE_PREFIX}{name})", text)
    return text.strip() + "\n"


def publish(run_dir: pathlib.Path, doc: pathlib.Path = DOCS_DIR / "benchmarks.md") -> None:
    """Copy the plots and splice ``results.md`` into ``doc`` between the markers."""
    page = doc.read_text(encoding="utf-8")
    if START not in page or END not in page:
        raise ValueError(f"{doc} has no {START} ... {END} markers")
    section = results_section((run_dir / "results.md").read_text(encoding="utf-8"))
    head, rest = page.split(START, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{START}\n{section}{END}{tail}", encoding="utf-8")
    image_dir = doc.parent / "img"
    image_dir.mkdir(exist_ok=True)
    for name in PLOT_FILES:
        source = run_dir / name
        if source.exists():
            shutil.copyfile(source, image_dir / f"{IMAGE_PREFIX}{name}")
    logger.info("published %s into %s", run_dir, doc)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Splice a benchmark run into docs/benchmarks.md.")
    parser.add_argument("run_dir", type=pathlib.Path, help="The --out directory of a specserve bench run.")
    parser.add_argument("--doc", type=pathlib.Path, default=DOCS_DIR / "benchmarks.md")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    publish(args.run_dir, args.doc)


if __name__ == "__main__":
    main()
