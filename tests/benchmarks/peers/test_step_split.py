"""benchmarks.peers.step_split: the worker's own functions timed in place, and put back."""

from __future__ import annotations

import collections

import torch

from actors.worker import step
from benchmarks.peers import step_split


def test_timed_functions_count_their_part_once_and_are_put_back():
    original_to_host, original_rows = step.to_host, step.batch_rows
    seconds: dict[str, float] = collections.defaultdict(float)
    restore = step_split.time_in_place(seconds)
    try:
        assert step.to_host is not original_to_host and step.batch_rows is not original_rows
        assert step.to_host([torch.zeros(1, 2)])[0].shape == (1, 2)
        assert step.batch_rows([]) == []
    finally:
        restore()
    assert step.to_host is original_to_host and step.batch_rows is original_rows
    assert set(seconds) == {"transport", "rows"} and all(value >= 0 for value in seconds.values())


def test_every_timed_part_is_a_reported_part_or_the_step():
    assert {part for part, _, _ in step_split.TIMED} == set(step_split.PARTS) | {"step"}
