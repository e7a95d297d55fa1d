"""IncrementalDetokenizer: deltas add up to the decode, no half characters, exact stop strings."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fairbatch.engine.detokenizer import IncrementalDetokenizer
from fairbatch.engine.tokenizer import Tokenizer

TOK = Tokenizer.tiny()
VOCAB = TOK.vocab_size
FFFD = "\ufffd"


def _stream(
    ids: Sequence[int], prompt: Sequence[int] = (1,), **kwargs
) -> tuple[list[str], str, IncrementalDetokenizer]:
    """Feed `ids` one by one: (deltas of add_token, finish(), the detokenizer)."""
    detok = IncrementalDetokenizer(TOK, prompt, **kwargs)
    deltas = [detok.add_token(i) for i in ids]
    return deltas, detok.finish(), detok


def _enc(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


def _reference_cut(text: str, stop: Sequence[str], include: bool) -> tuple[str, str | None]:
    """The match that ends first (ties: starts first) decides; brute force over positions."""
    for end in range(1, len(text) + 1):
        for start in range(end):
            if text[start:end] in stop:
                return (text[:end] if include else text[:start]), text[start:end]
    return text, None


# -- no stop strings: deltas add up to the decode ---------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.integers(0, VOCAB - 1), max_size=40),
    prompt=st.lists(st.integers(0, VOCAB - 1), max_size=8),
    skip=st.booleans(),
)
def test_random_ids_deltas_concatenate_to_decode(ids, prompt, skip) -> None:
    # Prompt tails that end mid-character are dropped as context, so this holds for any prompt.
    deltas, tail, _ = _stream(ids, prompt, skip_special_tokens=skip)
    assert "".join(deltas) + tail == TOK.decode(ids, skip_special_tokens=skip)


@settings(max_examples=300, deadline=None)
@given(
    st.text(alphabet=st.sampled_from("ab é中文🚀🐢👨‍👩‍👧\n"), max_size=30) | st.text(max_size=30)
)
def test_valid_text_never_emits_replacement_char(text: str) -> None:
    assume(FFFD not in text)
    # Kept special tokens: a text like "<|im_end|>" encodes to one, and must come back.
    deltas, tail, _ = _stream(_enc(text), _enc("Prompt:"), skip_special_tokens=False)
    assert all(FFFD not in d for d in deltas)
    assert "".join(deltas) + tail == text
    assert tail == ""  # valid UTF-8 leaves nothing to flush


def test_multibyte_character_split_across_tokens_is_held_until_complete() -> None:
    ids = _enc("a🐢b")
    assert len(ids) >= 4  # the turtle takes several byte-level tokens
    deltas, tail, _ = _stream(ids)
    assert deltas[0] == "a" and deltas[-1] == "b"
    middle = deltas[1:-1]
    assert middle[:-1] == [""] * (len(middle) - 1) and middle[-1] == "🐢"
    assert tail == ""


def test_unfinished_character_flushed_by_finish() -> None:
    ids = _enc("🐢")[:-1]
    deltas, tail, _ = _stream(ids)
    assert deltas == [""] * len(ids)
    assert tail == TOK.decode(ids) and tail.endswith(FFFD)


def test_prompt_ending_mid_character_is_not_used_as_context() -> None:
    ids = _enc("🐢x")
    prompt, output = ids[:1], ids[1:]
    deltas, tail, _ = _stream(output, prompt)
    assert "".join(deltas) + tail == TOK.decode(output)


def test_special_tokens_skipped_or_kept() -> None:
    ids = [2, *_enc("user"), 3]
    assert "".join(_stream(ids)[0]) == "user"
    assert "".join(_stream(ids, skip_special_tokens=False)[0]) == "<|im_start|>user<|im_end|>"


def test_work_per_token_is_constant_not_quadratic() -> None:
    """Decoding must look at a short window, not the whole output, at each step."""
    decoded = 0

    class CountingTokenizer:
        def decode(self, ids, skip_special_tokens=True):
            nonlocal decoded
            decoded += len(ids)
            return TOK.decode(ids, skip_special_tokens)

    text = "The scheduler runs 🚀 at every step, 中文 too. " * 60
    ids = _enc(text)
    detok = IncrementalDetokenizer(CountingTokenizer(), [1, 2, 3, 4, 5, 6, 7])  # type: ignore[arg-type]
    out = "".join(detok.add_token(i) for i in ids) + detok.finish()
    assert out == text
    assert decoded <= 8 * len(ids)  # a whole-output decode per step would be ~len(ids)**2 / 2


# -- stop strings -----------------------------------------------------------------------------


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_split_across_tokens_cut_exactly(include: bool) -> None:
    text = "The answer is 42.\nEND of story, and more text"
    ids = _enc(text)
    assert len(_enc("\nEND")) >= 2  # the stop string spans tokens
    deltas, tail, detok = _stream(ids, stop=["\nEND"], include_stop_str_in_output=include)
    assert "".join(deltas) == ("The answer is 42.\nEND" if include else "The answer is 42.")
    assert detok.stopped and detok.stop_reason == "\nEND" and tail == ""
    assert detok.add_token(_enc("x")[0]) == ""  # tokens after the stop are ignored


def test_possible_stop_prefix_is_held_then_released() -> None:
    detok = IncrementalDetokenizer(TOK, [1], stop=["STOP"])
    emitted = ""
    for piece in ["go", " ", "S", "T", "O", "X"]:
        for tid in _enc(piece):
            emitted += detok.add_token(tid)
        if piece == "O":
            assert emitted == "go "  # "STO" might still become "STOP"
    assert emitted == "go STOX" and not detok.stopped


def test_stop_string_inside_one_token_and_at_start() -> None:
    deltas, _, detok = _stream(_enc(" the scheduler"), stop=["sched"])
    assert "".join(deltas) == " the " and detok.stop_reason == "sched"
    deltas, _, detok = _stream(_enc("abc"), stop=["a"], include_stop_str_in_output=True)
    assert deltas[0] == "a" and detok.stopped


def test_multibyte_stop_string_split_across_byte_tokens() -> None:
    text = "x中文y"
    assert len(_enc("中文")) >= 3
    deltas, tail, detok = _stream(_enc(text), stop=["文"])
    assert "".join(deltas) + tail == "x中" and detok.stop_reason == "文"


def test_earliest_ending_match_wins() -> None:
    # Both matches arrive in one token: the one that ends first wins, as it would have if the
    # text had arrived a character at a time.
    ids = _enc(" the scheduler")
    assert len(ids) == 2
    deltas, _, detok = _stream(ids, stop=["scheduler", "hed"])
    assert "".join(deltas) == " the sc" and detok.stop_reason == "hed"
    # Of two matches ending together the longer one wins.
    deltas, _, detok = _stream(ids, stop=["uler", "duler"])
    assert "".join(deltas) == " the sche" and detok.stop_reason == "duler"


def test_finish_flushes_held_stop_prefix() -> None:
    deltas, tail, detok = _stream(_enc("done EN"), stop=["END"])
    assert "".join(deltas) == "done " and tail == "EN" and not detok.stopped


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet=st.sampled_from("ab c\n中🚀"), max_size=25),
    stops=st.lists(st.text(alphabet=st.sampled_from("ab c\n中🚀"), min_size=1, max_size=4),
                   max_size=3),
    include=st.booleans(),
)  # fmt: skip
def test_stop_strings_match_reference(text: str, stops: list[str], include: bool) -> None:
    want, reason = _reference_cut(text, stops, include)
    detok = IncrementalDetokenizer(TOK, [1], stop=stops, include_stop_str_in_output=include)
    emitted = ""
    for tid in _enc(text):
        emitted += detok.add_token(tid)
        # Never ahead of the answer: nothing past (or inside) the stop string leaks out.
        assert want.startswith(emitted)
    emitted += detok.finish()
    assert emitted == want
    assert detok.stop_reason == reason and detok.stopped == (reason is not None)


# -- resume -----------------------------------------------------------------------------------


@pytest.mark.parametrize("cut", [1, 3, 6, 9])
def test_resume_continues_without_gap_or_repeat(cut: int) -> None:
    prompt = _enc("Question: ")
    ids = _enc("ab🐢 ST中 STOP rest")
    kwargs = {"stop": ["STOP"], "include_stop_str_in_output": False}
    full, tail, _ = _stream(ids, prompt, **kwargs)
    first = IncrementalDetokenizer(TOK, prompt, **kwargs)
    before = "".join(first.add_token(i) for i in ids[:cut])
    resumed = IncrementalDetokenizer.resume(TOK, prompt, ids[:cut], **kwargs)
    after = "".join(resumed.add_token(i) for i in ids[cut:]) + resumed.finish()
    assert before + after == "".join(full) + tail == "ab🐢 ST中 "
