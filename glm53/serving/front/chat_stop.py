"""A chat choice's markup events under stop strings.

The StopScanner (glm53/serving/front/stop.py) runs over the whole generated text, thinking and tool-call text
included (markup tokens decode to nothing). Tokens reach the markup parser only once the scanner
knows their text cannot be part of a stop string, so a stop string never goes out in a delta. At a
stop, the tokens up to the one that completed it are parsed and the characters from the stop string
on are trimmed off the last text events: the reply is the parse of the cut text. A stop inside an
unfinished tool call leaves the call's markup as content (the parser's rule for malformed markup).
"""
from __future__ import annotations

from collections.abc import Sequence

from glm53.serving.front.glm_markup import ContentDelta, Event, ReasoningDelta, ReplyParser
from glm53.serving.front.stop import StopScanner


class StoppedParse:
    """Feed every batch after the scanner took it (`push`), then `finish` with all the job's tokens."""

    def __init__(self, parser: ReplyParser, scanner: StopScanner) -> None:
        self.parser, self.scanner = parser, scanner
        self._ids: list[int] = []
        self._fed = 0

    def push(self, tokens: Sequence[int]) -> list[Event]:
        self._ids.extend(tokens)
        if self.scanner.stopped:
            return []  # the cut is trimmed once, at finish
        return self._feed(self.scanner.settled_tokens())

    def finish(self, tokens: Sequence[int]) -> list[Event]:
        """The rest once the scanner finished: the tokens it kept, parsed, less its overshoot."""
        self._ids = list(tokens)
        events = self._feed(self.scanner.tokens_used) + self.parser.finish()
        return trim_tail(events, self.scanner.overshoot)

    def _feed(self, upto: int) -> list[Event]:
        ids, self._fed = self._ids[self._fed:upto], max(self._fed, upto)
        return self.parser.push(ids) if ids else []


def trim_tail(events: list[Event], chars: int) -> list[Event]:
    """The events less `chars` characters of text at their end (text events only: a tool call the
    parser closed came before the stop string)."""
    out = list(events)
    while chars > 0 and out and isinstance(out[-1], (ContentDelta, ReasoningDelta)):
        last = out.pop()
        if len(last.text) > chars:
            out.append(type(last)(last.text[:len(last.text) - chars]))
        chars -= len(last.text)
    return out
