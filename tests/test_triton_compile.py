"""Kernels whose control flow the interpreter cannot vouch for compile for the H200 (sm_90) without
a GPU, and every kernel, at the config the kit runs there, fits the shared memory of our users' GPU,
GB10 (DGX Spark, sm_121, 99 KB a block) and of the H200: the selection kernels (glm53/ops/triton_topk.py: data-dependent while loops, a sampled
bracket; the short windows' four), the
indexer's scores kernel in each of its mask forms (glm53/ops/triton_indexer.py) and the prefill
attention kernel (glm53/ops/triton_attention.py) at GLM-5.3's shape.

Triton's interpreter (tests/test_triton_interpret.py) runs a kernel's logic but not its compiler:
the selection kernel's first form passed there and then failed to compile on the H200 (a constexpr
reassigned inside static_range). triton.compile with an explicit target runs the whole pipeline
here, ptxas included (Triton's wheel carries it), so such an error fails on the CPU.
"""
from __future__ import annotations

import importlib.util
import re

import pytest


# shared memory a block (the opt-in maximum): the H200 (sm_90) 227 KB; GB10, the DGX Spark's GPU
# (sm_121), 99 KB (cudaDevAttrMaxSharedMemoryPerBlockOptin as GB10 owners report it)
H200_SHARED, GB10_SHARED = 232448, 101376


def _compile(fn, signature: dict[str, str], constexprs: dict[str, object], warps: int, capability: int = 90,
             stages: int | None = None):
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed here: the compile check needs it (pip install triton)")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # the launch's specialization: Triton marks a pointer or an integer argument divisible by 16
    # unless do_not_specialize names it. Here every one gets the mark: the most a launch can get
    # (torch's allocations are aligned; at GLM-5.3's dims every stride of attention, linear and the
    # indexer is a multiple of 16), so the largest shared memory. Without the mark, loads cannot
    # vectorize and the pipeliner leaves them alone: the kernel compiled here would need less
    # shared memory than the one the GPU runs (attention: 96 against 98 KB for sm_121).
    names = list(signature)
    aligned = [n for n, kind in signature.items() if kind.startswith("*") or
               (kind == "i32" and n not in fn.do_not_specialize)]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    source = ASTSource(fn=fn, signature={**signature, **{name: "constexpr" for name in constexprs}},
                       constexprs=constexprs, attrs=attrs)
    from glm53.ops.triton_launch import OPTIONS

    options = {"num_warps": warps, **({"num_stages": stages} if stages is not None else {}), **OPTIONS}
    compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)
    assert compiled.asm["cubin"], "no machine code"
    assert f".target sm_{capability}" in compiled.asm["ptx"]
    return compiled


@pytest.mark.parametrize("sample", [0, 1024])
def test_selection_kernel_compiles_for_sm90(sample: int) -> None:
    """The row form: passes over the whole row, or over a sampled bracket first."""
    from glm53.ops import triton_topk

    signature = {"s_ptr": "*fp32", "idx_ptr": "*i64", "valid_ptr": "*i8", "nan_ptr": "*i32", "cand_ptr": "*fp32",
                 "kept_ptr": "*i32", "bracketed_ptr": "*i8", "N": "i32", "WIDTH": "i32", "CAP": "i32",
                 "KEPT_CAP": "i32", "stride_s": "i32", "stride_i": "i32", "stride_v": "i32", "stride_c": "i32",
                 "stride_k": "i32"}
    _compile(triton_topk._select_kernel, signature,
             {"BLOCK": triton_topk.ROW_BLOCK, "BITS": triton_topk.DIGIT_BITS, "SAMPLE": sample}, 4)


@pytest.mark.parametrize("name,first", [("hist", True), ("hist", False), ("resolve", True), ("resolve", False),
                                        ("count", None), ("write", None)])
