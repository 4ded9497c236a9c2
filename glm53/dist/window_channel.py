"""Drafted decoding over R ranks: rank 0 decides, the others replay its windows (WindowChannel),
and rank 0's Target and MTP adapter that announce each call first (LeadingTarget, LeadingMtpAdapter)."""
from __future__ import annotations

from typing import Sequence

import torch

from drafter.glm53_target import Glm53MtpAdapter
from glm53.dist.collectives import Comm

_DTYPES = {1: torch.float32, 2: torch.bfloat16, 3: torch.float16}
_DTYPE_CODES = {v: k for k, v in _DTYPES.items()}


class WindowChannel:
    """Rank 0's drafted-decoding decisions, replayed by ranks 1..R-1.

    Drafting, acceptance and sampling happen on rank 0 only. Every forward of the model (target
    window, MTP layer step, and the embedding / LM head lookups DFlash2 borrows) is a sequence of
    collectives, so rank 0 broadcasts each such call first and every follower runs the same call:
      FORWARD start tokens        a verification window of the target;
      TRUNCATE length             rows of rejected drafts dropped;
      MTP_FORWARD start tokens X  one MTP layer call (X: the hidden rows it conditions on), on every
                                  rank's own MTP cache (the MTP layer is TP-sharded like the others);
      MTP_TRUNCATE length         the MTP cache follows rank 0's (rejected chained rows dropped);
      EMBED tokens / HEAD X       the target's embedding of tokens / logits of hidden rows X (DFlash2);
      END length                  the request is over: keep `length` rows (the pending token's row
                                  is dropped, exactly as on rank 0).
    Since all ranks compute the same values bit for bit, nothing else need agree. X travels as fp32
    (exact for fp32 / bf16 / fp16) and is restored to its dtype."""

    FORWARD, TRUNCATE, END, MTP_FORWARD, MTP_TRUNCATE, EMBED, HEAD = 1, 2, 3, 4, 5, 6, 7
    HEADER = 6  # op, value, token count, rows' shape (2) and dtype code
    # a window's tokens ride in the header up to this many (verification windows are <= 14
    # drafts + 1): one broadcast per call instead of two; longer lists follow in a second one
    INLINE_TOKENS = 16

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    @property
    def leader(self) -> bool:
        return self.comm.rank == 0

    def send(self, op: int, value: int, tokens: Sequence[int] = (), rows: torch.Tensor | None = None) -> None:
        shape = (0, 0, 0) if rows is None else (int(rows.shape[0]), int(rows.shape[1]), _DTYPE_CODES[rows.dtype])
        tokens = [int(t) for t in tokens]
        inline = tokens[:self.INLINE_TOKENS]
        header = torch.tensor([op, value, len(tokens), *shape, *inline, *[0] * (self.INLINE_TOKENS - len(inline))],
                              dtype=torch.int64, device=self.comm.device)
        self.comm.broadcast(header, name="draft_window")
        if len(tokens) > self.INLINE_TOKENS:
            self.comm.broadcast(torch.tensor(tokens[self.INLINE_TOKENS:], dtype=torch.int64, device=self.comm.device),
                                name="draft_window_tokens")
        if rows is not None:
            self.comm.broadcast(rows.detach().to(device=self.comm.device, dtype=torch.float32).contiguous(),
                                name="draft_window_rows")

    def receive(self) -> tuple[int, int, list[int], torch.Tensor | None]:
        header = self.comm.broadcast(torch.zeros(self.HEADER + self.INLINE_TOKENS, dtype=torch.int64,
                                                 device=self.comm.device), name="draft_window").tolist()
        op, value, n, r, c, code = header[:self.HEADER]
        tokens = header[self.HEADER:self.HEADER + min(n, self.INLINE_TOKENS)]
        if n > self.INLINE_TOKENS:
            t = self.comm.broadcast(torch.zeros(n - self.INLINE_TOKENS, dtype=torch.int64, device=self.comm.device),
                                    name="draft_window_tokens")
            tokens += t.tolist()
        rows = None
        if code:
            rows = self.comm.broadcast(torch.zeros(r, c, dtype=torch.float32, device=self.comm.device),
                                       name="draft_window_rows").to(_DTYPES[code])
        return op, value, tokens, rows

    def lead(self, target: object) -> "LeadingTarget":
        return LeadingTarget(target, self)

    def follow_windows(self, target: object) -> None:
        """Run rank 0's calls on this rank's `target` (a glm53.runtime.engine.Glm53Target) until END. The MTP
        layer's cache of this request is created at its first call (a fresh one per request, as on
        rank 0)."""
        mtp: Glm53MtpAdapter | None = None
        while True:
            op, value, tokens, rows = self.receive()
            if op == self.FORWARD:
                target.forward(tokens, value)   # taps need no collective: rank 0 alone keeps them
            elif op == self.TRUNCATE:
                target.truncate(value)
            elif op in (self.MTP_FORWARD, self.MTP_TRUNCATE):
                if mtp is None:
                    mtp = Glm53MtpAdapter(target.engine.model, getattr(target.engine, "kv_dtype", "bf16"))
                if op == self.MTP_FORWARD:
                    mtp.forward(rows, tokens, value)
                else:
                    mtp.truncate(value)
            elif op == self.EMBED:
                target.embed(torch.tensor(tokens, dtype=torch.long))
            elif op == self.HEAD:
                target.lm_head(rows)
            elif op == self.END:
                target.truncate(min(value, target.length()))
                return
            else:
                raise RuntimeError(f"glm53.dist: rank {self.comm.rank}: unknown draft-window op {op} from rank 0")


