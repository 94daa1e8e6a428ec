"""Incremental detokenization: DecodeStream (the Rust path) and the Python fallback give the text a
one-shot decode of the same tokens gives, never show half a character, and flush a trailing one."""
from __future__ import annotations

import pytest

from nanoserve.detokenizer import Detokenizer

TEXTS = ["Héllo wörld, 日本語のテキスト!  double  spaces\nnew line 🤖 emoji",
         " leading space, tabs\tand 'quotes' — dashes … ellipsis",
         "x = [1, 2, 3]  # code\n\n\tdef f():\n\t\treturn '🙂'"]


class PythonOnly:
    """The tokenizer without its Rust backend: Detokenizer takes its fallback path."""

    def __init__(self, tok) -> None:
        self.decode = tok.decode


@pytest.fixture(scope="module")
def tok(embedded_dir):
    from transformers import AutoTokenizer
    t = AutoTokenizer.from_pretrained(embedded_dir)
    assert t.backend_tokenizer is not None
    return t


def _stream(tokenizer, prompt: list[int], out: list[int],
            stop=()) -> tuple[Detokenizer, list[str], str | None]:
    det = Detokenizer(tokenizer, len(prompt), list(stop))
    ids, shown, matched = list(prompt), [], None
    for t in out:
        ids.append(t)
        matched = det.step(ids)
        shown.append(det.text)
        if matched:
            break
    else:
        det.flush(ids)
    return det, shown, matched


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("python_only", [False, True])
def test_streamed_text_equals_one_shot_decode(tok, text, python_only):
    prompt = tok.encode("The answer is:")
    out = tok.encode(text)
    det, shown, _ = _stream(PythonOnly(tok) if python_only else tok, prompt, out)
    want = tok.decode(prompt + out, skip_special_tokens=True)[
        len(tok.decode(prompt, skip_special_tokens=True)):]
    assert det.text == want
    assert not any("\ufffd" in s for s in shown)  # no half-decoded character was ever shown
    assert all(b.startswith(a) for a, b in zip(shown, shown[1:]))  # text only grows


@pytest.mark.parametrize("python_only", [False, True])
def test_a_trailing_partial_character_is_flushed(tok, python_only):
    prompt = tok.encode("Robot:")
    out = tok.encode(" 🤖")
    cut = next(k for k in range(1, len(out)) if "\ufffd" in tok.decode(out[:k]))
    det, shown, _ = _stream(PythonOnly(tok) if python_only else tok, prompt, out[:cut])
    assert "\ufffd" not in "".join(shown[:-1]) and det.text.endswith("\ufffd")  # shown only at the end


@pytest.mark.parametrize("python_only", [False, True])
def test_stop_string_cuts_the_text(tok, python_only):
    prompt = tok.encode("Q:")
    out = tok.encode(" one, two, three, four")
    det, _, matched = _stream(PythonOnly(tok) if python_only else tok, prompt, out, stop=["three"])
    assert matched == "three" and det.text == " one, two, "
