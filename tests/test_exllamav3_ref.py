"""tests/gpu/exllamav3_ref.py on the CPU: the planning helpers, the wheel pins, and MoeReference's
orchestration of exllamav3's MoE entry points (width groups, id remapping, the chain of outputs, the
sort / slot tables of the exl3_moe tier) against an emulator of those entry points.

The emulator (FakeExt) checks every argument as the 1.6.5 C++ front ends do (exl3_moe_coop.cu
exl3_moe_coop / _prepare / _run, exl3_moe.cu exl3_moe and exl3_moe_gather: count, dtypes, shapes,
contiguity, scratch capacity, counter length and zero state) and computes what the kernels compute (per
slot: gate/up in fp16, silu, down in fp32, times the fp16 weight; the [min, max) mask, zero-weight slots
skipped, the shared term added; the slot scratch and its gather), with a stand-in decode of the trellis
that the stand-in LinearEXL3 shares. The real kernels run on the GPU (exllamav3_ref.smoke).
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "gpu"))

import exllamav3_ref as ref  # noqa: E402

pytestmark = pytest.mark.host_threads  # max_rel < 1e-5 holds for the sums MKL makes at the host's threads
HIDDEN, INTER, TOP_K = 256, 128, 8
REGISTRY: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # trellis data_ptr -> (trellis, suh, svh)


def dense(trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor) -> torch.Tensor:
    """The stand-in decode: a fixed function of the three tensors, [in, out] fp32."""
    w = trellis[..., 0].float().repeat_interleave(16, 0).repeat_interleave(16, 1) / 32768
    w = w + trellis[..., -1].float().repeat_interleave(16, 0).repeat_interleave(16, 1).roll(3, 0) / 65536
    return w * suh.float()[:, None] * svh.float()[None, :] * 4


class FakeLinear:
    def __init__(self, config, in_features, out_features, suh=None, svh=None, trellis=None, mcg=None, mul1=None,
                 out_dtype=None, key=None):
        assert config is None and trellis.dtype == torch.int16
        assert trellis.shape[:2] == (in_features // 16, out_features // 16)
        self.w, self.out_dtype = dense(trellis, suh, svh), out_dtype

    def forward(self, x, params, out_dtype=None):
        assert params == {} and x.is_contiguous() and x.dtype == torch.half
        return (x.float() @ self.w).to(out_dtype or self.out_dtype or torch.half)


def _weights(tables: list[torch.Tensor], e: int, proj: int) -> torch.Tensor:
    trellis_ptr, suh_ptr, svh_ptr = (int(tables[3 * proj + i][e]) for i in range(3))
    trellis, suh, svh = REGISTRY[trellis_ptr]
    assert (suh.data_ptr(), svh.data_ptr()) == (suh_ptr, svh_ptr), "suh/svh table entries of another tensor"
    return dense(trellis, suh, svh)


def _mlp(row: torch.Tensor, tables: list[torch.Tensor], e: int) -> torch.Tensor:
    g = (row.float() @ _weights(tables, e, 0)).half()
    u = (row.float() @ _weights(tables, e, 1)).half()
    a = (torch.nn.functional.silu(g.float()) * u.float()).half()
    return a.float() @ _weights(tables, e, 2)


def _contig(t: torch.Tensor, dtype: torch.dtype, dim: int | None = None) -> None:
    assert t.dtype == dtype and t.is_contiguous(), (t.dtype, dtype, t.is_contiguous())
    assert dim is None or t.dim() == dim


class FakeExt:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    def exl3_moe_max_concurrency(self, device):
        return 132 // 8  # an H200: num_sms / MOE_SMS_PER_EXPERT

    def silu_mul(self, g, u, a, limit):
        assert limit == 0.0 and g.dtype == u.dtype == a.dtype == torch.half
        a.copy_((torch.nn.functional.silu(g.float()) * u.float()).half())

    def exl3_moe_coop(self, *a):
        assert len(a) == 36, len(a)
        x, sel, rw, lo, hi, hi_in = a[:6]
        tables, biases = list(a[6:15]), a[15:18]
        kg, ku, kd, mcg, mul1, act, limit, gated = a[18:26]
        had_g, had_u, gu_g, gu_u, act_out, d_out, ctr, out, sh_out, sh_w = a[26:36]
        # exl3_moe_coop front end
        assert x.dtype == torch.half and sel.dtype == torch.long and rw.dtype == torch.half
        assert sel.is_contiguous() and rw.is_contiguous() and sel.shape == rw.shape and sel.dim() == 2
        assert sel.shape[0] == x.shape[0]
        # _prepare
        for t in tables:
            _contig(t, torch.long, 1)
        n_local = tables[3].shape[0]
        assert all(t.shape[0] == n_local for t in tables)
        assert biases == (None, None, None) and sh_w is None
        assert all(isinstance(k, float) and 1 <= k <= 8 for k in (kg, ku, kd)) and not (mcg and mul1)
        assert (not gated or kg == ku) and act == 0 and limit == 0.0 and gated is True
        inter, ho, h_out = gu_u.shape[-1], d_out.shape[-1], out.shape[-1]
        assert hi_in % 128 == 0 and inter % 128 == 0 and ho % 128 == 0 and h_out <= ho
        for t, dt, width in ((had_g, torch.half, hi_in), (had_u, torch.half, hi_in), (gu_g, torch.half, inter),
                             (gu_u, torch.half, inter), (act_out, torch.half, inter), (d_out, torch.float, ho)):
            _contig(t, dt)
            assert t.shape[-1] == width
        slots_max = min(had_g.numel() // hi_in, had_u.numel() // hi_in, gu_g.numel() // inter,
                        gu_u.numel() // inter, act_out.numel() // inter, d_out.numel() // ho)
        assert 1 <= slots_max <= 256 and out.dtype == torch.float and out.dim() >= 2 and out.stride(-1) == 1
        rows_max = out.shape[-2]
        _contig(ctr, torch.int)
        assert ctr.numel() >= ref.coop_ctr_len(slots_max, rows_max, inter, ho)
        assert int(ctr.abs().sum()) == 0, "counters must start zeroed (the kernels leave them so)"
        # _run
        T, H = x.shape
        assert x.dim() == 2 and x.stride(1) == 1 and H % 4 == 0 and H <= hi_in
        assert T * sel.shape[1] <= slots_max and T <= rows_max
        assert lo < 0 or hi - lo <= n_local
        if sh_out is not None:
            _contig(sh_out, torch.float)
            assert sh_out.shape[-1] == H and sh_out.numel() >= T * H and h_out == H
        self.calls.append(("coop", {"lo": lo, "hi": hi, "n_local": n_local, "T": T, "K": (kg, ku, kd),
                                    "sel_is": sel, "shared_in": sh_out is not None}))
        for t in range(T):
            acc = torch.zeros(h_out)
            for k in range(sel.shape[1]):
                e, w = int(sel[t, k]), float(rw[t, k])
                if w == 0.0 or (lo >= 0 and not lo <= e < hi):
                    continue
                e -= max(lo, 0)
                assert 0 <= e < n_local
                acc += w * _mlp(x[t], tables, e)[:h_out]
            out[t] = acc + (sh_out[t] if sh_out is not None else 0)

    def exl3_moe(self, *a):
        assert len(a) == 35, len(a)
        x, out_state, count, token_sorted, weight_sorted, tsg, tsu, tig, tiu, act, kg, ku, kd = a[:13]
        tables, flags, limit, num_active, scratch, base, lo, hi, m_tile = list(a[13:22]), a[22:28], *a[28:35]
        assert x.dtype == torch.half and x.dim() == 2 and out_state.dtype == torch.float and out_state.shape == x.shape
        _contig(scratch, torch.float, 2)
        assert scratch.shape[1] == x.shape[1] and base.dtype == torch.long
        _contig(count, torch.long, 1)
        assert token_sorted.dtype == torch.long and token_sorted.dim() == 1
        assert token_sorted.shape == weight_sorted.shape
        assert weight_sorted.dtype == torch.half
        assert tsg.dtype == tsu.dtype == tig.dtype == tiu.dtype == torch.half and tsg.dim() == 3 and tig.dim() == 3
        assert tsg.shape == tsu.shape and tsg.shape[2] == x.shape[1] and tig.shape == tiu.shape
        assert tig.shape[1] == tsg.shape[1] and tsg.shape[0] * 8 <= 132
        assert len(set(flags[0::2])) == 1 and len(set(flags[1::2])) == 1 and flags[0] != flags[1], flags
        assert act == 0 and limit == 0.0 and num_active == -1 and (lo, m_tile) == (1, 16)
        assert all(isinstance(k, float) for k in (kg, ku, kd))
        n = count.shape[0] - 1
        for t in tables:
            assert t.dim() == 1 and t.shape[0] == n and t.dtype == torch.long
        rows_cap = tsg.shape[1]
        self.calls.append(("moe", {"n_local": n, "T": x.shape[0], "K": (kg, ku, kd)}))
        start = 0
        for e in range(n):
            c = int(count[e])
            if 0 < c <= rows_cap and lo <= c <= hi:
                for r in range(c):
                    tok, w = int(token_sorted[start + r]), float(weight_sorted[start + r])
                    scratch[int(base[e]) + r] = w * _mlp(x[tok], tables, e)
            start += c

    def exl3_moe_gather(self, out, scratch, flat, inv_order, expert_start, slot_base, slot_kind, weight_sorted):
        _contig(out, torch.float, 2)
        _contig(scratch, torch.float, 2)
        for t in (flat, inv_order, expert_start, slot_base, slot_kind):
            _contig(t, torch.long)
        _contig(weight_sorted, torch.half)
        tokens, n = out.shape[0], slot_kind.shape[0]
        topk = flat.shape[0] // tokens
        assert flat.shape[0] % tokens == 0 and slot_base.shape[0] >= n and expert_start.shape[0] >= n
        for token in range(tokens):
            total = torch.zeros(out.shape[1])
            for k in range(topk):
                a = token * topk + k
                e = int(flat[a])
                if 0 <= e < n and int(slot_kind[e]):
                    pos = int(inv_order[a])
                    wt = float(weight_sorted[pos]) if int(slot_kind[e]) == 2 else 1.0
                    total += scratch[int(slot_base[e]) + pos - int(expert_start[e])] * wt
            out[token] += total


@pytest.fixture
def fake(monkeypatch):
    ext = FakeExt()
    monkeypatch.setattr(ref, "_EXL", (ext, FakeLinear))
    monkeypatch.setattr(ref, "_exllamav3_sizes",
                        lambda: {"MAX_BSZN": 8, "TEMP_ROWS_FUSED": 128, "FUSED_ROWS_WIDE": 256, "MTILE": 1})
    REGISTRY.clear()
    return ext


def parts(in_f: int, out_f: int, bits: float, codebook: str, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    p = {"trellis": torch.randint(-(1 << 15), 1 << 15, (in_f // 16, out_f // 16, int(16 * bits)), generator=gen,
                                  dtype=torch.int32).to(torch.int16),
         "suh": (torch.rand(in_f, generator=gen) + 0.5).half(),
         "svh": ((torch.rand(out_f, generator=gen) + 0.5) * in_f ** -0.5).half()}
    if codebook != "3inst":
        p[codebook] = torch.tensor(1, dtype=torch.int32)
    REGISTRY[p["trellis"].data_ptr()] = (p["trellis"], p["suh"], p["svh"])
    return p


def layer(bits: list[tuple[int, int, int]], codebook: str = "mcg", shared: tuple[int, int, int] | None = (4, 4, 3)):
    g = [parts(HIDDEN, INTER, kg, codebook, 10 * e) for e, (kg, _, _) in enumerate(bits)]
    u = [parts(HIDDEN, INTER, ku, codebook, 10 * e + 1) for e, (_, ku, _) in enumerate(bits)]
    d = [parts(INTER, HIDDEN, kd, codebook, 10 * e + 2) for e, (_, _, kd) in enumerate(bits)]
    sh = None
    if shared:
        sh = {"gate": parts(HIDDEN, INTER, shared[0], codebook, 901),
              "up": parts(HIDDEN, INTER, shared[1], codebook, 902),
              "down": parts(INTER, HIDDEN, shared[2], codebook, 903)}
    return ref.MoeReference(g, u, d, sh, top_k=TOP_K, device="cpu")


def routing(T: int, experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((T, HIDDEN), generator=gen).half()
    ids = torch.stack([torch.randperm(experts, generator=gen)[:TOP_K] for _ in range(T)])
    return x, ids, torch.rand((T, TOP_K), generator=gen) * 0.5


MIXED = [(2, 2, 3), (3, 3, 3), (2, 2, 3), (2, 3, 4), (4, 4, 2), (3, 3, 3), (2, 3, 4), (4, 4, 2), (3, 2, 2),
         (2, 2, 3), (4, 4, 4), (3, 3, 3)]


@pytest.mark.parametrize("T", [1, 3, 8, 9, 16])
def test_mixed_width_layer_matches_composed(fake, T):
    """Every group, remap, chain and slot table lands each token's experts once with its weight."""
    moe = layer(MIXED)
    x, ids, w = routing(T, len(MIXED), seed=T)
    fused = moe(x, ids, w).clone()
    st = ref.error_stats(fused, moe.composed(x, ids, w))
    assert st["all_finite"] and st["max_rel"] < 1e-5, st
    kinds = [c[0] for c in fake.calls]
    if T <= 8:
        assert kinds[0] == "coop" and fake.calls[0][1]["n_local"] == 1  # the shared expert first, at its width
        assert "moe" in kinds  # the gate K != up K groups
    else:
        assert set(kinds) == {"moe"}  # the shared expert as LinearEXL3 calls


