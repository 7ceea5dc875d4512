"""OutputTracker: EOS, max_tokens, stop strings across chunk boundaries, multi-byte pieces."""

from __future__ import annotations

import pytest

from actors.coordination.output import OutputTracker


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoints):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_checkpoints["target"])


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_multibyte_characters_are_emitted_only_when_complete(tokenizer):
    text = "naïve 你好 ✓ done"
    ids = _ids(tokenizer, text)
    tracker = OutputTracker(tokenizer, max_tokens=100)
    pieces = [tracker.add([token]).text for token in ids]
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) + tracker.finish("length").text == text
    # At least one token holds part of a character (byte-level BPE), so something was held back.
    assert any(piece == "" for piece in pieces)


def test_stop_string_split_across_chunks_never_leaks(tokenizer):
    ids = _ids(tokenizer, "return value\n\nnext line")
    tracker = OutputTracker(tokenizer, max_tokens=100, stop=["\n\nnext"])
    emitted = ""
    for token in ids:
        delta = tracker.add([token])
        emitted += delta.text
        assert "\n\n" not in emitted
        if delta.finish_reason:
            break
    assert tracker.finish_reason == "stop"
    assert emitted == "return value"


def test_eos_stops_and_is_not_emitted_unless_ignored(tokenizer):
    ids = _ids(tokenizer, "abc def")
    eos = tokenizer.eos_token_id
    tracker = OutputTracker(tokenizer, max_tokens=100, eos_token_ids={eos})
    delta = tracker.add(ids + [eos] + ids)
    assert delta.token_ids == ids and delta.finish_reason == "stop" and delta.text == "abc def"
    tracker = OutputTracker(tokenizer, max_tokens=100, eos_token_ids={eos}, ignore_eos=True)
    assert tracker.add(ids + [eos] + ids).token_ids == ids + [eos] + ids


def test_max_tokens_truncates_a_block():
    tracker = OutputTracker(None, max_tokens=5)
    assert tracker.add([1, 2, 3]).finish_reason is None
    delta = tracker.add([4, 5, 6, 7])
    assert delta.token_ids == [4, 5] and delta.finish_reason == "length"
    assert tracker.add([8]).token_ids == []


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_incremental_text_equals_decoding_everything(tokenizer, chunk):
    """Random token ids (split characters, spaces, special tokens) in chunks: the streamed text
    is exactly the full decode, though each step decodes only the newest tokens."""
    import random

    generator = random.Random(chunk)
    ids = [generator.randrange(len(tokenizer)) for _ in range(200)] + _ids(tokenizer, " naïve 你好 ✓")
    tracker = OutputTracker(tokenizer, max_tokens=1000)
    streamed = "".join(tracker.add(ids[i: i + chunk]).text for i in range(0, len(ids), chunk))
    streamed += tracker.finish("length").text
    assert streamed == tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _run(tracker, ids):
    emitted = ""
    for token in ids:
        delta = tracker.add([token])
        emitted += delta.text
        if delta.finish_reason:
            break
    return emitted


def test_include_stop_str_in_output_keeps_the_stop_string(tokenizer):
    ids = _ids(tokenizer, "return value\n\nnext line")
    tracker = OutputTracker(tokenizer, max_tokens=100, stop=["\n\nnext"], include_stop_str_in_output=True)
    assert _run(tracker, ids) == "return value\n\nnext"
    assert tracker.finish_reason == "stop"


def test_no_stop_string_ends_the_output_before_min_tokens(tokenizer):
    text = "a = 1\nb = 2\nc = 3\n"
    ids = _ids(tokenizer, text)
    first_line = len(_ids(tokenizer, "a = 1\n"))
    plain = OutputTracker(tokenizer, max_tokens=100, stop=["\n"])
    assert _run(plain, ids) == "a = 1"
    late = OutputTracker(tokenizer, max_tokens=100, stop=["\n"], min_tokens=first_line + 1)
    emitted = _run(late, ids)
    assert late.finish_reason == "stop" and emitted == "a = 1\nb = 2"