def test_split_selection_kernels_compile_for_sm90(name: str, first: bool | None) -> None:
    """The short windows' selection (each row over many programs), each of its four kernels."""
    from glm53.ops import triton_topk as tk

    kernels = {
        "hist": (tk._split_hist_kernel, {"s_ptr": "*fp32", "state_ptr": "*i32", "hist_ptr": "*i32", "nan_ptr": "*i32",
                                         "N": "i32", "P": "i32", "stride_s": "i32"},
                 {"FIRST": first, "BLOCK": tk.BLOCK, "BITS": tk.DIGIT_BITS}),
        "resolve": (tk._split_resolve_kernel, {"state_ptr": "*i32", "hist_ptr": "*i32", "nan_part_ptr": "*i32",
                                               "nan_ptr": "*i32", "N": "i32", "P": "i32", "WIDTH": "i32"},
                    {"FIRST": first, "BITS": tk.DIGIT_BITS, "BLOCK": tk.BLOCK, "BLOCK_P": tk.RESOLVE_BLOCKS}),
        "count": (tk._split_count_kernel, {"s_ptr": "*fp32", "state_ptr": "*i32", "count_ptr": "*i32", "N": "i32",
                                           "P": "i32", "stride_s": "i32"}, {"BLOCK": tk.BLOCK}),
        "write": (tk._split_write_kernel, {"s_ptr": "*fp32", "state_ptr": "*i32", "count_ptr": "*i32",
                                           "idx_ptr": "*i64", "valid_ptr": "*i8",
                                           **{n: "i32" for n in ("N", "P", "stride_s", "stride_i", "stride_v")}},
                  {"BLOCK": tk.BLOCK, "BLOCK_P": tk.MAX_KEYS // tk.BLOCK}),
    }
    fn, signature, constexprs = kernels[name]
    _compile(fn, signature, constexprs, 4)


INDEX_SIGNATURE = {"q_ptr": "*bf16", "hw_ptr": "*fp32", "k_ptr": "*bf16", "krow_ptr": "*i64", "qpos_ptr": "*i64",
                   "kpos_ptr": "*i64",
                   "out_ptr": "*fp32", "scale": "fp32",
                   **{name: "i32" for name in ("T", "N", "H", "D", "stride_qt", "stride_qh", "stride_hwt",
                                               "stride_hwh", "stride_kn", "stride_ot", "TILES", "stride_kr")}}


@pytest.mark.parametrize("causal,key_positions,key_rows,spans", [
    (False, False, False, False), (True, False, False, False), (True, True, False, False), (True, False, True, False),
    (True, False, True, True), (True, True, True, True)])  # SPANS: several windows, each its own row of keys
def test_index_scores_kernel_compiles_for_sm90_in_each_mask_form(causal: bool, key_positions: bool,
                                                                 key_rows: bool, spans: bool) -> None:
    import torch

    from glm53.ops import triton_indexer

    block_t, block_n, warps, _ = triton_indexer.index_config(32, 128, torch.bfloat16)
    signature = INDEX_SIGNATURE
    compiled = _compile(triton_indexer._index_scores_kernel, signature,
                        {"BLOCK_T": block_t, "BLOCK_N": block_n, "BLOCK_D": 128, "IEEE": False, "CAUSAL": causal,
                         "KEY_POSITIONS": key_positions, "KEY_ROWS": key_rows, "SPANS": spans}, warps)
    assert "wgmma" in compiled.asm["ptx"]  # the scores stay on the tensor cores in every form


def test_prefill_attention_kernel_compiles_for_sm90_at_glm53_dims() -> None:
    """latent_attention's prefill kernel at GLM-5.3's shape (64 heads x 512 + 64, bf16, 64-slot blocks)."""
    import torch

    from glm53.ops import triton_attention as ta

    block_h, block_n, warps, _ = ta.attention_config(64, 576, 512, torch.bfloat16)
    signature = {"q_ptr": "*bf16", "rows_ptr": "*bf16", "idx_ptr": "*i64", "valid_ptr": "*u8", "end_ptr": "*i32",
                 "out_ptr": "*bf16", "lse_ptr": "*fp32", "scale": "fp32",
                 **{name: "i32" for name in ("T", "K_SLOTS", "H", "stride_qt", "stride_qh", "stride_r", "stride_it",
                                             "stride_vt", "stride_ot", "stride_oh", "stride_lt")}}
    for prefix in (False, True):  # validity loaded, or a compare (the engine's Selections)
        compiled = _compile(ta._latent_attention_kernel, signature,
                            {**ta._query_blocks(576, 512), "BLOCK_H": block_h, "BLOCK_N": block_n, "IEEE": False,
                             "PREFIX": prefix}, warps)
        assert "wgmma" in compiled.asm["ptx"]
        # the softmax's 2^x is one ex2.approx.ftz each (no multiply by log2(e), no subnormal fix-up)
        assert "ex2.approx.ftz.f32" in compiled.asm["ptx"] and "ex2.approx.f32" not in compiled.asm["ptx"]
        # the gathered rows are copied ahead of the dots (cp.async), as in the kernel the H200 runs: its
        # measured shared memory (110592 bytes for 64 heads x 16 slots) is this compile's
        assert "async_copy" in compiled.asm["ttgir"], "the slot loop is not pipelined: not the launch's kernel"
        loads_validity = re.search(r"tt\.load [^\n]*ptr<i8>", compiled.asm["ttgir"]) is not None
        assert loads_validity != prefix  # a prefix: a compare with the row's end, no load of the mask


ATTENTION_SIGNATURE = {"q_ptr": "*bf16", "rows_ptr": "*bf16", "idx_ptr": "*i64", "valid_ptr": "*u8", "end_ptr": "*i32",
                       "out_ptr": "*bf16", "lse_ptr": "*fp32", "scale": "fp32",
                       **{name: "i32" for name in ("T", "K_SLOTS", "H", "stride_qt", "stride_qh", "stride_r",
                                                   "stride_it", "stride_vt", "stride_ot", "stride_oh", "stride_lt")}}
SCORES_SIGNATURE = {**{k: v for k, v in ATTENTION_SIGNATURE.items() if k not in ("out_ptr", "lse_ptr", "stride_ot",
                                                                                  "stride_oh", "stride_lt")},
                    "s_ptr": "*fp32", "stride_st": "i32", "stride_sh": "i32"}


def _attention_shared(config: tuple, capability: int, extra: dict, fn=None, signature=ATTENTION_SIGNATURE) -> int:
    """Shared memory a block of an attention kernel (default: the prefill kernel) compiled for
    `capability` with `config` (BLOCK_H, BLOCK_N, warps, stages) and the constexprs in `extra`."""
    from glm53.ops import triton_attention as ta

    block_h, block_n, warps, stages = config
    return _compile(fn or ta._latent_attention_kernel, signature,
                    {**ta._query_blocks(576, 512), "BLOCK_H": block_h, "BLOCK_N": block_n, "IEEE": False, **extra},
                    warps, capability, stages).metadata.shared


@pytest.mark.parametrize("capability,limit,preferred", [(90, H200_SHARED, True), (121, GB10_SHARED, False)],
                         ids=["h200-sm90", "gb10-sm121"])
@pytest.mark.parametrize("heads", [64, 16], ids=["64-heads", "16-heads"])
def test_attention_config_that_fits_each_device(capability: int, limit: int, preferred: bool, heads: int) -> None:
    """fit_prefill's rule (the first candidate whose compiled prefill kernel fits the device's shared
    memory a block) with the real compiler's numbers: the H200 runs the preferred config; on GB10 that
    one needs more than its 99 KB (the kernel would not launch there) and a later candidate fits;
    the split's scores kernel at the chosen config fits too. 64 heads: the engine's call under TP4 +
    DCP4 as well (every rank attends with all heads over its own rows)."""
    import torch

    from glm53.ops import triton_attention as ta

    def shared(fn, signature, config, prefix: bool = False) -> int:  # fit_prefill decides with validity loaded
        return _attention_shared(config, capability, {"PREFIX": prefix}, fn, signature)

    candidates = ta.attention_candidates(heads, 576, 512, torch.bfloat16)
    chosen = ta.first_fitting(candidates, lambda c: shared(ta._latent_attention_kernel, ATTENTION_SIGNATURE, c),
                              limit)
    assert chosen is not None, f"no candidate fits {limit} bytes on sm_{capability}"
    assert (chosen == candidates[0]) == preferred, chosen
    if not preferred and heads == 64:  # GB10 on Triton 3.9 (pyproject's): 64 x 16 slots, pipelined
        assert chosen == (64, 16, 8, 2), chosen
        twin = (64, 16, 8, 1)  # next: the same bits unpipelined, for a compiler that needs more there
        assert candidates[candidates.index(chosen) + 1] == twin
        # smaller with validity loaded (96 against 98 KB); with validity a compare Triton 3.9 gives
        # the twin 104 KB against the pipelined form's 92 (a GB10 on the twin runs it loaded)
        loaded = {"PREFIX": False}
        assert _attention_shared(twin, capability, loaded) < _attention_shared(chosen, capability, loaded)
    assert shared(ta._latent_scores_kernel, SCORES_SIGNATURE, chosen) <= limit
    # the chosen config's prefix form (the engine's calls) fits as well: prefix_choice can take it
    assert shared(ta._latent_attention_kernel, ATTENTION_SIGNATURE, chosen, True) <= limit
    assert shared(ta._latent_scores_kernel, SCORES_SIGNATURE, chosen, True) <= limit


@pytest.mark.parametrize("m,n,k", [(2048, 6144, 2048), (2048, 12288, 6144), (1, 2048, 6144), (64, 2048, 6144)])
def test_linear_configs_fit_gb10(m: int, n: int, k: int) -> None:
    import torch

    from glm53.ops import triton_linear as tlin

    c = tlin.linear_config(m, n, k, torch.bfloat16)
    signature = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
                 **{name: "i32" for name in ("M", "N", "K", "stride_xm", "stride_xh", "stride_wh", "stride_wn",
                                             "stride_om", "stride_oh")}}
    compiled = _compile(tlin._matmul_kernel, signature, {"BLOCK_M": c.block_m, "BLOCK_N": c.block_n,
                                                         "BLOCK_K": c.block_k, "GROUP_M": c.group_m, "IEEE": False},
                        c.num_warps, 121, c.num_stages)
    assert compiled.metadata.shared <= GB10_SHARED, (c, compiled.metadata.shared)


@pytest.mark.parametrize("capability,limit", [(90, H200_SHARED), (121, GB10_SHARED)], ids=["h200-sm90", "gb10-sm121"])
@pytest.mark.parametrize("rows", [64, 2048])  # linear's tile for 64 rows, or the prefill one
@pytest.mark.parametrize("n,k", [(4096, 6144), (6144, 2048)])  # GLM-5.3's expert gate_up and down
def test_grouped_expert_kernel_compiles_and_fits(capability: int, limit: int, rows: int, n: int, k: int) -> None:
    """The MoE prefill's grouped kernel at GLM-5.3's expert shapes in the prefill tile (its default,
    GROUPED_ROWS) and the 64-row tile (bench_moe_prefill's other arm)."""
    import torch

    from glm53.ops import triton_linear as tlin

    c = tlin.linear_config(rows, n, k, torch.bfloat16)
    signature = {"x_ptr": "*bf16", "w_ptr": "*bf16", "tile_expert_ptr": "*i32", "tile_row_ptr": "*i64",
                 "tile_rows_ptr": "*i32", "out_ptr": "*bf16",
                 **{name: "i32" for name in ("N", "K", "stride_xm", "stride_we", "stride_wn", "stride_om")}}
    compiled = _compile(tlin._grouped_expert_kernel, signature, {"BLOCK_M": c.block_m, "BLOCK_N": c.block_n,
                                                                 "BLOCK_K": c.block_k, "IEEE": False},
                        c.num_warps, capability, c.num_stages)
    assert compiled.metadata.shared <= limit, (c, compiled.metadata.shared)
    if capability == 90:
        assert "wgmma" in compiled.asm["ptx"]


def test_index_scores_and_selection_fit_gb10() -> None:
    import torch

    from glm53.ops import triton_indexer, triton_topk

    block_t, block_n, warps, stages = triton_indexer.index_config(32, 128, torch.bfloat16)
    signature = INDEX_SIGNATURE
    compiled = _compile(triton_indexer._index_scores_kernel, signature,
                        {"BLOCK_T": block_t, "BLOCK_N": block_n, "BLOCK_D": 128, "IEEE": False, "CAUSAL": True,
                         "KEY_POSITIONS": True, "KEY_ROWS": True, "SPANS": False}, warps, 121, stages)
    assert compiled.metadata.shared <= GB10_SHARED
    signature = {"s_ptr": "*fp32", "idx_ptr": "*i64", "valid_ptr": "*i8", "nan_ptr": "*i32", "cand_ptr": "*fp32",
                 "kept_ptr": "*i32", "bracketed_ptr": "*i8",
                 **{name: "i32" for name in ("N", "WIDTH", "CAP", "KEPT_CAP", "stride_s", "stride_i", "stride_v",
                                             "stride_c", "stride_k")}}
    compiled = _compile(triton_topk._select_kernel, signature, {"BLOCK": triton_topk.ROW_BLOCK,
                                                                "BITS": triton_topk.DIGIT_BITS, "SAMPLE": 1024}, 4, 121)
    assert compiled.metadata.shared <= GB10_SHARED


def _exl3_signature(kernel: str) -> dict[str, str]:
    """The EXL3 kernels' arguments as a bf16 model launches them (glm53/ops/triton_exl3.py)."""
    i32 = lambda *names: {n: "i32" for n in names}  # noqa: E731
    bank = {"table_ptr": "*i64", "words_ptr": "*i32", "scales_ptr": "*fp16"}
    stage = {"stage_ptr": "*fp16", "stage_off_ptr": "*i64"}
    routing = {"ids_ptr": "*i64", **i32("stride_ids", "T", "K", "shared"), "tile_mat_ptr": "*i32",
               "tile_first_ptr": "*i64", "tile_rows_ptr": "*i32"}
    return {
        "rotate": {"x_ptr": "*bf16", "stride_xm": "i32", "xr_ptr": "*fp16", "table_ptr": "*i64", "scales_ptr": "*fp16",
                   **i32("R", "width", "in_start", "in_width"), "ids_ptr": "*i64", **i32("stride_ids", "T", "K", "shared"),
                   "token_ptr": "*i32", "expert_ptr": "*i32", **i32("m_gate", "m_up", "shared_gate", "shared_up")},
        "linear": {"xr_ptr": "*fp16", "out_ptr": "*bf16", "table_ptr": "*i64", "m": "i32", "words_ptr": "*i32",
                   "scales_ptr": "*fp16", "ws_ptr": "*fp32", "cnt_ptr": "*i32", **stage,
                   **i32("M", "stride_om", "out_start", "out_width")},
        "gate_up": {"xr_ptr": "*fp16", "xd_ptr": "*fp16", **bank, "ws_ptr": "*fp32", "cnt_ptr": "*i32", **stage,
                    **routing,
                    **i32("gate0", "up0", "down0", "shared_gate", "shared_up", "shared_down", "S", "hidden", "width")},
        "down": {"xd_ptr": "*fp16", "parts_ptr": "*bf16", "out_ptr": "*bf16", **bank, "ws_ptr": "*fp32", "cnt_ptr": "*i32",
                 "tok_cnt_ptr": "*i32", **stage, "ids_ptr": "*i64", "stride_ids": "i32", "weights_ptr": "*fp32",
                 **i32("stride_w", "T", "K", "shared"), "tile_mat_ptr": "*i32", "tile_first_ptr": "*i64",
                 "tile_rows_ptr": "*i32", "slot_weight_ptr": "*fp32", **i32("down0", "shared_down", "width", "hidden")},
        "stage": {"words_ptr": "*i32", "table_ptr": "*i64", "mats_ptr": "*i32", **stage},
        "gate_up_finish": {"ws_ptr": "*fp32", "xd_ptr": "*fp16", "table_ptr": "*i64", "scales_ptr": "*fp16",
                           "ids_ptr": "*i64", **i32("stride_ids", "T", "K", "shared", "gate0", "up0", "down0",
                                                    "shared_gate", "shared_up", "shared_down", "S", "width", "n_sp")},
        "linear_finish": {"ws_ptr": "*fp32", "out_ptr": "*bf16", "table_ptr": "*i64", "m": "i32", "scales_ptr": "*fp16",
                          **i32("M", "out_read", "n_sp", "stride_om", "out_start", "out_width")},
        "down_finish": {"ws_ptr": "*fp32", "parts_ptr": "*bf16", "out_ptr": "*bf16", "table_ptr": "*i64",
                        "scales_ptr": "*fp16", "tok_cnt_ptr": "*i32", "ids_ptr": "*i64", "stride_ids": "i32",
                        "weights_ptr": "*fp32", **i32("stride_w", "T", "K", "shared", "down0", "shared_down", "S",
                                                      "hidden", "n_sp")},
    }[kernel]


@pytest.mark.parametrize("capability,limit", [(90, H200_SHARED), (121, GB10_SHARED)], ids=["h200-sm90", "gb10-sm121"])
@pytest.mark.parametrize("kernel,form", [("linear", "decode"), ("linear", "prefill"), ("gate_up", "decode"),
                                         ("down", "staged"), ("gate_up", "elements-ptx"), ("down", "prefetch-ptx")])
def test_exl3_kernels_compile_and_fit(capability: int, limit: int, form: str, kernel: str) -> None:
    """The EXL3 products (glm53/ops/triton_exl3.py) as a bf16 model launches them with one codebook: they
    compile, fit the device's shared memory, and decode in PTX (the funnel shifts and the f16x2 codebook
    of _decode_asm) where the form says so (the lane form, the element form with ptx), not the
    interpreter's fallback; staged, the main loop reads the stage and decodes nothing. Every kernel once,
    each form's branches in two
    (their shared helpers are the main loop; ~3 s a compile here, so not every kernel x form)."""
    import triton.language as tl

    from glm53.ops import triton_exl3 as tx

    f = {"decode": tx.DECODE, "prefill": tx.PREFILL,
         "elements-ptx": tx.Form(16, 4, 1, False, 32, parallel=True, ptx=True), "staged": tx.PREFILL.stage_tiling,
         "prefetch-ptx": tx.Form(16, 4, 1, False, 32, parallel=True, ptx=True, prefetch=True)}[form]
    staged = form == "staged"
    constexprs = {"ACT": tl.float16, "CB": 1, "LANES": f.decoder, "BM": f.bm, "BN": 128, "SUBK": f.subk,
                  "PARALLEL": f.parallel}
    if kernel == "linear":
        constexprs["STAGED"] = staged
    else:
        constexprs.update(TOKENS=f.parallel, HAS_SHARED=True, KPB=16, STAGE=int(staged))
    if kernel == "gate_up":
        constexprs["C_TY"] = tl.bfloat16
    if kernel == "down":
        constexprs["WEIGHTED"] = True
    fn = {"linear": tx._linear_kernel, "gate_up": tx._gate_up_kernel, "down": tx._down_kernel}[kernel]
    compiled = _compile(fn, _exl3_signature(kernel), constexprs, f.warps, capability, f.stages)
    assert compiled.metadata.shared <= limit, (kernel, form, compiled.metadata.shared)
    ptx = compiled.asm["ptx"]
    in_ptx = "shf.r.clamp.b32" in ptx and "add.rn.f16x2" in ptx
    assert in_ptx == ((f.lanes or f.ptx) and not staged), (
        f"{form}: the decoder's PTX path {'missing' if not in_ptx else 'unexpected'}")


@pytest.mark.parametrize("form", ["decode", "prefill", "prefetch-ptx"])
def test_exl3_linear_compiles_for_an_fp32_model(form: str) -> None:
    """An fp32 model's EXL3 product (ACT fp32: rotated inputs fp32, the decoded fp16 weights widened
    before an ieee dot) compiles in each main-loop form: the reference dtype the GPU tests run."""
    import triton.language as tl

    from glm53.ops import triton_exl3 as tx

    f = {"decode": tx.DECODE, "prefill": tx.PREFILL,
         "prefetch-ptx": tx.Form(16, 4, 1, False, 32, parallel=True, ptx=True, prefetch=True)}[form]
    signature = dict(_exl3_signature("linear"), xr_ptr="*fp32", out_ptr="*fp32")
    constexprs = {"ACT": tl.float32, "CB": 1, "LANES": f.decoder, "BM": f.bm, "BN": 128, "SUBK": f.subk,
                  "PARALLEL": f.parallel, "STAGED": False}
    _compile(tx._linear_kernel, signature, constexprs, f.warps, 90, f.stages)


@pytest.mark.parametrize("capability", [90, 121])
def test_exl3_rotation_and_stage_compile(capability: int) -> None:
    import triton.language as tl

    from glm53.ops import triton_exl3 as tx

    compiled = _compile(tx._rotate_kernel, _exl3_signature("rotate"),
                        {"ROWS": 1, "HAS_SHARED": True, "ACT": tl.float16, "BM": tx.ROTATE_ROWS}, 4, capability)
    assert compiled.metadata.shared <= GB10_SHARED
    staged = _compile(tx._stage_kernel, _exl3_signature("stage"), {"CB": 1, "LANES": tx.PREFILL.decoder,
                      "SUBK": tx.PREFILL.subk, "BN": 128}, 4, capability)
    assert staged.metadata.shared <= GB10_SHARED


@pytest.mark.parametrize("capability", [90, 121])
def test_exl3_finish_kernels_compile(capability: int) -> None:
    """The Triton finish of the CUDA split sums (Form.cuda: _gate_up_finish_kernel, _down_finish_kernel,
    _linear_finish_kernel) compile for the H200 and GB10 and fit GB10's shared memory."""
    import triton.language as tl

    from glm53.ops import triton_exl3 as tx

    common = {"HAS_SHARED": True, "ACT": tl.float16, "BM": 16, "BN": 128, "KPB": 16}
    gate_up = _compile(tx._gate_up_finish_kernel, _exl3_signature("gate_up_finish"), {**common, "C_TY": tl.bfloat16},
                       4, capability)
    down = _compile(tx._down_finish_kernel, _exl3_signature("down_finish"), {**common, "WEIGHTED": True}, 4,
                    capability)
    linear = _compile(tx._linear_finish_kernel, _exl3_signature("linear_finish"),
                      {"ACT": tl.float16, "BM": 16, "BN": 128}, 4, capability)
    assert max(gate_up.metadata.shared, down.metadata.shared, linear.metadata.shared) <= GB10_SHARED
