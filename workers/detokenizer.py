"""Incremental detokenization for streaming: a job's text, piece by piece, as its tokens come.

The pieces must concatenate to exactly the text the engine returns at the end
(workers/engine/loop.py `_completion`): the whole completion decoded at once, cut before
the earliest stop string, without a stop token that ended it. Text is not a sum of
per-token texts, so a piece is only sent once no later token can change it:

- Each token's text is the difference of two decodes over a window of the latest tokens
  (the technique of workers/engine/stops.py and vLLM's incremental detokenizer), so a
  tokenizer whose decoder joins words with spaces or merges bytes gets them in context.
- A window's text that ends in U+FFFD may be a character whose next bytes have not come
  yet: the U+FFFDs at its end are held back (the text before them is final: UTF-8
  resynchronises), and the window stays open until its text ends in a whole character.
- The last `max(len(stop)) - 1` characters are held back: a stop string may begin in
  them and end in text still to come. Once the text holds a stop string, only the text
  before the earliest one is sent, and nothing after it, ever.

Unlike StopWatch, a window is never forced shut: a trailing U+FFFD that is sent could
still turn into a character, and then the pieces would no longer add up. The cost of a
long run of tokens ending in U+FFFD (random weights) is a decode per token of a window
as long as the run; that runs on the stream publisher's thread, never the engine's.
"""

from __future__ import annotations

import logging
from typing import Iterable, Sequence

from kvfleet.tokenizer import Tokenizer
from workers.engine.stops import REPLACEMENT, cut_at_stop

log = logging.getLogger("kvfleet.worker")


class Detokenizer:
    """One job's completion, turned into text pieces safe to send as they come."""

    def __init__(self, tokenizer: Tokenizer, *, stop: Sequence[str] = (), stop_token_ids: Iterable[int] = ()) -> None:
        self._tokenizer = tokenizer
        self.stop = tuple(stop)
        self._stop_token_ids = frozenset(stop_token_ids)
        self._keep = max((len(s) for s in self.stop), default=1) - 1  # characters a stop string may start in
        self._tokens: list[int] = []  # the completion's text tokens so far
        self._prefix = 0  # first token of the decode window
        self._read = 0  # tokens before this one have all their (final) text taken
        self._taken = 0  # characters past decode(tokens[_prefix:_read]) taken already
        self._held = ""  # final text not sent yet: the tail a stop string may start in
        self._stopped = False  # a stop string was found: nothing more is ever sent
        self._closed = False  # a stop token came: no token after it is text
        self.sent = ""  # every piece so far, concatenated

    def push(self, token_ids: Iterable[int]) -> str:
        """Add the next tokens; the new text that is safe to send now (often "")."""
        for t in token_ids:
            if self._closed:
                break
            if t in self._stop_token_ids:
                # It ends the request (the engine generates nothing after it) and is no
                # part of its text, like EOS, which the decoder drops as a special token.
                self._closed = True
            else:
                self._tokens.append(t)
        if self._stopped:
            return ""
        return self._release(self._final_text())

    def finish(self, text: str) -> str:
        """The rest of the engine's final `text`: what the pieces so far lack of it.

        It should always start with what was sent; if a tokenizer ever breaks that, the
        stream cannot take text back, so the mismatch is logged and the rest is taken
        from where the two part (the job's result stays the truth)."""
        if not text.startswith(self.sent):
            common = next((i for i, (a, b) in enumerate(zip(text, self.sent)) if a != b),
                          min(len(text), len(self.sent)))
            log.warning("streamed text is not a prefix of the final text", extra={"at": common})
            rest = text[common:]
        else:
            rest = text[len(self.sent):]
        self.sent += rest
        self._stopped = True
        return rest

    def _final_text(self) -> str:
        """Text past what was taken before that no later token can change."""
        decode = self._tokenizer.decode
        tokens = self._tokens
        seen = decode(tokens[self._prefix:self._read])
        text = decode(tokens[self._prefix:])
        complete = text.rstrip(REPLACEMENT)
        new = complete[len(seen) + self._taken:]
        self._taken += len(new)
        if complete == text and len(text) > len(seen):
            # The window's text ends in a whole character: final, so the window moves on.
            self._prefix, self._read, self._taken = self._read, len(tokens), 0
        return new

    def _release(self, new: str) -> str:
        """Of the held-back tail plus `new`, what no stop string can reach."""
        held = self._held + new
        if not held:
            return ""
        cut = cut_at_stop(held, self.stop) if self.stop else None
        if cut is not None:
            # Everything before `held` was sent only once no stop string could start in
            # it, so the earliest stop of the whole text is the earliest one in `held`.
            self._stopped, self._held = True, ""
            out = cut
        else:
            split = max(len(held) - self._keep, 0)
            out, self._held = held[:split], held[split:]
        self.sent += out
        return out