class LeadingTarget:
    """Rank 0's Target: each forward, truncation and borrowed embedding / head call is announced to
    the followers first. DFlash2 (drafter.sources.dflash2) runs its own small model on rank 0 alone,
    on the taps of rank 0's forwards (layer outputs after TP's reductions: the same on every rank)."""

    def __init__(self, target: object, channel: WindowChannel) -> None:
        self.target, self.channel = target, channel
        self.vocab_size = target.vocab_size

    def length(self) -> int:
        return self.target.length()

    def canonical_frontier(self) -> int:
        return self.target.canonical_frontier()

    def forward(self, tokens, start: int, *, taps=()):
        self.channel.send(WindowChannel.FORWARD, start, list(tokens))
        return self.target.forward(tokens, start, taps=taps)

    def truncate(self, length: int) -> None:
        self.channel.send(WindowChannel.TRUNCATE, length)
        self.target.truncate(length)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        self.channel.send(WindowChannel.EMBED, 0, [int(t) for t in token_ids.reshape(-1).tolist()])
        return self.target.embed(token_ids)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        self.channel.send(WindowChannel.HEAD, 0, rows=hidden)
        return self.target.lm_head(hidden)

    def lead_mtp(self, adapter: object) -> "LeadingMtpAdapter":
        """Rank 0's MTP adapter: each call is replayed on every rank's own MTP cache."""
        return LeadingMtpAdapter(adapter, self.channel)

    def end(self) -> None:
        """The request is over on rank 0: the followers keep the same rows."""
        self.channel.send(WindowChannel.END, self.target.length())


class LeadingMtpAdapter:
    """drafter.sources.mtp.MtpAdapter on rank 0 over R ranks: MTP_FORWARD / MTP_TRUNCATE first."""

    def __init__(self, adapter: object, channel: WindowChannel) -> None:
        self.adapter, self.channel = adapter, channel

    @property
    def state(self) -> object:
        return self.adapter.state

    def forward(self, hidden: torch.Tensor, tokens: Sequence[int], start: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.channel.send(WindowChannel.MTP_FORWARD, start, list(tokens), rows=hidden)
        return self.adapter.forward(hidden, tokens, start)

    def truncate(self, length: int) -> None:
        self.channel.send(WindowChannel.MTP_TRUNCATE, length)
        self.adapter.truncate(length)
