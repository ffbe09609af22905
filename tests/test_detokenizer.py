"""workers.detokenizer: streamed pieces add up to the engine's final text, and no piece
is ever sent that a later token changes.

The reference is the engine's rule (workers/engine/loop.py `_completion`): the text
tokens (without a stop token that ended the request) decoded at once, cut before the
earliest stop string. Tokens come one at a time and in random chunks, as the publisher
drains them; after every push, what was sent must be a prefix of the final text (so no
piece holds half a character, or a U+FFFD where the final text has a character).
"""

from __future__ import annotations

import random

import pytest

from kvfleet.tokenizer import ByteTokenizer
from tests.test_engine_stops import TEXT, byte_level_bpe, stops_from, word_level  # noqa: F401 - fixtures
from workers.detokenizer import Detokenizer
from workers.engine.stops import REPLACEMENT, cut_at_stop

EMOJI_CJK = "🙂 東京タワー ✓ naïve 😀👍🏽 中文字符 ẞ 𝄞 " * 4


def final_text(tokenizer, completion: list[int], stop: tuple[str, ...], stop_token_ids: frozenset[int]) -> str:
    """The engine's text: it stops at the first stop token, which is not in the text."""
    for i, t in enumerate(completion):
        if t in stop_token_ids:
            completion = completion[:i]
            break
    text = tokenizer.decode(completion)
    cut = cut_at_stop(text, stop) if stop else None
    return text if cut is None else cut


def stream(tokenizer, completion: list[int], stop: tuple[str, ...] = (), stop_token_ids: frozenset[int] = frozenset(),
           rng: random.Random | None = None) -> tuple[list[str], str]:
    """Feed `completion` (one token at a time, or random chunks with `rng`); the pieces
    and the final text, checking the prefix property after every push."""
    final = final_text(tokenizer, completion, stop, stop_token_ids)
    detok = Detokenizer(tokenizer, stop=stop, stop_token_ids=stop_token_ids)
    pieces, i = [], 0
    while i < len(completion):
        n = rng.randint(1, 5) if rng else 1
        piece = detok.push(completion[i:i + n])
        i += n
        pieces.append(piece)
        sent = "".join(pieces)
        assert final.startswith(sent), (sent, final)
        assert REPLACEMENT not in piece or final[len(sent) - len(piece):len(sent)] == piece
    pieces.append(detok.finish(final))
    assert "".join(pieces) == final
    return pieces, final


def test_multibyte_characters_are_never_split():
    tok = ByteTokenizer()
    completion = list(EMOJI_CJK.encode())
    pieces, final = stream(tok, completion)
    assert final == EMOJI_CJK
    assert pieces[-1] == ""  # all of it went out while streaming: valid text is never held at the end
    assert all(REPLACEMENT not in p for p in pieces)
    # A 4-byte emoji is held for 3 tokens, then sent whole.
    assert "🙂" in pieces


def test_random_bytes_with_invalid_utf8_and_specials():
    tok = ByteTokenizer()
    rng = random.Random(0)
    valid = list(EMOJI_CJK.encode())
    for _ in range(300):
        completion = [rng.choice([rng.randrange(256), rng.choice(valid), rng.choice(valid), 256,
                                  0xF0, 0x9F, 0xE6, 0xC3, 0x80]) for _ in range(rng.randint(1, 80))]
        stream(tok, completion, rng=rng if rng.random() < 0.5 else None)


def test_stop_strings_cut_the_stream_where_the_engine_cuts_the_text():
    tok = ByteTokenizer()
    rng = random.Random(1)
    completion = list(EMOJI_CJK.encode())
    stops = stops_from(EMOJI_CJK, rng, 150) + [("東京",), ("🙂",), ("✓ n", "タワ"), ("never",)]
    for stop in stops:
        pieces, final = stream(tok, completion, stop, rng=rng if rng.random() < 0.5 else None)
        assert not any(s in "".join(pieces) for s in stop)


def test_random_bytes_with_stop_strings():
    tok = ByteTokenizer()
    rng = random.Random(2)
    for _ in range(200):
        completion = [rng.choice([rng.randrange(256), ord("a"), ord("b"), 0xC3, 0xA9]) for _ in range(60)]
        text = tok.decode(completion)
        stop = tuple(text[i:i + 2] for i in range(0, len(text) - 2, 11) if REPLACEMENT not in text[i:i + 2])[:3]
        stream(tok, completion, stop + ("ab", "é"), rng=rng)


def test_a_stop_token_is_not_part_of_the_text():
    tok = ByteTokenizer()
    completion = list("hello, world".encode())
    pieces, final = stream(tok, completion, stop_token_ids=frozenset({ord(",")}))
    assert final == "hello" and "".join(pieces) == "hello"


@pytest.mark.parametrize("name", ["byte_level_bpe", "word_level"])
def test_hf_tokenizers(name, request):
    tok = request.getfixturevalue(name)
    completion = tok.encode(TEXT)[1:] if name == "word_level" else tok.encode(TEXT)
    completion[5:5] = [tok.eos_token_id]  # a special token inside: decodes to nothing
    pieces, final = stream(tok, completion)
    assert final == tok.decode(completion) and len([p for p in pieces if p]) > 10  # it does stream
    rng = random.Random(3)
    for stop in stops_from(final, rng, 60) + [(" aus",), ("m です",), ("Köln! 東",)]:
        stream(tok, completion, stop, rng=rng if rng.random() < 0.5 else None)
    # Random token ids, specials among them: whatever they decode to, the pieces add up.
    vocab = tok.vocab_size
    for _ in range(50):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        stream(tok, ids, rng=rng, stop_token_ids=frozenset({ids[-1]}) if rng.random() < 0.3 else frozenset())


def test_finish_repairs_a_text_that_is_not_an_extension():
    # Cannot happen with the engine (same tokenizer, same tokens), but the stream must
    # still end with the final text's rest rather than crash.
    detok = Detokenizer(ByteTokenizer())
    assert detok.push(list(b"abc")) == "abc"
    assert detok.finish("abd") == "d"
