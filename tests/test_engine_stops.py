"""workers.engine.stops: incremental stop-string detection agrees with decoding everything.

The reference is what the engine did before: decode the whole completion after every
token and look for the stop strings in it. StopWatch must stop on the same token, for
stop strings that span tokens and characters split over byte-level tokens, while the
text it decodes grows linearly with the output.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import tokenizers

from kvfleet.tokenizer import ByteTokenizer, HFTokenizer
from workers.engine.stops import REPLACEMENT, StopWatch, cut_at_stop

TEXT = "Grüße aus Köln! 東京タワー は 333 m です。 naïve café — ünïcödé ✓ 🙂 end. " * 3


def first_stop_naive(tokenizer, prompt: list[int], completion: list[int], stop: tuple[str, ...]) -> int | None:
    """Tokens of the completion up to the one whose text completes a stop string."""
    for k in range(1, len(completion) + 1):
        text = tokenizer.decode(completion[:k])
        if any(s in text for s in stop):
            return k
    return None


def first_stop_watched(tokenizer, prompt: list[int], completion: list[int], stop: tuple[str, ...]) -> int | None:
    watch = StopWatch(stop, tokenizer, start=len(prompt))
    tokens = list(prompt)
    for k, t in enumerate(completion, start=1):
        tokens.append(t)
        if watch.update(tokens):
            return k
    return None


def stops_from(text: str, rng: random.Random, n: int) -> list[tuple[str, ...]]:
    """Substrings of `text` (so they do occur), some across characters of several bytes."""
    out = []
    for _ in range(n):
        lo = rng.randrange(len(text) - 6)
        out.append((text[lo:lo + rng.randint(1, 6)], "never-in-the-text"))
    return out


def test_byte_tokenizer_stops_on_the_same_token_as_a_full_decode():
    tok = ByteTokenizer()
    completion = list(TEXT.encode())
    rng = random.Random(0)
    for stop in stops_from(TEXT, rng, 200) + [("ö",), ("東京",), ("🙂",), ("✓ 🙂",), ("never",)]:
        assert first_stop_watched(tok, [256, 65], completion, stop) == first_stop_naive(tok, [256, 65], completion, stop), stop


def test_byte_tokenizer_with_invalid_bytes_and_specials():
    # Random weights emit bytes that are not UTF-8 and special tokens mid-text.
    tok = ByteTokenizer()
    rng = random.Random(1)
    for _ in range(100):
        completion = [rng.choice([rng.randrange(256), rng.randrange(256), 257, ord("a"), 0xC3, 0xA9])
                      for _ in range(60)]
        text = tok.decode(completion)
        # Stop strings with U+FFFD in them are left out: a full decode shows a character
        # whose next bytes are still to come as U+FFFD too, so it may stop a token early.
        stops = [(text[i:i + 2],) for i in range(0, len(text) - 2, 7) if REPLACEMENT not in text[i:i + 2]]
        for stop in stops + [("a0",), ("é",)]:
            assert first_stop_watched(tok, [256], completion, stop) == first_stop_naive(tok, [256], completion, stop)


@pytest.fixture(scope="module")
def byte_level_bpe(tmp_path_factory) -> HFTokenizer:
    """A GPT-2 style byte-level BPE: multi-byte characters split over tokens, with HF's decoder."""
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator([TEXT] * 5, vocab_size=300, min_frequency=2, special_tokens=["<s>", "</s>"])
    path = Path(tmp_path_factory.mktemp("bpe")) / "tokenizer.json"
    bpe.save(str(path))
    return HFTokenizer(path, bos_token_id=0, eos_token_id=1)


@pytest.fixture(scope="module")
def word_level(tmp_path_factory) -> HFTokenizer:
    """Words joined by spaces on decode: a token's text depends on the one before it."""
    words = sorted(set(TEXT.split()))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i for i, w in enumerate(words, start=3)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    path = Path(tmp_path_factory.mktemp("words")) / "tokenizer.json"
    tok.save(str(path))
    return HFTokenizer(path, bos_token_id=1, eos_token_id=2)


@pytest.mark.parametrize("name", ["byte_level_bpe", "word_level"])
def test_hf_tokenizers_stop_on_the_same_token_as_a_full_decode(name, request):
    tok: HFTokenizer = request.getfixturevalue(name)
    completion = tok.encode(TEXT)[1:] if name == "word_level" else tok.encode(TEXT)
    completion[5:5] = [tok.eos_token_id]  # a special token inside: decodes to nothing
    full = tok.decode(completion)
    rng = random.Random(2)
    stops = stops_from(full, rng, 150) + [(" aus",), ("m です",), ("Köln! 東",)]
    for stop in stops:
        assert first_stop_watched(tok, [0], completion, stop) == first_stop_naive(tok, [0], completion, stop), stop


class CountingTokenizer(ByteTokenizer):
    def __init__(self) -> None:
        self.decoded = 0

    def decode(self, ids) -> str:
        self.decoded += len(ids)
        return super().decode(ids)


def test_work_is_linear_in_the_output():
    tok = CountingTokenizer()
    rng = random.Random(3)
    n = 20_000  # a full decode per token would decode n^2 / 2 = 2e8 tokens
    completion = [rng.randrange(256) for _ in range(n)]  # mostly invalid UTF-8: the worst case for holding back
    watch = StopWatch(("never-in-the-text",), tok, start=0)
    tokens: list[int] = []
    for t in completion:
        tokens.append(t)
        assert not watch.update(tokens)
    assert tok.decoded < 50 * n


def test_cut_at_stop_keeps_the_text_before_the_earliest_stop():
    assert cut_at_stop("one two three", ("three", "two")) == "one "
    assert cut_at_stop("one two", ("four",)) is None
