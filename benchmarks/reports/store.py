"""The results store: one JSON record per benchmark case in ``benchmarks/results/<case>.json``.

A record is the latest figure of its case (history lives in git)::

    {"case": "serve-load-default-proxy",          # the file's stem: lower case, digits and dashes
     "title": "Served, one and 16 clients ...",   # what the table shows
     "command": "specserve bench --mode serve-load ...",
     "commit": "8062876", "date": "2026-11-26",   # what was measured, and when
     "machine": "shared 2-vCPU machine, no GPU",  # where
     "rows": [{"case": "ar", "clients": 1, "tokens_per_second": {"rounds": [...], "median": 277.4}}, ...],
     "columns": [...], "notes": "...",             # optional: column order, one line under the table,
     "section": "Peers"}                           # and the page's section (else the case name decides)

A value in a row is a number, a string, null, or ``{"rounds": [...], "median": m}`` (a figure
measured in several rounds). Rows that carry ``strategy``, ``clients`` and ``tokens_per_second``
(with ``gamma``, ``ratio_to_ar`` and ``block_efficiency`` when known) feed the generated "which
strategy and gamma" tables. ``python -m benchmarks.reports.tables`` turns the store into
``docs/results.md``; the benchmarks write their record with ``--record CASE``.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import re
import statistics
import subprocess
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO / "benchmarks" / "results"
REQUIRED_FIELDS = ("case", "title", "command", "commit", "date", "machine", "rows")
CASE_NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")


def rounds(values: list[float], digits: int = 1) -> dict[str, Any]:
    """A figure measured in several rounds: the rounds as measured and their median."""
    if not values:
        raise ValueError("rounds: at least one value is needed")
    return {"rounds": [round(float(v), digits) for v in values], "median": round(float(statistics.median(values)), digits)}


def figure(value: Any) -> float | None:
    """The number a value stands for (a rounds figure's median), or None for text and null."""
    if isinstance(value, dict):
        value = value.get("median")
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def check_record(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` when it has every field the store needs; else ValueError naming the field."""
    if not isinstance(record, dict):
        raise ValueError(f"a record is a JSON object, got {type(record).__name__}")
    for name in REQUIRED_FIELDS:
        if name not in record:
            raise ValueError(f"record {record.get('case', '?')!r}: missing field {name!r}")
    for name in REQUIRED_FIELDS[:-1]:
        if not isinstance(record[name], str) or not record[name].strip():
            raise ValueError(f"record {record.get('case', '?')!r}: field {name!r} must be a non-empty string")
    if not CASE_NAME.match(record["case"]):
        raise ValueError(f"record.case: {record['case']!r} must be lower case letters, digits and dashes")
    rows = record["rows"]
    if not isinstance(rows, list) or not rows or not all(isinstance(row, dict) for row in rows):
        raise ValueError(f"record {record['case']!r}: field 'rows' must be a non-empty list of objects")
    for i, row in enumerate(rows):
        for key, value in row.items():
            if isinstance(value, dict) and ("rounds" not in value or "median" not in value):
                raise ValueError(f"record {record['case']!r}: rows[{i}].{key}: an object value needs 'rounds' and 'median'")
    return record


def make_record(case: str, title: str, command: str, rows: list[dict[str, Any]], *, commit: str | None = None,
                date: str | None = None, machine: str | None = None, notes: str | None = None,
                columns: list[str] | None = None, section: str | None = None) -> dict[str, Any]:
    """A checked record; commit, date and machine default to this checkout, today and this machine."""
    record: dict[str, Any] = {
        "case": case, "title": title, "command": command, "commit": commit or git_commit(),
        "date": date or datetime.date.today().isoformat(), "machine": machine or machine_description(), "rows": rows,
    }
    if columns:
        record["columns"] = columns
    if notes:
        record["notes"] = notes
    if section:
        record["section"] = section
    return check_record(record)


def record_path(case: str, results_dir: pathlib.Path = RESULTS_DIR) -> pathlib.Path:
    return results_dir / f"{case}.json"


def write_record(record: dict[str, Any], results_dir: pathlib.Path = RESULTS_DIR) -> pathlib.Path:
    """Write (replace) the record of its case; its path."""
    check_record(record)
    results_dir.mkdir(parents=True, exist_ok=True)
    path = record_path(record["case"], results_dir)
    path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def load_records(results_dir: pathlib.Path = RESULTS_DIR) -> list[dict[str, Any]]:
    """Every record of the store, by case name; a file whose stem is not its case is refused."""
    records = []
    for path in sorted(results_dir.glob("*.json")):
        record = check_record(json.loads(path.read_text(encoding="utf-8")))
        if record["case"] != path.stem:
            raise ValueError(f"{path.name}: record.case is {record['case']!r}, expected {path.stem!r}")
        records.append(record)
    return records


def git_commit() -> str:
    """This checkout's short commit (``+changes`` when the tracked files differ), or n/a."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True, check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "n/a"
    return commit + ("+changes" if dirty else "")


def load_avg() -> str:
    """The machine's load averages over 1, 5 and 15 minutes (``"0.52 0.61 0.70"``), or n/a."""
    try:
        return " ".join(f"{value:.2f}" for value in os.getloadavg())
    except OSError:
        return "n/a"


def cpu_model() -> str | None:
    """The CPU's model name (``/proc/cpuinfo``), or None where it cannot be read."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def machine_description() -> str:
    """``x86_64, 2 CPUs (model), no GPU``: what a figure was measured on."""
    cpus = f"{os.cpu_count()} CPUs" + (f" ({model})" if (model := cpu_model()) else "")
    try:
        import torch

        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        gpus = []
    gpu = ", ".join(f"{gpus.count(name)} x {name}" for name in dict.fromkeys(gpus)) if gpus else "no GPU"
    return f"{platform.machine()}, {cpus}, {gpu}"