def test_uniform_layer_is_run_bszN_call(fake):
    """One width: the routed launch takes all experts' tables, global ids, no range mask, the shared term."""
    bits = [(3, 3, 3)] * 12
    moe = layer(bits)
    x, ids, w = routing(5, len(bits), seed=1)
    fused = moe(x, ids, w).clone()
    assert ref.error_stats(fused, moe.composed(x, ids, w))["max_rel"] < 1e-5
    (k0, shared_call), (k1, routed) = fake.calls
    assert k0 == k1 == "coop" and shared_call["n_local"] == 1 and (shared_call["lo"], shared_call["hi"]) == (-1, -1)
    assert (routed["lo"], routed["hi"], routed["n_local"], routed["shared_in"]) == (-1, -1, 12, True)
    assert torch.equal(routed["sel_is"], ids)
    assert moe.plan(5)["as_exllamav3_runs_it"] and not moe.plan(9)["as_exllamav3_runs_it"]


def test_second_call_reuses_buffers(fake):
    """Repeated calls (graph replays) give the same rows; the emulator also checks the counters stay zero."""
    moe = layer(MIXED, shared=None)
    x, ids, w = routing(4, len(MIXED), seed=2)
    first = moe(x, ids, w).clone()
    assert torch.equal(moe(x, ids, w), first)


