"""TextStream: streamed pieces hold back partial UTF-8 characters and add up to the whole decode."""

import os

import pytest

from models.text_stream import REPLACEMENT, TextStream
from models.tokenizer import Tokenizer

SNAPSHOT = os.path.join(os.path.dirname(__file__), "fixtures", "processor", "snapshot")
TEXTS = ["视频里有一只猫在桌子上睡觉。 Les élèves <|im_end|> ok 😀!", "plain ascii, then 你好",
         "🎬🎬🎬"]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_pretrained(SNAPSHOT)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_pieces_add_up_and_never_end_in_a_partial_character(tok, text, chunk):
    ids = tok.encode([text])["input_ids"][0].tolist()
    decode = lambda x: tok.decode(x, skip_special_tokens=True)  # noqa: E731
    stream = TextStream(decode)
    pieces = [stream.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(stream.flush())
    assert "".join(pieces) == decode(ids)
    assert not any(p.endswith(REPLACEMENT) for p in pieces)
    single_tokens = [tok.decode([i]) for i in ids]
    if chunk == 1 and any(REPLACEMENT in s for s in single_tokens):  # some token holds part of a character
        assert "" in pieces[:-1]


def test_invalid_bytes_are_flushed_as_replacement_characters(tok):
    # a lone continuation byte never completes: it is released by the next token, or by flush at the end
    broken = [i for i in range(256) if tok.decode([i]) == REPLACEMENT][:1]
    assert broken, "expected a byte-level token that is not a character on its own"
    stream = TextStream(lambda x: tok.decode(x))
    assert stream.push(broken) == ""
    assert stream.flush() == REPLACEMENT
    assert stream.flush() == ""
    with pytest.raises(ValueError, match="decode: expected a callable"):
        TextStream("not callable")
