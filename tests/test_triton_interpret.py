"""The Triton kernels (glm53/ops/triton_*.py) on the CPU, through Triton's interpreter (TRITON_INTERPRET=1).

TRITON_INTERPRET must be set before triton is imported, so the checks run in subprocesses: this
file run as a script (`python tests/test_triton_interpret.py --worker [CHECK ...]`) executes the named
checks (default all) and prints a JSON verdict per check; the fixture runs two such workers side by
side (WORKER_SPLIT) and the tests below assert the verdicts one by one. Inputs are fp32 (the
interpreter of triton 3.9 with numpy 2.4 mis-loads bf16), shapes small and chosen to hit the masks:
dims that are not powers of two, row counts that are not multiples of the tile, a non-contiguous
head_linear input, invalid slots, an all-invalid query, an empty selection. The indexer's selection
kernel (triton_topk) is checked exactly against the CPU rule.

Agreement with glm53.ops.torch_ops: within INTERP_TOL (fp32; the kernels sum in another order).
Row invariance (bitwise): slices of a big call equal the same rows computed alone or in smaller
calls; index_scores also over a key prefix; latent_attention also with invalid slots appended to
the selection, and its short-window (split) kernels against torch and the prefill kernel. The
interpreter's tl.dot is numpy's matmul, whose bits for a row depend on the row's position inside
the block (OpenBLAS micro-kernels), so the matrix-product slices here start on a tile boundary;
tests/gpu/test_triton_cuda.py checks arbitrary offsets on the real kernels.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
INTERP_TOL = dict(atol=1e-4, rtol=1e-4)
CHECKS = ["linear", "linear_row_tiles_check", "grouped_expert_linear", "linear_leading_dims", "head_linear_strided",
          "rms_norm", "layer_norm", "index_scores", "index_scores_causal", "index_scores_spans",
          "latent_attention", "latent_attention_edge_cases", "latent_attention_split", "latent_attention_prefix",
          "select_topk", "select_bracket", "exl3_decoder", "exl3_linear", "exl3_mlp", "exl3_cuda_finish"]
WORKER_TIMEOUT_S = 300
SKIP_KEY = "__skip__"


# ------------------------------------------------------------------------------- worker (subprocess)

def _worker(names: list[str]) -> dict[str, list]:
    import warnings

    warnings.filterwarnings("ignore", category=RuntimeWarning)  # numpy's -inf - -inf inside tl.where
    sys.path.insert(0, str(REPO))
    try:
        import triton  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means: no interpreter here
        return {SKIP_KEY: [False, f"triton is not importable: {type(exc).__name__}: {exc}"]}
    import torch

    from glm53.model.indexer import select_topk
    from glm53.ops import (exl3_torch, torch_ops, triton_attention, triton_exl3, triton_indexer, triton_linear,
                           triton_norm, triton_topk)

    g = torch.Generator().manual_seed(0)

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
        torch.testing.assert_close(got, ref, **INTERP_TOL, msg=lambda m: f"{what}: {m}")

    def same(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
        assert got.shape == ref.shape and torch.equal(got, ref), \
            f"{what}: not bitwise equal (max |diff| {float((got - ref).abs().max()) if got.numel() else 0})"

    # the interpreter's tl.dot is numpy's matmul, whose bits depend on a row's position inside the
    # block (OpenBLAS micro-kernels): slices of the matrix-product ops start on a tile boundary (the
    # fp32 tile is 32 rows) and vary in length, in grid position and in what follows them
    tile = 32
    slices = [(0, 1), (0, 7), (0, 31), (0, 33), (tile, 1), (tile, 13), (tile, 7)]

    @contextmanager
    def one_tile_config():
        """One tile config for every row count (CONFIG_BY_ROWS False): the interpreter's numpy dots
        differ in bits between tile shapes, where the GPU's do not (a property of the compiled code,
        tests/gpu/test_triton_cuda.py); the kernel's own row invariance is checked under it here."""
        saved = triton_linear.CONFIG_BY_ROWS
        triton_linear.CONFIG_BY_ROWS = False
        try:
            yield
        finally:
            triton_linear.CONFIG_BY_ROWS = saved

    def check_linear() -> None:
        x, w = randn(45, 70, std=70 ** -0.5), randn(50, 70)  # M, N, K not multiples of the 32 tile
        big = triton_linear.linear(x, w)
        close(big, torch_ops.linear(x, w), "linear vs torch")
        for s, n in slices:
            close(triton_linear.linear(x[s:s + n], w), big[s:s + n], f"linear rows [{s}, {s + n}), by-rows tiles")
        with one_tile_config():
            big = triton_linear.linear(x, w)
            for s, n in slices:
                same(triton_linear.linear(x[s:s + n], w), big[s:s + n], f"linear rows [{s}, {s + n})")

    def check_linear_row_tiles_check() -> None:
        """The device check of the row-count tiles (triton_linear.row_tiles_agree), run here where
        they differ: the interpreter's numpy dots give other bits per tile shape. It must say so,
        and with that recorded every row count runs the prefill tile (expert_linear's kernel too):
        slices equal the big call bit for bit, by-rows left on."""
        assert triton_linear.CONFIG_BY_ROWS
        x, w = randn(45, 70, std=70 ** -0.5), randn(50, 70)
        assert triton_linear._row_tiles_check("linear", w, torch.float32) is False
        key = triton_linear._agree_key("linear", w, torch.float32)
        triton_linear._AGREE[key] = False
        try:
            big = triton_linear.linear(x, w)
            for s, n in slices:
                same(triton_linear.linear(x[s:s + n], w), big[s:s + n], f"linear rows [{s}, {s + n}), prefill tile")
            # expert_linear: the prefill tile too, one row a program. Its rows against linear's are not
            # compared bit for bit here: numpy's BLAS gives a row's product bits by its place in the
            # tile on some hosts (OpenBLAS on an AMD EPYC: rows 6-11 and 18-31 of a 32-row tile
            # differ from row 0's); on CUDA tests/gpu/test_graph_replays_cuda.py compares them
            ids = torch.zeros(45, dtype=torch.int64)
            tiles = []
            rows_of = triton_linear._expert_rows
            triton_linear._expert_rows = lambda *a: (tiles.append(a[-1]), rows_of(*a))[1]
            try:
                whole = triton_linear.expert_linear(x, w[None], ids)
            finally:
                triton_linear._expert_rows = rows_of
            assert tiles == [triton_linear.linear_config(triton_linear.PREFILL_ROWS, 50, 70, torch.float32)], tiles
            close(whole, big, "expert_linear rows vs linear, prefill tile")
            for s, n in slices:
                same(triton_linear.expert_linear(x[s:s + n], w[None], ids[s:s + n]), whole[s:s + n],
                     f"expert_linear rows [{s}, {s + n}), prefill tile")
        finally:
            del triton_linear._AGREE[key]
        # head_linear in fp32 has one tile for every row count: nothing can differ
        assert triton_linear._row_tiles_check("head", randn(3, 20, 70), torch.float32) is True

    def check_grouped_expert_linear() -> None:
        """Every expert's run of rows in one launch (MoE prefill on CUDA): the tile table, each run
        bitwise against linear over that run (one tile config, runs start on a tile as linear's rows
        do), the device check saying so, and DecodedExperts' sorted form against its per-expert loop."""
        from glm53 import ops
        from glm53.model.moe import DecodedExperts

        counts = torch.tensor([0, 1, 33, 0, 70, 32])  # empty, one row, a tile and one, 2 tiles and a part
        expert, first, rows = triton_linear._tile_table(counts, 32, 136 // 32 + 1 + 6)
        real = rows > 0
        assert expert[real].tolist() == [1, 2, 2, 4, 4, 4, 5], expert.tolist()
        assert first[real].tolist() == [0, 1, 33, 34, 66, 98, 104], first.tolist()
        assert rows[real].tolist() == [1, 32, 1, 32, 32, 6, 32] and int(rows.sum()) == 136, rows.tolist()
        x, w = randn(136, 70, std=70 ** -0.5), randn(6, 50, 70)
        with one_tile_config():
            got = triton_linear.grouped_expert_linear(x, w, counts)
            begin = 0
            for e, c in enumerate(counts.tolist()):
                same(got[begin:begin + c], triton_linear.linear(x[begin:begin + c], w[e]), f"expert {e}'s run")
                begin += c
            assert triton_linear.grouped_agrees(w)
            # the sorted form against the loop over experts, both through this interpreter's kernels
            bank = DecodedExperts(randn(6, 2 * 24, 70), randn(6, 70, 24))
            tokens = randn(40, 70, std=70 ** -0.5)
            ids = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(40)])
            weights = torch.rand(40, 3, generator=g)
            real_linear = ops.linear
            ops.linear = triton_linear.linear
            try:
                loop = bank.by_expert(tokens, ids, weights)
            finally:
                ops.linear = real_linear
            same(bank.runs(tokens, ids, weights), loop, "DecodedExperts.runs vs the per-expert loop")
        close(got, torch.cat([x[a:b] @ w[e].T for e, (a, b) in enumerate(zip(
            [0, 0, 1, 34, 34, 104], [0, 1, 34, 34, 104, 136])) if b > a]), "grouped vs torch")

    def check_linear_leading_dims() -> None:
        x, w = randn(3, 15, 40), randn(33, 40)
        out = triton_linear.linear(x, w)
        assert out.shape == (3, 15, 33)
        close(out, torch_ops.linear(x, w), "linear [3, 15, K]")
        with one_tile_config():
            same(triton_linear.linear(x[:1], w), triton_linear.linear(x, w)[:1], "linear x[:1] vs x")
        assert triton_linear.linear(x[:0], w).shape == (0, 15, 33)

    def check_head_linear_strided() -> None:
        q = randn(37, 3, 40)
        x, w = q[..., :24], randn(3, 20, 24)  # a q[..., :nope] view: strides (120, 40, 1)
        assert not x.is_contiguous()
        big = triton_linear.head_linear(x, w)
        close(big, torch_ops.head_linear(x, w), "head_linear vs torch")
        close(big, torch.einsum("thk,hnk->thn", x, w), "head_linear vs einsum")
        for s, n in slices[:-1]:
            same(triton_linear.head_linear(x[s:s + n], w), big[s:s + n], f"head_linear rows [{s}, {s + n})")

    def check_rms_norm() -> None:
        x, w = randn(45, 100, std=3.0), randn(100)
        big = triton_norm.rms_norm(x, w, 1e-6)
        close(big, torch_ops.rms_norm(x, w, 1e-6), "rms_norm vs torch")
        for s, n in slices + [(3, 7), (44, 1)]:  # one program per row: any offset
            same(triton_norm.rms_norm(x[s:s + n], w, 1e-6), big[s:s + n], f"rms_norm rows [{s}, {s + n})")
        x3 = randn(2, 5, 24)  # leading dims flattened
        close(triton_norm.rms_norm(x3, w[:24], 1e-5), torch_ops.rms_norm(x3, w[:24], 1e-5), "rms_norm [2, 5, 24]")

    def check_layer_norm() -> None:
        x, w, b = randn(45, 100, std=3.0) + 1.5, randn(100), randn(100)
        big = triton_norm.layer_norm(x, w, b, 1e-5)
        close(big, torch_ops.layer_norm(x, w, b, 1e-5), "layer_norm vs torch")
        for s, n in slices + [(3, 7), (44, 1)]:
            same(triton_norm.layer_norm(x[s:s + n], w, b, 1e-5), big[s:s + n], f"layer_norm rows [{s}, {s + n})")

    def check_index_scores() -> None:
        t, h, d, n = 45, 3, 24, 70  # D 24 pads to 32; T, N not multiples of the 32 tile
        q, hw, keys = randn(t, h, d), randn(t, h), randn(n, d)
        big = triton_indexer.index_scores(q, hw, keys, 0.3)
        assert big.dtype == torch.float32 and big.shape == (t, n)
        close(big, torch_ops.index_scores(q, hw, keys, 0.3), "index_scores vs torch")
        for s, c in slices:
            same(triton_indexer.index_scores(q[s:s + c], hw[s:s + c], keys, 0.3), big[s:s + c],
                 f"index_scores queries [{s}, {s + c})")
        for prefix in (1, 5, 32, 33, 69):
            same(triton_indexer.index_scores(q, hw, keys[:prefix], 0.3), big[:, :prefix],
                 f"index_scores keys[:{prefix}]")
        same(triton_indexer.index_scores(q[32:33], hw[32:33], keys[:3], 0.3), big[32:33, :3], "one query, 3 keys")
        # a NaN key: NaN in its column as torch.relu gives it (the selection's NaN check sees it),
        # masked to -inf where the key lies in the query's future; the other columns keep their bits
        keys[9, 4] = float("nan")
        nan_scores = triton_indexer.index_scores(q, hw, keys, 0.3, torch.arange(t), None)
        assert nan_scores[9:, 9].isnan().all() and (nan_scores[:9, 9] == float("-inf")).all(), "NaN key"
        others = torch.cat([torch.arange(9), torch.arange(10, n)])
        same(nan_scores[:, others], big.masked_fill(torch.arange(n)[None, :] > torch.arange(t)[:, None],
                                                    float("-inf"))[:, others], "columns beside a NaN key")

    def check_index_scores_causal() -> None:
        # the mask in the kernel, and tiles wholly in the future skipped: the other scores keep their bits
        t, h, d, n = 45, 3, 24, 140
        q, hw, keys = randn(t, h, d), randn(t, h), randn(n, d)
        plain = triton_indexer.index_scores(q, hw, keys, 0.3)
        for qpos, kpos in ((torch.arange(60, 60 + t), None),  # a prefill piece after 60 positions
                           (torch.arange(t), None),  # the first piece: most tiles above the diagonal
                           (torch.arange(100, 100 + t), torch.arange(2, 4 * n, 4)),  # a DCP rank's positions
                           (torch.arange(t).flip(0), torch.arange(n).flip(0))):  # not ascending
            got = triton_indexer.index_scores(q, hw, keys, 0.3, qpos, kpos)
            kp = torch.arange(n) if kpos is None else kpos
            want = plain.masked_fill(kp[None, :] > qpos[:, None], float("-inf"))
            same(got, want, f"index_scores causal (queries from {int(qpos[0])}, keys {kpos is not None})")
        # a paged cache's keys read in place: key n is row key_rows[n] of a larger store, pages out of order
        store = randn(3 * n, d)
        key_rows = torch.randperm(3 * n, generator=g)[:n]
        store[key_rows] = keys
        qpos = torch.arange(60, 60 + t)
        same(triton_indexer.index_scores(q, hw, store, 0.3, qpos, None, key_rows),
             triton_indexer.index_scores(q, hw, keys, 0.3, qpos, None), "index_scores through key_rows")
        try:
            triton_indexer.index_scores(q, hw, keys, 0.3, None, torch.arange(n))
        except ValueError as exc:
            assert "key_positions given without q_positions" in str(exc)
        else:
            raise AssertionError("key_positions without q_positions accepted")

    def check_index_scores_spans() -> None:
        # several windows in one launch, each over its own keys (a table of store rows, the shorter
        # contexts padded): every row the bits of its window alone over its own keys, -inf past them
        h, d = 3, 24
        store = randn(300, d)
        for per, contexts in ((1, (70, 33, 45)), (5, (40, 61)), (33, (90, 70))):  # 33: two row tiles a window
            b, longest = len(contexts), max(contexts)
            q, hw = randn(b * per, h, d), randn(b * per, h)
            table = torch.zeros(b, longest, dtype=torch.long)
            qpos = torch.cat([torch.arange(n - per, n) for n in contexts])
            for i, n in enumerate(contexts):
                table[i, :n] = torch.randperm(300, generator=g)[:n]
            got = triton_indexer.index_scores_spans(q, hw, store, 0.3, qpos, table)
            for i, n in enumerate(contexts):
                rows = slice(i * per, (i + 1) * per)
                alone = triton_indexer.index_scores(q[rows], hw[rows], store, 0.3, qpos[rows], None, table[i, :n])
                same(got[rows, :n], alone, f"index_scores_spans window {i} of {b} ({per} rows, {n} keys)")
                assert (got[rows, n:] == float("-inf")).all(), f"window {i}: keys past its own not -inf"
            # a DCP rank's keys (rank 1 of 3: position 3n + 1), its windows' queries at their own positions
            kpos = torch.arange(longest) * 3 + 1
            qpos3 = torch.cat([torch.arange(3 * n - per, 3 * n) for n in contexts])
            got = triton_indexer.index_scores_spans(q, hw, store, 0.3, qpos3, table, kpos)
            for i, n in enumerate(contexts):
                rows = slice(i * per, (i + 1) * per)
                alone = triton_indexer.index_scores(q[rows], hw[rows], store, 0.3, qpos3[rows], kpos[:n], table[i, :n])
                same(got[rows, :n], alone, f"index_scores_spans window {i} at a DCP rank's positions")
                assert (got[rows, n:] == float("-inf")).all(), f"window {i}: a DCP rank's keys past its own not -inf"

    def selection(t: int, n_rows: int, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(0, n_rows, (t, slots), generator=g)
        valid = torch.rand(t, slots, generator=g) < 0.6
        valid[2] = False  # no valid slot
        valid[4, 1:] = False  # one valid slot
        return torch.where(valid, idx, torch.full_like(idx, -1)), valid  # invalid slots point nowhere

    def check_latent_attention() -> None:
        t, h, d, dv, n_rows, slots = 9, 4, 80, 64, 30, 40  # the tiny model's D = 64 + 16; 40 slots: 2.5 blocks
        q, rows = randn(t, h, d), randn(n_rows, d)
        idx, valid = selection(t, n_rows, slots)
        out, lse = triton_attention.latent_attention(q, rows, idx, valid, d ** -0.5, dv)
        ref_out, ref_lse = torch_ops.latent_attention(q, rows, idx.clamp(min=0), valid, d ** -0.5, dv)
        close(out, ref_out, "latent_attention out vs torch")
        close(lse, ref_lse, "latent_attention lse vs torch")
        assert not out.isnan().any() and not lse.isnan().any(), "NaN"
        assert torch.equal(out[2], torch.zeros_like(out[2])) and bool((lse[2] == float("-inf")).all())
        for s, c in [(0, 1), (2, 1), (8, 1), (1, 5), (3, 6)]:
            o, e = triton_attention.latent_attention(q[s:s + c], rows, idx[s:s + c], valid[s:s + c], d ** -0.5, dv)
            same(o, out[s:s + c], f"latent_attention out queries [{s}, {s + c})")
            same(e, lse[s:s + c], f"latent_attention lse queries [{s}, {s + c})")
        pad = 25  # invalid slots appended: whole extra blocks and a partial one
        idx_w = torch.cat([idx, torch.full((t, pad), -1, dtype=idx.dtype)], 1)
        valid_w = torch.cat([valid, torch.zeros(t, pad, dtype=torch.bool)], 1)
        o, e = triton_attention.latent_attention(q, rows, idx_w, valid_w, d ** -0.5, dv)
        same(o, out, "latent_attention with trailing invalid slots (out)")
        same(e, lse, "latent_attention with trailing invalid slots (lse)")

    def check_latent_attention_edge_cases() -> None:
        q, rows = randn(3, 2, 80), randn(5, 80)
        idx = torch.zeros(3, 20, dtype=torch.int64)
        out, lse = triton_attention.latent_attention(q, rows, idx, torch.zeros(3, 20, dtype=torch.bool), 0.1, 64)
        assert torch.equal(out, torch.zeros(3, 2, 64)) and bool((lse == float("-inf")).all()), "all invalid"
        out, lse = triton_attention.latent_attention(q, rows, idx[:, :0], torch.zeros(3, 0, dtype=torch.bool), 0.1, 64)
        assert out.shape == (3, 2, 64) and not out.any() and bool((lse == float("-inf")).all()), "k = 0"
        valid = torch.zeros(3, 20, dtype=torch.bool)
        valid[1, 17] = True  # one valid slot, in the last block
        idx[1, 17] = 4
        out, lse = triton_attention.latent_attention(q, rows, idx, valid, 0.1, 64)
        close(out[1], rows[4, :64].expand(2, 64), "single valid slot -> its value row")
        close(lse[1], 0.1 * (q[1] @ rows[4]), "single valid slot lse")
        assert not out[0].any() and not out[2].any()

    def check_latent_attention_split() -> None:
        # the short-window kernels (scores of every block, then the softmax per column block), forced
        for h, d, dv in [(4, 96, 80), (20, 96, 80), (3, 48, 32)]:  # 80: three column blocks of 32, one partial
            t, n_rows, slots = 6, 50, 40
            q, rows = randn(t, h, d), randn(n_rows, d)
            idx, valid = selection(t, n_rows, slots)
            out, lse = triton_attention.latent_attention(q, rows, idx, valid, d ** -0.5, dv, split=True)
            ref_out, ref_lse = torch_ops.latent_attention(q, rows, idx.clamp(min=0), valid, d ** -0.5, dv)
            close(out, ref_out, f"split out vs torch ({h} heads, dv {dv})")
            close(lse, ref_lse, f"split lse vs torch ({h} heads, dv {dv})")
            assert torch.equal(out[2], torch.zeros_like(out[2])) and bool((lse[2] == float("-inf")).all())
            whole, whole_lse = triton_attention.latent_attention(q, rows, idx, valid, d ** -0.5, dv, split=False)
            same(lse, whole_lse, f"split lse vs the prefill kernel ({h} heads)")
            if triton_attention.split_candidates(h, d, dv, torch.float32)[0][0] >= dv:  # one column block: the same
                # numpy products (narrower blocks than the prefill kernel's: other BLAS bits)
                same(out, whole, f"split out vs the prefill kernel ({h} heads)")
                assert triton_attention.agreement(h, d, dv, torch.float32, torch.float32, torch.device("cpu"),
                                                  queries=4, slots=37, n_rows=40)

    def check_latent_attention_prefix() -> None:
        # validity in a Selection's form (each row's valid slots first), given as such: the kernels
        # compare with the row's end instead of loading the mask; the same bits as loading it
        t, n_rows, slots = 8, 30, 40
        for h, d, dv in [(4, 80, 64), (3, 48, 32)]:
            q, rows = randn(t, h, d), randn(n_rows, d)
            counts = torch.tensor([0, 1, 17, 40, 39, 24, 25, 40])[:, None]
            valid = torch.arange(slots)[None, :] < counts
            idx = torch.where(valid, torch.randint(0, n_rows, (t, slots), generator=g), 0)
            for split in (False, True):
                want = triton_attention.latent_attention(q, rows, idx, valid, d ** -0.5, dv, split=split)
                got = triton_attention.latent_attention(q, rows, idx, valid, d ** -0.5, dv, split=split,
                                                        valid_prefix=True)
                for a, b, part in zip(got, want, ("out", "lse")):
                    same(a, b, f"latent_attention {part}, validity as a prefix ({h} heads, split {split})")

    def check_select_bracket() -> None:
        # rows of >= 4 x sample keys: passes over a sampled bracket where it holds the k-th key (most
        # rows), over the whole row where it does not (a sample that misses, too many candidates).
        # A sample of 512 (sample_keys' for rows up to 65536 keys) on rows the interpreter runs fast
        from glm53.ops import triton_topk

        sample = 512
        n = 4 * sample + 37
        s = randn(8, n)
        s[1] = (s[1] * 16).round()  # ties at the threshold, inside the bracket
        s[2, n // 2:] = float("-inf")  # a causal row: half its keys in the future
        sampled = (torch.arange(sample) * n) // sample
        s[3] = torch.rand(n, generator=g) + 1.0
        s[3, sampled] = -1.0  # the sample sees only the lowest keys: its bracket misses
        s[4] = 0.5  # one value: every key a candidate, over the cap
        s[5, ::3] = -0.0
        s[5, 1::3] = 0.0
        s[6, 5] = float("inf")
        s[7, 30:] = float("-inf")  # fewer finite keys than k
        for k in (32, 340, 1024):
            want = select_topk(s, k)
            idx, valid, nans, bracketed = triton_topk.select_rows(s, k, sample=sample)
            same(idx, want.indices, f"select_topk indices, bracket (k {k})")
            assert torch.equal(valid, want.valid), f"select_topk valid, bracket (k {k})"
            assert not nans.any()
            usable = [0, 1, 6] if k == 1024 else [0, 1, 2, 6]  # row 2 at k 1024: its bracket holds -inf, over the cap
            assert bracketed[usable].all(), f"rows with a usable sample not bracketed (k {k}): {bracketed.tolist()}"
            assert not bracketed[[3, 4]].any(), f"a missed or overfull bracket taken: {bracketed.tolist()}"
        s[0, 100] = float("nan")  # counted by the bracket's pass (the selection is undefined then)
        nans, bracketed = triton_topk.select_rows(s, 340, sample=sample)[2:]
        assert bracketed[0] and nans.tolist() == [1] + [0] * 7, f"NaN count from a bracketed row: {nans.tolist()}"

    def check_select_topk() -> None:
        forms = ("row", "row_full", "split")
        # the kernel against the CPU rule (select_topk on torch, which tests/test_attention.py checks
        # against brute force): exact. Rows over several of the kernel's column blocks, k below,
        # at and above N, ties at the threshold, -0.0 against 0.0, +-inf, all -inf, causal rows
        for n, k in [(1, 8), (5, 7), (8, 8), (9, 8), (40, 16), (100, 1), (1025, 40), (2100, 3), (3000, 64),
                     (2049, 2048)]:
            s = randn(6, n)
            s[0] = (s[0] * 2).round()  # few values: ties everywhere, also at the k-th
            s[1] = 0.0
            s[1, ::2] = -0.0
            s[2] = torch.where(torch.rand(n, generator=g) < 0.5, s[2], torch.full((n,), float("-inf")))
            if n > 3:
                s[3, 1], s[3, 2] = float("inf"), float("-inf")
            s[4] = torch.arange(n, 0, -1).float()
            s[5] = float("-inf")
            want = select_topk(s, k)
            for form in forms:  # a program a row (over a sampled bracket, or whole rows); a row over programs
                idx, valid, nans = triton_topk.select(s, k, form=form)
                same(idx, want.indices, f"select_topk indices (N {n}, k {k}, {form})")
                assert torch.equal(valid, want.valid), f"select_topk valid (N {n}, k {k}, {form})"
                assert not nans.any()
                if n in (40, 1025, 3000) and form != "row":  # fewer bits a pass (more passes, other early stops;
                    # the bracket's passes are the same code, and its sort is slow in the interpreter)
                    for bits in (1, 2, 4):
                        idx_b, valid_b, _ = triton_topk.select(s, k, bits, form=form)
                        assert torch.equal(idx_b, idx) and torch.equal(valid_b, valid), (
                            f"select_topk bits {bits} {form}")
        try:
            triton_topk.select(s, 8, bits=3)
        except ValueError as exc:
            assert "choose 1, 2, 4 or 8" in str(exc)
        else:
            raise AssertionError("bits=3 accepted")
        try:  # the split form's write kernel holds at most MAX_KEYS / BLOCK blocks a row
            triton_topk.select(torch.zeros(1, triton_topk.MAX_KEYS + 1), 8, form="split")
        except ValueError as exc:
            assert "exceed MAX_KEYS" in str(exc) and "torch form" in str(exc)
        else:
            raise AssertionError("a row over MAX_KEYS accepted by the split form")
        s = randn(12, 300).masked_fill(torch.arange(300)[None, :] > (288 + torch.arange(12))[:, None],
                                       float("-inf"))
        want, (idx, valid, _) = select_topk(s, 32), triton_topk.select(s, 32)
        assert torch.equal(idx, want.indices) and torch.equal(valid, want.valid), "select_topk causal rows"
        for form in forms:
            assert torch.equal(triton_topk.select(s, 32, form=form)[0], want.indices), f"causal rows, {form}"
        s[3, 7] = float("nan")
        for form in forms:
            assert triton_topk.select(s, 32, form=form)[2].tolist() == [0, 0, 0, 1] + [0] * 8, (
                f"NaN counted in its row only ({form})")

    # ---- EXL3 from the packed trellis (glm53/ops/triton_exl3.py; the GPU's PTX decoder: tests/gpu/test_exl3_cuda.py)
    def exl3_group(in_f: int, out_f: int, bits: float, codebook: str, prefix: str = "g"):
        from glm53.exl3.format import read_group

        parts = {"trellis": torch.randint(-(1 << 15), 1 << 15, (in_f // 16, out_f // 16, int(16 * bits)), generator=g,
                                          dtype=torch.int32).to(torch.int16),
                 "suh": ((torch.rand(in_f, generator=g) + 0.5) * (torch.randint(0, 2, (in_f,), generator=g) * 2 - 1)).half(),
                 "svh": ((torch.rand(out_f, generator=g) + 0.5) * in_f ** -0.5
                         * (torch.randint(0, 2, (out_f,), generator=g) * 2 - 1)).half()}
        if codebook != "3inst":
            parts[codebook] = torch.tensor({"mcg": 0xCBAC1FED, "mul1": 0x83DCD12D}[codebook] - (1 << 32),
                                           dtype=torch.int32)
        return read_group({f"{prefix}.{k}": v for k, v in parts.items()}, prefix)

    def check_exl3_decoder() -> None:
        """The kernels' decoder gives decode_rotated's values bit for bit: every codebook, every served K,
        the lane form (the model's) and the element form."""
        from glm53.exl3.bank import BankBuilder
        from glm53.exl3.decode import decode_rotated

        cases = [("3inst", 2.0, True), ("3inst", 4.0, False), ("mcg", 3.0, True), ("mcg", 2.0, False),
                 ("mul1", 2.5, True), ("mul1", 3.5, True), ("mul1", 4.0, True)]
        for codebook, bits, lanes in cases:
            group = exl3_group(128, 256, bits, codebook)
            b = BankBuilder()
            m = b.add_group(group)
            got = triton_exl3.dequant(b.build("cpu"), m, triton_exl3.Form(16, 4, 1, lanes, 32))
            same(got.view(torch.int16), decode_rotated(group.trellis, bits, codebook).view(torch.int16),
                 f"decoder {codebook} K{bits} {'lanes' if lanes else 'elements'}")

    def check_exl3_linear() -> None:
        """One linear: the parallel split form (partial sums in a workspace, the last program adds them),
        the full form, the staged full form (the matrix decoded once, read by every row tile) and the
        element decoder with its words prefetched (split and full) give a row the same bits; they agree with exl3_torch; padded outputs trimmed and a widened input placed; the
        arrival counters end at zero."""
        from glm53.exl3.bank import BankBuilder

        group = exl3_group(1280, 256, 3.0, "mcg")  # 10 steps: two splits, the second partial
        b = BankBuilder()
        m = b.add_group(group)
        bank = b.build("cpu")
        x = randn(5, 1280)
        parallel = triton_exl3.linear(x, bank, m)
        same(triton_exl3.linear(x, bank, m, form=triton_exl3.Form(16, 4, 1, True, 32)), parallel,
             "full form vs parallel form")
        same(triton_exl3.linear(x, bank, m, form=triton_exl3.Form(16, 4, 1, False, 32, stage_rows=1)), parallel,
             "staged full form vs parallel form")
        for form in (triton_exl3.Form(16, 4, 1, False, 32, parallel=True, prefetch=True),
                     triton_exl3.Form(16, 4, 1, False, 32, prefetch=True)):
            same(triton_exl3.linear(x, bank, m, form=form), parallel, f"{form} vs the parallel form")
        close(parallel, exl3_torch.linear(x, bank, m), "exl3 linear vs torch")
        close(triton_exl3.linear(x[:, :1000], bank, m, in_start=128, out_start=16, out_features=200),
              exl3_torch.linear(x[:, :1000], bank, m, 128, 16, 200), "widened input, trimmed output")
        assert int(triton_exl3.SCRATCH.buffers[("count", x.device)].abs().sum()) == 0, "counters left non-zero"

    def check_exl3_mlp() -> None:
        """Routed experts of mixed K with the shared expert folded in: the token-grouped decode form (each
        token's sum by the last expert to finish) and the expert-sorted prefill form against exl3_torch;
        the prefill form with every expert staged (over several passes of a small stage) and with the shared
        expert alone staged gives its unstaged bits; the dense MLP; the counters end at zero."""
        from glm53.exl3.bank import BankBuilder, MlpMatrices

        hidden, width, experts = 256, 256, 4
        b = BankBuilder()
        first = {}
        for p, shape in (("gate", (hidden, width)), ("up", (hidden, width)), ("down", (width, hidden))):
            first[p] = [b.add_group(exl3_group(*shape, (2.0, 3.0, 4.0)[(e + len(p)) % 3], "mul1")) for e in range(experts)][0]
        shared = tuple(b.add_group(exl3_group(*s, 3.0, "mul1")) for s in ((hidden, width), (hidden, width), (width, hidden)))
        bank = b.build("cpu")
        mats = MlpMatrices(first["gate"], first["up"], first["down"], experts, shared, width, hidden)
        x = randn(3, hidden)
        ids = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(3)])
        w = torch.rand(3, 2, generator=g)
        want = exl3_torch.mlp(x, bank, mats, ids, w)
        close(triton_exl3.mlp(x, bank, mats, ids, w), want, "mlp decode form vs torch")
        prefill = triton_exl3.mlp(x, bank, mats, ids, w, form=triton_exl3.Form(16, 4, 1, True, 32))
        close(prefill, want, "mlp prefill form vs torch")
        expert_bytes = 2 * 3 * hidden * width
        for stage_rows, stage_bytes, passes in ((1, 2 * expert_bytes, 3), (3, expert_bytes, 1)):
            form = triton_exl3.Form(16, 4, 1, True, 32, stage_rows=stage_rows)
            assert len(triton_exl3.stage_passes(bank, mats, 3, 2, stage_rows, stage_bytes)) == passes
            same(triton_exl3.mlp(x, bank, mats, ids, w, form=form, stage_bytes=stage_bytes), prefill,
                 f"mlp prefill staged from {stage_rows} rows in {passes} passes vs unstaged")
        dense = MlpMatrices(0, 0, 0, 0, shared, width, hidden)
        none = torch.zeros(3, 0, dtype=torch.int64)
        close(triton_exl3.mlp(x, bank, dense, none, None), exl3_torch.mlp(x, bank, dense, none, None), "dense mlp")
        for name in ("count", "count_tokens"):
            assert int(triton_exl3.SCRATCH.buffers[(name, x.device)].abs().sum()) == 0, f"{name} left non-zero"

    def check_exl3_cuda_finish() -> None:
        """The CUDA form's Triton side (Form.cuda): its finish kernels read the split parts in the layout
        glm53/ops/cuda_exl3.split_parts documents. With split_parts replaced by that contract in torch
        (x @ W_hat a split, fp32), the MLP (weighted, unweighted, experts shared between tokens, the dense
        MLP) and a linear (a widened input, trimmed outputs) agree with glm53/ops/exl3_torch.py (fp16
        outputs) and leave the counters at zero. The kernel's own bits:
        tests/gpu/test_exl3_cuda.py."""
        from glm53.exl3.bank import BankBuilder, MlpMatrices
        from glm53.ops import cuda_exl3

        def contract(bank, xr, ws, *, groups, n_blocks, n_splits, mats, in_width, out_stride, rows=0, ids=None,
                     tokens=0, routed=0, shared_id=0, has_shared=False, shared_mats=(), xr_proj=0, proj_cols=0):
            slots = rows if ids is None else groups
            flat_x, flat_ws = xr.reshape(-1), ws.reshape(-1)
            for p, m0 in enumerate(mats):
                for slot in range(slots):
                    m = m0
                    if ids is not None:
                        tok, place = divmod(slot, routed + int(has_shared))
                        e = int(ids[tok, place]) if place < routed else shared_id
                        m = shared_mats[p] if e == shared_id else m0 + e
                    w_hat = bank.rotated(m, 1 << 30, torch.float32)
                    x = flat_x[p * xr_proj + slot * in_width:][:in_width].float()
                    for split in range(n_splits):
                        k = slice(split * 1024, min(in_width, (split + 1) * 1024))
                        at = split * slots * out_stride + slot * out_stride + p * proj_cols
                        flat_ws[at:at + n_blocks * 128] = x[k] @ w_hat[k, :n_blocks * 128]

        cuda_exl3.split_parts = contract
        hidden, width, experts = 1152, 256, 4  # hidden: 9 steps, splits of 8 and 1
        b = BankBuilder()
        first = {}
        for p, shape in (("gate", (hidden, width)), ("up", (hidden, width)), ("down", (width, hidden))):
            first[p] = [b.add_group(exl3_group(*shape, (2.0, 3.0)[(e + len(p)) % 2], "mcg")) for e in range(experts)][0]
        shared = tuple(b.add_group(exl3_group(*s, 4.0, "mcg")) for s in ((hidden, width), (hidden, width), (width, hidden)))
        bank = b.build("cpu")
        mats = MlpMatrices(first["gate"], first["up"], first["down"], experts, shared, width, hidden)
        cuda = triton_exl3.DECODE_CUDA
        x = randn(3, hidden).to(torch.float16)  # a 16-bit model (the CUDA form's); the interpreter mis-loads bf16
        ids = torch.stack([torch.randperm(experts, generator=g)[:3] for _ in range(3)])  # 3 of 4: shared between tokens
        w = torch.rand(3, 3, generator=g)
        half = dict(atol=2e-2, rtol=2e-2)  # fp16 outputs against the torch path's
        for weights in (w, None):
            torch.testing.assert_close(triton_exl3.mlp(x, bank, mats, ids, weights, form=cuda).float(),
                                       exl3_torch.mlp(x, bank, mats, ids, weights).float(), **half,
                                       msg=lambda m: f"mlp, weighted {weights is not None}: {m}")
        dense = MlpMatrices(0, 0, 0, 0, shared, width, hidden)
        none = torch.zeros(3, 0, dtype=torch.int64)
        torch.testing.assert_close(triton_exl3.mlp(x, bank, dense, none, None, form=cuda).float(),
                                   exl3_torch.mlp(x, bank, dense, none, None).float(), **half,
                                   msg=lambda m: f"dense mlp: {m}")
        for name in ("count", "count_tokens"):
            assert int(triton_exl3.SCRATCH.buffers[(name, x.device)].abs().sum()) == 0, f"{name} left non-zero"
        m = shared[2]  # a linear 256 -> 1152: input columns [64, 224), outputs [128, 1028)
        got = triton_exl3.linear(x[:, :160], bank, m, in_start=64, out_start=128, out_features=900, form=cuda)
        want = exl3_torch.linear(x[:, :160], bank, m, 64, 128, 900)
        torch.testing.assert_close(got.float(), want.float(), **half, msg=lambda m: f"linear: {m}")

    checks = {"linear": check_linear, "linear_row_tiles_check": check_linear_row_tiles_check,
              "grouped_expert_linear": check_grouped_expert_linear,
              "linear_leading_dims": check_linear_leading_dims,
              "head_linear_strided": check_head_linear_strided, "rms_norm": check_rms_norm,
              "layer_norm": check_layer_norm, "index_scores": check_index_scores,
              "index_scores_causal": check_index_scores_causal, "index_scores_spans": check_index_scores_spans,
              "latent_attention": check_latent_attention,
              "latent_attention_edge_cases": check_latent_attention_edge_cases,
              "latent_attention_split": check_latent_attention_split,
              "latent_attention_prefix": check_latent_attention_prefix, "select_topk": check_select_topk,
              "select_bracket": check_select_bracket, "exl3_decoder": check_exl3_decoder,
              "exl3_linear": check_exl3_linear, "exl3_mlp": check_exl3_mlp,
              "exl3_cuda_finish": check_exl3_cuda_finish}
    results: dict[str, list] = {}
    for name in names:
        try:
            checks[name]()
            results[name] = [True, ""]
        except Exception as exc:  # noqa: BLE001 - reported to the parent test, which fails with it
            results[name] = [False, f"{type(exc).__name__}: {exc}"]
    return results


# ------------------------------------------------------------------------------------ tests (parent)

# two workers side by side on this project's 2-core host: select_topk alone takes about half of the
# interpreter's time (~58 s), everything else (select_bracket ~33 s, EXL3 ~10 s, the rest ~13 s) the other
FIRST_WORKER = ["select_topk", "exl3_cuda_finish"]
WORKER_SPLIT = (FIRST_WORKER, [name for name in CHECKS if name not in FIRST_WORKER])


@pytest.fixture(scope="module")
def verdicts() -> dict[str, list]:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed here: the interpreter checks need it (pip install triton)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    workers = [subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", *names], cwd=REPO,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for names in WORKER_SPLIT]
    found: dict[str, list] = {}
    try:
        for worker in workers:
            out, err = worker.communicate(timeout=WORKER_TIMEOUT_S)
            lines = [line for line in out.splitlines() if line.startswith("{")]
            if worker.returncode != 0 or not lines:
                pytest.fail(f"interpreter worker {worker.args[3:]} failed (rc {worker.returncode}):\n"
                            f"{out[-3000:]}\n{err[-3000:]}")
            found.update(json.loads(lines[-1]))
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()
    if SKIP_KEY in found:
        pytest.skip(found[SKIP_KEY][1])
    return found


@pytest.mark.parametrize("name", CHECKS)
def test_interpreted_kernel(verdicts, name):
    ok, message = verdicts[name]
    assert ok, message


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    print(json.dumps(_worker(sys.argv[2:] or CHECKS)), flush=True)