def test_3inst_has_no_fused_kernel_above_8_rows(fake):
    moe = layer([(3, 3, 3)] * 8, codebook="3inst", shared=None)
    assert moe.plan(8)["groups"][0]["kernel"] == ref.COOP
    with pytest.raises(NotImplementedError, match="mcg or mul1"):
        moe(*routing(9, 8, seed=3))


def test_routing_checks(fake):
    moe = layer([(2, 2, 2)] * 8, shared=None)
    x, ids, w = routing(2, 8, seed=4)
    bad = ids.clone()
    bad[1, 3] = 8
    with pytest.raises(ValueError, match="outside"):
        moe(x, bad, w)
    bad[1, 3] = bad[1, 2]
    with pytest.raises(ValueError, match="twice"):
        moe(x, bad, w)


def test_moe_kernel_choice():
    assert ref.moe_kernel(8, (3, 3, 4), "3inst") == ref.COOP
    assert ref.moe_kernel(1, (2, 3, 4), "mul1") == ref.FUSED_MOE
    assert ref.moe_kernel(16, (3, 3, 3), "mcg") == ref.FUSED_MOE
    with pytest.raises(NotImplementedError, match="gate K == up K"):
        ref.moe_kernel(1, (2, 3, 4), "3inst")
    with pytest.raises(NotImplementedError, match="above 16 rows"):
        ref.moe_kernel(17, (3, 3, 3), "mcg")
    assert ref.moe_kernel(32, (3, 3, 3), "mul1", fused_rows=256) == ref.FUSED_MOE


