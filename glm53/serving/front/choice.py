"""One choice of a reply (n choices are n jobs): its job, the job's events, the stop strings' cut
(glm53/serving/front/stop.py) and, for a chat reply, the markup parser that reads its tokens (glm53/serving/front/glm_markup.py;
under stop strings through glm53/serving/front/chat_stop.py).

Per batch: `take` first (the scanner; a stop string stops the engine), then `markup` (the parser's
events for the tokens now settled). Once the job is done: `end`, then `markup_end`.
"""
from __future__ import annotations

from typing import Any

from glm53.serving.front.chat_stop import StoppedParse
from glm53.serving.front.glm_markup import Event, ReplyParser
from glm53.serving.front.stop import StopScanner
from glm53.serving.front.worker import Job


class Choice:
    def __init__(self, index: int, job: Job, events: Any, scanner: StopScanner | None,
                 parser: ReplyParser | None) -> None:
        self.index, self.job, self.events, self.scanner, self.parser = index, job, events, scanner, parser
        self._stopped_parse = StoppedParse(parser, scanner) if parser is not None and scanner is not None else None
        self.pushed = 0  # tokens handed to the scanner
        self.parsed = 0  # tokens handed to the parser (without a scanner)
        self.used = 0  # once the job is done: how many of its tokens the reply keeps

    def take(self, tokens: list[int]) -> int:
        """Record a batch; how many of its tokens belong to the reply (fewer once a stop string appeared)."""
        if self.scanner is None:
            return len(tokens)
        if self.scanner.stopped:
            return 0
        before = self.scanner.tokens_used
        self.pushed += len(tokens)
        if self.scanner.push(tokens):
            self.job.stopped.set()  # the engine stops at its next step
        return self.scanner.tokens_used - before

    def end(self, tokens: list[int]) -> int:
        """The job is done (`tokens`: all it decided, some perhaps never sent as events); the reply's length."""
        if self.scanner is None:
            self.used = len(tokens)
            return self.used
        if not self.scanner.stopped:
            self.take(tokens[self.pushed:])
        self.scanner.finish()
        self.used = self.scanner.tokens_used
        return self.used

    def markup(self, tokens: list[int]) -> list[Event]:
        """The parser's events for a batch that `take` saw (a chat reply only)."""
        assert self.parser is not None
        if self._stopped_parse is not None:
            return self._stopped_parse.push(tokens)
        self.parsed += len(tokens)
        return self.parser.push(tokens)

    def markup_end(self, tokens: list[int]) -> list[Event]:
        """The rest of the events once `end` ran (all of them when `markup` never ran)."""
        assert self.parser is not None
        if self._stopped_parse is not None:
            return self._stopped_parse.finish(tokens)
        rest, self.parsed = tokens[self.parsed:], len(tokens)
        return (self.parser.push(rest) if rest else []) + self.parser.finish()

    @property
    def stopped(self) -> bool:
        """A stop string ended the reply."""
        return self.scanner is not None and self.scanner.stopped

    @property
    def matched(self) -> str | None:
        return self.scanner.matched if self.scanner is not None else None


