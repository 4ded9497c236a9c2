"""Stop strings (`stop`): text-level, over the reply's decoded characters.

Tokens are decoded one at a time through the incremental decoder, which yields text only once a
UTF-8 character is complete, so a match, and the cut before it, never falls inside a character.
The reply ends before the first occurrence of any stop string (the string itself is not part of
the reply, as OpenAI does); `tokens_used` counts the tokens up to and including the one that
completed it, so usage and logprobs are the same whether the engine decided tokens one at a
time or a drafted window at once. While streaming, text that could be the start of a stop string
is held back until the next tokens tell whether it is one (`releasable`).
"""
from __future__ import annotations

import bisect

from glm53.serving.front.chat import ChatText, IncrementalDecoder


class StopScanner:
    """Feed it the engine's token batches; it says when a stop string has appeared."""

    def __init__(self, text: ChatText, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._decoder = IncrementalDecoder(text)
        self._longest = max((len(s) for s in self.stops), default=0)
        self.text = ""  # the reply's text so far, cut before the stop string once one appeared
        self.tokens_used = 0  # tokens that make up the reply (the one completing the stop included)
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the reply
        self.overshoot = 0  # characters decoded past the cut (the stop string and what followed it)
        self._ends: list[int] = []  # per token taken: the text's length once it was decoded
        self._released = 0

    def push(self, tokens: list[int]) -> bool:
        """Take a batch; True once a stop string appeared (tokens after it are not taken)."""
        for token in tokens:
            if self.stopped:
                break
            self.tokens_used += 1
            self._add(self._decoder.push([token]))
            self._ends.append(len(self.text) + self.overshoot)
        return self.stopped

    def finish(self) -> None:
        """Generation ended without a stop string: take the text still pending in the decoder."""
        if not self.stopped:
            self._add(self._decoder.finish())

    def _add(self, piece: str) -> None:
        if not piece:
            return
        searched_from = max(0, len(self.text) - self._longest + 1)
        self.text += piece
        found = [(i, s) for s in self.stops if (i := self.text.find(s, searched_from)) >= 0]
        if found:
            at, self.matched = min(found)
            self.overshoot = len(self.text) - at
            self.text = self.text[:at]
            self.stopped = True

    def releasable(self) -> str:
        """Text not yet handed out that can no longer become part of a stop string."""
        end = len(self.text) if self.stopped else len(self.text) - self._held_back()
        piece = self.text[self._released:end] if end > self._released else ""
        self._released = max(self._released, end)
        return piece

    def settled_tokens(self) -> int:
        """How many tokens lie wholly before any possible stop string (all taken ones once it stopped)."""
        if self.stopped:
            return self.tokens_used
        return bisect.bisect_right(self._ends, len(self.text) - self._held_back())

    def rest(self) -> str:
        """Everything not yet handed out (generation is over)."""
        piece = self.text[self._released:]
        self._released = len(self.text)
        return piece

    def _held_back(self) -> int:
        """The length of the longest end of the text that is a proper prefix of a stop string."""
        for n in range(min(self._longest - 1, len(self.text)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0
