"""Put a benchmark run into the results store: ``python -m benchmarks.reports.publish OUT --record CASE``.

``OUT`` is the ``--out`` directory of a ``specserve bench`` run (the suite or ``--mode
serve-load``); its results.json becomes ``benchmarks/results/CASE.json`` (replacing the case's
previous record) and ``docs/results.md`` is regenerated from the store
(:mod:`benchmarks.reports.tables`).
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib

from benchmarks.reports.store import RESULTS_DIR
from benchmarks.reports.tables import PAGE, update
from benchmarks.reports.writers import serve_load_record, suite_record
from benchmarks.served.serve_load_records import KIND as SERVE_LOAD_KIND
from benchmarks.served.serve_load_records import ServeLoadResults

logger = logging.getLogger(__name__)


def run_record(run_dir: pathlib.Path, case: str, title: str | None = None) -> dict:
    """The store record of the run in ``run_dir`` (its results.json)."""
    data = json.loads((run_dir / "results.json").read_text(encoding="utf-8"))
    if data.get("kind") == SERVE_LOAD_KIND:
        return serve_load_record(ServeLoadResults.from_json(data), case, title)
    return suite_record(data, case, title)


def publish(run_dir: pathlib.Path, case: str, *, title: str | None = None, results_dir: pathlib.Path = RESULTS_DIR,
            page: pathlib.Path = PAGE) -> pathlib.Path:
    """Write the run's record into the store and regenerate the page; the record's path."""
    path = update(run_record(run_dir, case, title), results_dir, page)
    logger.info("published %s as %s (%s regenerated)", run_dir, path, page)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a benchmark run (suite or serve-load) into the results store.")
    parser.add_argument("run_dir", type=pathlib.Path, help="The --out directory of a specserve bench run.")
    parser.add_argument("--record", required=True, help="The case's name in the store (benchmarks/results/CASE.json).")
    parser.add_argument("--title", default=None, help="The table's title in docs/results.md.")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    publish(args.run_dir, args.record, title=args.title)


if __name__ == "__main__":
    main()
