"""A deterministic EXL3 encoder, good enough for tests (not optimal; exllamav3's own is for real packs).

Scheme: random +-1 sign vectors from `seed`; the target is rotated into the Hadamard basis
(W_hat = H . diag(su)^-1 . W . diag(sv)^-1 . H, in fp64 with fixed butterflies so the result is the
same on every machine) and scaled by one global factor g to the codebook's spread (g goes into
suh). Each 16x16 tile is then coded by a greedy walk along the bitshift trellis: at each stream
position pick the K new bits whose codebook value is nearest the target. The stream is cyclic,
so a short first pass fixes the last 16 bits and a second pass starts from them; the positions
that own those bits keep the first pass' choice. Any bit stream is a valid EXL3 tile; greedy only
costs accuracy (relative RMS error about 0.55 at K=2, 0.17 at K=4; see tests).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .decode import HAD_DIM, TENSOR_CORE_PERM, codebook_table, fwht, position_bits, single_threaded
from .format import CODEBOOK_MULTIPLIERS, CODEBOOKS, SERVED_BITS, Exl3Error

_MARKER_DTYPE = torch.int32  # safetensors has no uint32; exllamav3 stores the multiplier viewed as int32


def codebook_marker(codebook: str) -> dict[str, torch.Tensor]:
    """The scalar marker stored next to the trellis ({} for 3inst)."""
    if codebook == "3inst":
        return {}
    value = CODEBOOK_MULTIPLIERS[codebook]
    signed = value - (1 << 32) if value >= 1 << 31 else value
    return {codebook: torch.tensor(signed, dtype=_MARKER_DTYPE)}


def _check(weight: torch.Tensor, bits: float, codebook: str) -> None:
    if codebook not in CODEBOOKS:
        raise Exl3Error(f"encode: unknown codebook {codebook!r}; known are {', '.join(CODEBOOKS)}")
    if float(bits) not in SERVED_BITS:
        raise Exl3Error(f"encode: K = {bits} not served; use one of {SERVED_BITS}")
    if not float(bits).is_integer() and codebook != "mul1":
        raise Exl3Error(f"encode: half-integer K = {bits} requires the mul1 codebook")
    if weight.dim() != 2 or weight.shape[0] % HAD_DIM or weight.shape[1] % HAD_DIM:
        raise Exl3Error(f"encode: weight shape {tuple(weight.shape)} must be 2-D [in, out], both multiples of {HAD_DIM}")


def _greedy(targets: torch.Tensor, bits: float, table: torch.Tensor) -> torch.Tensor:
    """targets fp32 [T, 256] in stream order -> int64 [T, 256] new bits per position."""
    steps = position_bits(bits)
    n_tiles = targets.shape[0]

    cands = {b: torch.arange(1 << b, dtype=torch.int64) for b in set(steps)}

    def walk(state: torch.Tensor, start: int, forced: torch.Tensor | None, first_forced: int) -> tuple[torch.Tensor, torch.Tensor]:
        chosen = torch.zeros((n_tiles, 256), dtype=torch.int64)
        for p in range(start, 256):
            b = steps[p]
            base = (state << b) & 0xFFFF
            if forced is not None and p >= first_forced:
                new = forced[:, p]
            else:
                err = (table[base.unsqueeze(1) | cands[b]] - targets[:, p : p + 1]).abs()
                new = torch.argmin(err, dim=1)
            chosen[:, p] = new
            state = base | new
        return chosen, state

    # positions whose bits make up the stream's last 16 bits (the wrap-around context)
    first_forced, covered = 256, 0
    while covered < 16:
        first_forced -= 1
        covered += steps[first_forced]
    # pass 1 picks those tail bits greedily after a 16-position warm-up from state 0 ...
    tail, final_state = walk(torch.zeros(n_tiles, dtype=torch.int64), first_forced - 16, None, 256)
    # ... pass 2 walks the whole tile from that context, keeping the tail bits so the wrap is consistent
    second, _ = walk(final_state, 0, tail, first_forced)
    return second


def _pack(chosen: torch.Tensor, bits: float) -> torch.Tensor:
    """int64 [T, 256] new bits per position -> int16 [T, 16*K] (32-bit words MSB first, low half first)."""
    steps = position_bits(bits)
    columns = []
    for p, b in enumerate(steps):
        for j in range(b - 1, -1, -1):
            columns.append((chosen[:, p] >> j) & 1)
    stream = torch.stack(columns, dim=1)  # [T, 256*K] bits, first bit first
    n_words = stream.shape[1] // 32
    weights = (1 << torch.arange(31, -1, -1, dtype=torch.int64))
    words = (stream.view(-1, n_words, 32) * weights).sum(-1)  # uint32 values
    halves = torch.stack((words & 0xFFFF, words >> 16), dim=-1).view(-1, 2 * n_words)
    return halves.to(torch.int32).to(torch.int16)  # wraps to the same 16 bits


def encode_weights(
    weights: Sequence[torch.Tensor], bits: float, codebook: str, *, seed: int = 0
) -> list[dict[str, torch.Tensor]]:
    """Encode several [in, out] weights at one K and codebook together (one greedy walk for all tiles).

    Weight i uses sign vectors drawn from seed + i. Returns, per weight, the group's tensors
    without prefix: trellis, suh, svh and the codebook marker.
    """
    with single_threaded():
        return _encode_weights(weights, bits, codebook, seed)


def _encode_weights(weights: Sequence[torch.Tensor], bits: float, codebook: str, seed: int) -> list[dict[str, torch.Tensor]]:
    for w in weights:
        _check(w, bits, codebook)
    table = codebook_table(codebook).float()
    cb_rms = float(table.double().square().mean().sqrt())
    perm = torch.tensor(TENSOR_CORE_PERM, dtype=torch.int64)
    targets, metas = [], []
    for i, w in enumerate(weights):
        n_in, n_out = w.shape
        gen = torch.Generator().manual_seed(seed + i)
        su = torch.randint(0, 2, (n_in,), generator=gen).double() * 2 - 1
        sv = torch.randint(0, 2, (n_out,), generator=gen).double() * 2 - 1
        rot = fwht(fwht(w.double() * su[:, None] * sv[None, :], 0), 1) / HAD_DIM
        rms = float(rot.square().mean().sqrt())
        g = torch.tensor(max(rms, 1e-8) / cb_rms, dtype=torch.float16)
        w_hat = rot / float(g)
        tiles = w_hat.view(n_in // 16, 16, n_out // 16, 16).permute(0, 2, 1, 3).reshape(-1, 256)
        targets.append(tiles[:, perm].float())
        metas.append((n_in, n_out, (su * float(g)).half(), sv.half()))
    chosen = _greedy(torch.cat(targets), float(bits), table)
    packed = _pack(chosen, float(bits))
    out, start = [], 0
    for (n_in, n_out, suh, svh) in metas:
        count = (n_in // 16) * (n_out // 16)
        trellis = packed[start : start + count].view(n_in // 16, n_out // 16, -1).contiguous()
        start += count
        out.append({"trellis": trellis, "suh": suh, "svh": svh, **codebook_marker(codebook)})
    return out


def encode_weight(weight_in_out: torch.Tensor, bits: float, codebook: str, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """Encode one [in, out] weight (y = x @ W) as an EXL3 group's tensors (keys without prefix)."""
    return encode_weights([weight_in_out], bits, codebook, seed=seed)[0]
