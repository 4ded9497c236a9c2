"""A small, real, exactly reproducible language model for testing and benchmarking the drafter.

A causal transformer in integer arithmetic (int64 weights and activations, integer attention
weights, floor division for the attention average), with a real KV cache that supports
truncation. Integer sums are associative, so a window of k rows computes exactly what k serial
single-row forwards compute: "drafted == serial" can then be asserted bit for bit and any
mismatch is the drafter's fault, never floating-point batch variance. (Batch invariance of the
real engine is the engine's contract and is tested against it separately.)

Also provides: per-layer hidden states (taps) for DFlash2, a tiny MTP head (the `MtpAdapter`
contract), and the embedding / LM head in float for drafters that share them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .target import WindowOutput

CLAMP = 1 << 12


@dataclass(frozen=True)
class ReferenceLMConfig:
    vocab_size: int = 96
    dim: int = 32
    layers: int = 2
    logit_shift: int = 9        # logits = int logits / 2**logit_shift (sets the sampling temperature scale)
    seed: int = 0


class ReferenceLM:
    """Weights; call `.session()` for a per-request target with its own cache."""

    def __init__(self, config: ReferenceLMConfig = ReferenceLMConfig()) -> None:
        self.config = c = config
        g = torch.Generator().manual_seed(c.seed)

        def ints(*shape: int, lo: int = -2, hi: int = 2) -> torch.Tensor:
            return torch.randint(lo, hi + 1, shape, generator=g, dtype=torch.int64)

        self.embedding = ints(c.vocab_size, c.dim, lo=-64, hi=64)
        self.pos_mult = ints(c.dim, lo=1, hi=13)
        self.layers = [dict(q=ints(c.dim, c.dim), k=ints(c.dim, c.dim), v=ints(c.dim, c.dim),
                            o=ints(c.dim, c.dim), up=ints(c.dim, 2 * c.dim), down=ints(2 * c.dim, c.dim))
                       for _ in range(c.layers)]
        self.head = ints(c.dim, c.vocab_size, lo=-3, hi=3)
        # tiny MTP head: hidden' = clamp((hidden @ A + emb(token) @ B) >> 2); logits from hidden'
        self.mtp_a = ints(c.dim, c.dim)
        self.mtp_b = ints(c.dim, c.dim)

    def session(self) -> "ReferenceSession":
        return ReferenceSession(self)

    # --- shared pieces ---

    def positional(self, positions: torch.Tensor) -> torch.Tensor:
        return (positions[:, None] * self.pos_mult[None, :]) % 33 - 16

    def logits_of(self, hidden_int: torch.Tensor) -> torch.Tensor:
        return (hidden_int @ self.head).to(torch.float64).div(2 ** self.config.logit_shift).to(torch.float32)

    # float views for drafters that share the embedding and the head (TargetHeads)
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embedding[token_ids.long()].float()

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden.float() @ self.head.float()) / 2 ** self.config.logit_shift


class ReferenceSession:
    """One request's view of the ReferenceLM: a Target with a truncatable KV cache."""

    def __init__(self, model: ReferenceLM, *, frontier: int = 0) -> None:
        self.model = model
        self.vocab_size = model.config.vocab_size
        c = model.config
        self.keys = [torch.zeros(0, c.dim, dtype=torch.int64) for _ in range(c.layers)]
        self.values = [torch.zeros(0, c.dim, dtype=torch.int64) for _ in range(c.layers)]
        self.frontier = frontier
        self.forward_calls = 0
        self.rows_forwarded = 0

    def length(self) -> int:
        return int(self.keys[0].shape[0])

    def canonical_frontier(self) -> int:
        return self.frontier

    def set_frontier(self, frontier: int) -> None:
        self.frontier = frontier

    def truncate(self, length: int) -> None:
        if length < 0 or length > self.length():
            raise ValueError(f"truncate({length}) outside the cache's {self.length()} rows")
        self.keys = [k[:length] for k in self.keys]
        self.values = [v[:length] for v in self.values]

    def cache_rows(self) -> torch.Tensor:
        """Every cached row, [layers, 2, length, dim] (for exactness checks)."""
        return torch.stack([torch.stack([k, v]) for k, v in zip(self.keys, self.values)])

    def forward(self, tokens: Sequence[int], start: int, *, taps: Sequence[int] = ()) -> WindowOutput:
        if start != self.length():
            raise ValueError(f"window starts at {start} but the cache holds {self.length()} rows")
        m = self.model
        ids = torch.tensor(list(tokens), dtype=torch.int64)
        n = ids.shape[0]
        positions = torch.arange(start, start + n)
        x = m.embedding[ids] + m.positional(positions)
        tap_out: dict[int, torch.Tensor] = {}
        causal = positions[:, None] >= torch.arange(start + n)[None, :]
        for li, w in enumerate(m.layers):
            q = ((x @ w["q"]) >> 4).clamp(-CLAMP, CLAMP)
            k = ((x @ w["k"]) >> 4).clamp(-CLAMP, CLAMP)
            v = ((x @ w["v"]) >> 4).clamp(-CLAMP, CLAMP)
            self.keys[li] = torch.cat([self.keys[li], k])
            self.values[li] = torch.cat([self.values[li], v])
            scores = ((q @ self.keys[li].T) >> 10).clamp(0, 1 << 12) + 1        # integer attention weights
            scores = scores * causal
            attn = (scores @ self.values[li]).div(scores.sum(-1, keepdim=True), rounding_mode="floor")
            x = (x + ((attn @ w["o"]) >> 3)).clamp(-CLAMP, CLAMP)
            h = ((x @ w["up"]) >> 4).clamp(0, CLAMP)
            x = (x + ((h @ w["down"]) >> 5)).clamp(-CLAMP, CLAMP)
            if li in taps:
                tap_out[li] = x.float()
        unknown = set(taps) - set(range(len(m.layers)))
        if unknown:
            raise ValueError(f"taps {sorted(unknown)} are not layers of this model (0..{len(m.layers) - 1})")
        self.forward_calls += 1
        self.rows_forwarded += n
        return WindowOutput(start=start, logits=m.logits_of(x), hidden=x.float(), taps=tap_out)

    def mtp(self) -> "ReferenceMtp":
        return ReferenceMtp(self.model)


class ReferenceMtp:
    """The reference LM's tiny MTP head (no cache of its own, so truncate has nothing to drop)."""

    def __init__(self, model: ReferenceLM) -> None:
        self.model = model
        self.calls = 0

    def forward(self, hidden: torch.Tensor, tokens: Sequence[int], start: int) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.model
        h = hidden.round().to(torch.int64)
        e = m.embedding[torch.tensor(list(tokens), dtype=torch.int64)]
        out = (((h @ m.mtp_a) + (e @ m.mtp_b)) >> 2).clamp(-CLAMP, CLAMP)
        self.calls += 1
        return m.logits_of(out), out.float()

    def truncate(self, length: int) -> None:
        pass
