"""Put a benchmark run into the docs: ``python -m benchmarks.reports.publish bench-out/full``.

Copies the run's plots to ``docs/img/`` (prefixed ``bench_``) and replaces the part of
``docs/benchmarks.md`` between ``<!-- results:start -->`` and ``<!-- results:end -->`` with the
run's ``results.md`` (headings moved one level down, plot links pointing at ``img/``). The
hand-written text around the markers (method, analysis) stays as it is.

A serve-load run (``specserve bench --mode serve-load``) goes between
``<!-- serve-load:start -->`` and ``<!-- serve-load:end -->`` instead: its "Serving under load"
section, with the command and the commit it ran at. When the page has no markers of the run's kind
yet, the section is appended at the end of the page between new markers.
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import re
import shutil

from benchmarks.served import serve_load_records, serve_load_report
from benchmarks.reports.report import PLOT_FILES

logger = logging.getLogger(__name__)

DOCS_DIR = pathlib.Path(__file__).resolve().parents[2] / "docs"
START, END = "<!-- results:start -->", "<!-- results:end -->"
SERVE_LOAD_START, SERVE_LOAD_END = "<!-- serve-load:start -->", "<!-- serve-load:end -->"
IMAGE_PREFIX = "bench_"


def results_section(results_markdown: str, plot_files: tuple[str, ...] = PLOT_FILES) -> str:
    """``results.md`` as a section of the docs page: headings one level down, plots under img/."""
    text = re.sub(r"^(#+) ", lambda m: "#" + m.group(1) + " ", results_markdown, flags=re.MULTILINE)
    for name in plot_files:
        text = re.sub(rf"\]\((?:[^)]*/)?{re.escape(name)}\)", f"](img/{IMAGE_PREFIX}{name})", text)
    return text.strip() + "\n"


def splice(page: str, section: str, start: str, end: str, *, append: bool = False) -> str:
    """``page`` with the text between ``start`` and ``end`` replaced by ``section`` (appended at
    the end between new markers when ``append`` and the page has none)."""
    if start not in page or end not in page:
        if not append:
            raise ValueError(f"no {start} ... {end} markers")
        return f"{page.rstrip()}\n\n{start}\n{section}{end}\n"
    head, rest = page.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{section}{end}{tail}"


def publish(run_dir: pathlib.Path, doc: pathlib.Path = DOCS_DIR / "benchmarks.md") -> None:
    """Copy the plots and splice ``results.md`` into ``doc`` between the markers of its kind of run."""
    page = doc.read_text(encoding="utf-8")
    serve_load = serve_load_records.is_serve_load_run(run_dir)
    plot_files = serve_load_report.PLOT_FILES if serve_load else PLOT_FILES
    section = results_section((run_dir / "results.md").read_text(encoding="utf-8"), plot_files)
    try:
        if serve_load:
            page = splice(page, section, SERVE_LOAD_START, SERVE_LOAD_END, append=True)
        else:
            page = splice(page, section, START, END, append=True)
    except ValueError as error:
        raise ValueError(f"{doc}: {error}") from None
    doc.write_text(page, encoding="utf-8")
    image_dir = doc.parent / "img"
    image_dir.mkdir(exist_ok=True)
    for name in plot_files:
        source = run_dir / name
        if source.exists():
            shutil.copyfile(source, image_dir / f"{IMAGE_PREFIX}{name}")
    logger.info("published %s into %s", run_dir, doc)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Splice a benchmark run (suite or serve-load) into docs/benchmarks.md.")
    parser.add_argument("run_dir", type=pathlib.Path, help="The --out directory of a specserve bench run.")
    parser.add_argument("--doc", type=pathlib.Path, default=DOCS_DIR / "benchmarks.md")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    publish(args.run_dir, args.doc)


if __name__ == "__main__":
    main()
