"""Chunks a slow consumer has not read yet are merged into one, losing nothing."""

from __future__ import annotations

from actors.request_schema import GenerationChunk, RequestStats
from actors.coordination.coordinator import merge_chunks


def test_merged_chunks_keep_every_token_and_the_final_state():
    stats = RequestStats(strategy="sd", completion_tokens=5)
    chunks = [
        GenerationChunk(request_id="r", token_ids=[1, 2], text="ab"),
        GenerationChunk(request_id="r", token_ids=[3], text="c"),
        GenerationChunk(request_id="r", token_ids=[4, 5], text="de", finished=True, finish_reason="length", stats=stats),
    ]
    merged = merge_chunks(chunks)
    assert merged.token_ids == [1, 2, 3, 4, 5] and merged.text == "abcde"
    assert merged.finished and merged.finish_reason == "length" and merged.stats == stats


def test_a_single_chunk_is_passed_through():
    chunk = GenerationChunk(request_id="r", token_ids=[7], text="x")
    assert merge_chunks([chunk]) is chunk


def test_an_error_chunk_after_tokens_keeps_the_tokens_and_the_error():
    merged = merge_chunks([
        GenerationChunk(request_id="r", token_ids=[1], text="a"),
        GenerationChunk(request_id="r", finished=True, finish_reason="error", error="worker failed"),
    ])
    assert merged.token_ids == [1] and merged.error == "worker failed" and merged.finish_reason == "error"
