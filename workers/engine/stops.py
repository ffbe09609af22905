"""Stop strings: which generated token completes one, found in time linear in the output.

A stop string is text, and text is not a sum of per-token texts: a multi-byte character
may be split over several byte-level tokens, and a tokenizer's decoder may put a space
between two tokens (WordLevel) or drop one at the start (SentencePiece). So each new
token's text is found as the difference of two decodes over a short window of the
latest tokens (the technique of Hugging Face's TextStreamer and vLLM's incremental
detokenizer):

    new text = decode(tokens[prefix:])[len(decode(tokens[prefix:read])):]

The window moves on (prefix, read = read, len(tokens)) once its text is complete. It
stays open while the text ends in U+FFFD (a character whose next bytes have not come
yet; the text before it is searched already) or is empty (a token that decodes to
nothing, e.g. a special one). A stop string that ends in the new text starts at most
`len(stop) - 1` characters before it, so only that tail of the old text is kept. Each
step costs a decode of a few tokens and a search of a few characters; the whole
completion is decoded once, at the end.

A stop string that itself contains U+FFFD may be found a token later than in a full
decode, which shows a character still incomplete as U+FFFD as well.
"""

from __future__ import annotations

from typing import Sequence

from kvfleet.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"  # what a decoder shows for bytes that are not (yet) a whole character
#: Tokens a window stays open for before its text is taken as it is. UTF-8 leaves at
#: most 3 byte-level tokens of a character pending; more means bytes that will never
#: form one (random weights) or a run of special tokens, and waiting on them would make
#: each step's window, and so the whole search, grow with the output.
MAX_HELD_TOKENS = 16


class StopWatch:
    """Watches one sequence's completion for its stop strings, one token at a time."""

    def __init__(self, stop: Sequence[str], tokenizer: Tokenizer, *, start: int) -> None:
        """`start`: index of the first completion token in the token ids passed to `update`."""
        self.stop = tuple(stop)
        self._tokenizer = tokenizer
        self._keep = max((len(s) for s in self.stop), default=1) - 1  # old characters a new match may start in
        self._tail = ""  # the last `_keep` characters of the text searched so far
        self._prefix = start  # first token of the decode window
        self._read = start  # tokens before this one have had all their text searched
        self._searched = 0  # characters past decode(tokens[_prefix:_read]) searched already

    def update(self, token_ids: Sequence[int]) -> bool:
        """After a token was appended to `token_ids` (the prompt, then the completion):
        True once the completion's text contains a stop string."""
        decode = self._tokenizer.decode
        seen = decode(token_ids[self._prefix:self._read])
        text = decode(token_ids[self._prefix:])
        forced = len(token_ids) - self._read >= MAX_HELD_TOKENS
        # A trailing U+FFFD may be a character whose next bytes are still to come: search
        # the text before it now, and keep the window open until it resolves.
        complete = text if forced else text.rstrip(REPLACEMENT)
        new = complete[len(seen) + self._searched:]
        self._searched += len(new)
        if forced or (complete == text and len(text) > len(seen)):
            self._prefix, self._read, self._searched = self._read, len(token_ids), 0
        if not new:
            return False
        haystack = self._tail + new
        self._tail = haystack[-self._keep:] if self._keep else ""
        return any(s in haystack for s in self.stop)


def cut_at_stop(text: str, stop: Sequence[str]) -> str | None:
    """`text` up to the earliest stop string in it, or None when it holds none."""
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return text[:min(hits)] if hits else None