def test_local_index_table_partitions_the_experts():
    gen = torch.Generator().manual_seed(5)
    bits = [tuple(int(k) for k in torch.randint(2, 5, (3,), generator=gen)) for _ in range(256)]
    groups = ref.plan_width_groups(bits)
    table = ref.local_index_table(groups, 256)
    assert sorted(e for _, experts in groups for e in experts) == list(range(256))
    for g, (key, experts) in enumerate(groups):
        assert experts == sorted(experts) and all(bits[e] == key for e in experts)
        inside = table[g] < len(experts)
        assert inside.sum() == len(experts) and torch.equal(table[g][experts], torch.arange(len(experts)))
        assert torch.all(table[g][~inside] == len(experts))


def test_parts_info():
    p = parts(256, 128, 3, "mcg", 0)
    assert ref.parts_info(p) == ref.PartsInfo(256, 128, 3, "mcg")
    assert ref.parts_info(parts(256, 128, 2.5, "mul1", 1)).bits == 2.5
    with pytest.raises(ValueError, match="no EXL3 width"):
        ref.parts_info(parts(256, 128, 2.5, "mcg", 2))
    with pytest.raises(ValueError, match="unpack"):
        ref.parts_info({"trellis": p["trellis"], "su": p["suh"].view(torch.int16), "svh": p["svh"]})
    with pytest.raises(ValueError, match="suh must be fp16 \\[256\\]"):
        ref.parts_info({**p, "suh": p["suh"][:128]})
    with pytest.raises(ValueError, match="both"):
        ref.parts_info({**p, "mul1": p["mcg"]})


def test_wheel_pins_match_prepare_script():
    script = (REPO / "tests" / "gpu" / "prepare_wheels.sh").read_text()
    pins = dict(re.findall(r"\b([A-Za-z0-9_.-]+)==([0-9][0-9A-Za-z.]*)", script))
    assert {k.replace("-", "_"): v for k, v in pins.items()} == ref.WHEELS


def test_imports_without_exllamav3():
    assert ref._EXL is None or isinstance(ref._EXL[0], FakeExt)
    assert "exllamav3" not in sys.modules
    assert ref.linear_path(1).startswith("mul1") and "hgemm" in ref.linear_path(2048)
