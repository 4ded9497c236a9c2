"""Worker entry points for the multi-process tests of glm53.dist (one OS process per rank).

    python tests/dist_workers.py SCENARIO --rank R --world W --port P --out DIR [--env]

Each scenario joins the group (by master/port, or with --env from a torchrun-style environment),
does its work, and writes its results to DIR/rank<R>.pt for the test to check. Inputs are
generated from fixed seeds, identically on every rank, so the test can recompute them.
"""
from __future__ import annotations

import argparse
import random
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from glm53.dist import dcp, tp  # noqa: E402
from glm53.dist.collectives import Comm  # noqa: E402
from glm53.dist.guard import GuardSettings  # noqa: E402
from glm53.dist.rendezvous import RendezvousSpec, rendezvous, spec_from_env  # noqa: E402
from glm53.model.parallel import AttentionSpan  # noqa: E402
from glm53.settings import Settings  # noqa: E402

# ---- shared inputs (the test imports these to recompute the expected values) -----------------
HEADS, QK_DIM, V_DIM, SCALE = 8, 48, 32, 0.17
ATTN_LENGTHS = (37, 3, 1)  # 3 and 1 are shorter than R = 4: some ranks own nothing
TOPK_K = 16



def one_span_attention(comm, q_nope, q_rot, w_uk_t, w_uv, rows, selection, head_ranges, scale):  # noqa: ANN001, ANN201
    """glm53.dist.dcp.tp_dcp_attention_spans over one sequence's span (the rows every rank holds)."""
    return dcp.tp_dcp_attention_spans(comm, [AttentionSpan(q_nope, q_rot, lambda: rows, None, selection)], w_uk_t,
                                      w_uv, head_ranges, scale)

def attention_inputs(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + n + seed)
    return (torch.randn(HEADS, QK_DIM, generator=g), torch.randn(n, QK_DIM, generator=g),
            torch.randn(n, V_DIM, generator=g))


def topk_inputs(n: int, rows: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores with many exact ties (small integers, some -inf, a -0.0, a few +inf: ranked first, then
    dropped from a selection as not finite), positions 0..n-1."""
    g = torch.Generator().manual_seed(77 + n)
    scores = torch.randint(-3, 4, (rows, n), generator=g).float()
    scores[:, ::11] = float("-inf")
    scores[0, 5 % n] = -0.0
    scores[rows - 1, 1::7] = float("inf")
    return scores, torch.arange(n)


TOPK_CASES = ((200, TOPK_K), (10, TOPK_K), (64, 64), (3, TOPK_K))


# ---- scenarios ----------------------------------------------------------------------------
def suite(comm: Comm, out: Path) -> None:
    """Collectives, DCP attention merge (incl. ranks owning nothing), top-k merge."""
    r, R = comm.rank, comm.world_size
    results: dict[str, object] = {"rank": r, "world": R, "backend": comm.backend}
    parts = comm.all_gather(torch.tensor([r * 10 + 1.5]))
    results["all_gather"] = parts
    results["sum"] = comm.sum_in_rank_order(torch.full((5,), float(r) + 0.25))

    own = dcp.Ownership(r, R)
    for n in ATTN_LENGTHS:
        q, k, v = attention_inputs(n)
        pos = own.owned_positions(0, n)
        o, lse = dcp.attend_reference(q, k[pos], v[pos], SCALE)
        if pos.numel() == 0:
            o = torch.full_like(o, float("nan"))  # a kernel's garbage must not leak into the merge
        first = dcp.dcp_merge(comm, o, lse)
        second = dcp.dcp_merge(comm, o, lse)
        results[f"attn{n}"] = first
        results[f"attn{n}_again_equal"] = bool(torch.equal(first[0], second[0]) and torch.equal(first[1], second[1]))
        h0, h1 = tp.head_ranges(HEADS, R)[r]
        results[f"attn{n}_heads"] = dcp.dcp_merge(comm, o, lse, heads=slice(h0, h1))
        results[f"attn{n}_owners"] = dcp.dcp_merge_to_owners(comm, o, lse, tp.head_ranges(HEADS, R))
        results[f"attn{n}_owners3"] = dcp.dcp_merge_to_owners(comm, o, lse, tp.head_ranges(HEADS, 3) + [(HEADS, HEADS)])
        # a bf16 out (the GPU kernel's) travels as bf16: the merge equals the one of its fp32 copy
        seq, sent, real_all_to_all = comm.guard._seq, [], comm.all_to_all
        comm.all_to_all = lambda chunks, name="": sent.append(chunks.numel() * chunks.element_size()) or \
            real_all_to_all(chunks, name)
        results[f"attn{n}_owners_bf16"] = dcp.dcp_merge_to_owners(comm, o.bfloat16(), lse, tp.head_ranges(HEADS, R))
        del comm.all_to_all
        results[f"attn{n}_owners_bf16_collectives"] = comm.guard._seq - seq
        results[f"attn{n}_owners_bf16_bytes"] = sent
        results[f"attn{n}_owners_bf16_widened"] = dcp.dcp_merge_to_owners(comm, o.bfloat16().float(), lse,
                                                                           tp.head_ranges(HEADS, R))

    # sparse selection all on rank 1's positions: every other rank owns none of it
    q, k, v = attention_inputs(40, seed=1)
    selected = torch.arange(1, 40, R)
    mine, slots = own.select_owned(selected)
    o, lse = dcp.attend_reference(q, k[mine], v[mine], SCALE)
    if mine.numel() == 0:
        o = torch.full_like(o, float("nan"))
    results["sparse_one_owner"] = dcp.dcp_merge(comm, o, lse)
    # nobody owns anything: defined as out = 0, lse = -inf
    empty_o = torch.full((HEADS, V_DIM), float("nan"))
    results["all_empty"] = dcp.dcp_merge(comm, empty_o, torch.full((HEADS,), float("-inf")))

    for n, k_sel in TOPK_CASES:
        scores, positions = topk_inputs(n)
        mine = own.owned_positions(0, n)
        results[f"topk{n}_{k_sel}"] = dcp.dcp_topk(comm, scores[:, mine], positions[mine], k_sel)

    for n_heads in MLA_HEADS:  # TP heads + DCP positions on the same ranks (6 heads over 4: 2/2/1/1)
        q_nope, q_rot, kv_b, rows, mask = mla_inputs(n_heads)
        a, b = tp.head_ranges(n_heads, R)[r]
        per_head = kv_b.view(n_heads, MLA_NOPE + MLA_V, MLA_R)
        pos = own.owned_positions(0, MLA_N)
        from glm53.model.indexer import Selection

        results[f"mla{n_heads}"] = one_span_attention(
            comm, q_nope[:, a:b], q_rot[:, a:b], per_head[a:b, :MLA_NOPE].transpose(1, 2).contiguous(),
            per_head[a:b, MLA_NOPE:].contiguous(), rows[pos], Selection.from_mask(mask[:, pos], MLA_N),
            tp.head_ranges(n_heads, R), MLA_SCALE)

    # several tensors in one all-gather: the same as one all-gather each, in one round trip
    mixed = packed_inputs(r)
    seq = comm.guard._seq
    results["packed"] = comm.all_gather_packed(mixed)
    results["packed_collectives"] = comm.guard._seq - seq
    results["packed_separate"] = [comm.all_gather(t) for t in mixed]

    # a 'full' layer's top-k candidates travel with the attention's queries (dcp.PendingSelection):
    # the same output bits as dcp_topk + owned_selection, one collective fewer; a 'shared' layer
    # reusing the resolved selection attends as with a plain one
    n_heads = MLA_HEADS[1]
    q_nope, q_rot, kv_b, rows, _ = mla_inputs(n_heads)
    a, b = tp.head_ranges(n_heads, R)[r]
    per_head = kv_b.view(n_heads, MLA_NOPE + MLA_V, MLA_R)
    w_uk_t, w_uv = per_head[a:b, :MLA_NOPE].transpose(1, 2).contiguous(), per_head[a:b, MLA_NOPE:].contiguous()
    pos = own.owned_positions(0, MLA_N)
    scores, positions = topk_inputs(MLA_N, rows=MLA_T)
    k_sel = 8
    ranges = tp.head_ranges(n_heads, R)
    seq = comm.guard._seq
    plain = dcp.owned_selection(*dcp.dcp_topk(comm, scores[:, pos], positions[pos], k_sel), own, k_sel)
    results["mla_topk_separate"] = one_span_attention(comm, q_nope[:, a:b], q_rot[:, a:b], w_uk_t, w_uv, rows[pos],
                                                        plain, ranges, MLA_SCALE)
    results["mla_topk_separate_collectives"] = comm.guard._seq - seq
    pending = dcp.PendingSelection.of(scores[:, pos], positions[pos], own, k_sel)
    seq = comm.guard._seq
    results["mla_topk_pending"] = one_span_attention(comm, q_nope[:, a:b], q_rot[:, a:b], w_uk_t, w_uv, rows[pos],
                                                       pending, ranges, MLA_SCALE)
    results["mla_topk_pending_collectives"] = comm.guard._seq - seq
    results["mla_topk_selections_equal"] = bool(torch.equal(pending.resolved.indices, plain.indices)
                                                and torch.equal(pending.resolved.valid, plain.valid))
    seq = comm.guard._seq
    results["mla_topk_shared"] = one_span_attention(comm, q_nope[:, a:b], q_rot[:, a:b], w_uk_t, w_uv, rows[pos],
                                                      pending, ranges, MLA_SCALE)
    results["mla_topk_shared_collectives"] = comm.guard._seq - seq

    # a batched step: several sequences' spans of one layer (their own queries, rows and candidates,
    # different row counts) in the same two exchanges; each span's rows get the bits they get alone

    spans = [(q_nope[:, a:b], q_rot[:, a:b], rows[pos], scores),
             (q_nope[1:3, a:b], q_rot[1:3, a:b], rows[pos] * -0.5, -scores[1:3])]

    def candidates(span_scores: torch.Tensor) -> dcp.PendingSelection:
        return dcp.PendingSelection.of(span_scores[:, pos], positions[pos], own, k_sel)

    alone = [one_span_attention(comm, qn, qr, w_uk_t, w_uv, rw, candidates(sc), ranges, MLA_SCALE)
             for qn, qr, rw, sc in spans]
    seq = comm.guard._seq
    results["mla_spans_together"] = dcp.tp_dcp_attention_spans(
        comm, [AttentionSpan(qn, qr, lambda rw=rw: rw, pos, candidates(sc)) for qn, qr, rw, sc in spans], w_uk_t, w_uv,
        ranges, MLA_SCALE)
    results["mla_spans_collectives"] = comm.guard._seq - seq
    results["mla_spans_alone"] = torch.cat(alone)

    # rank 0's draft-window calls as the followers receive them, and what each costs
    from glm53.dist.window_channel import WindowChannel

    channel, received, costs = WindowChannel(comm), [], []
    for op, value, tokens, rows in window_messages():
        seq = comm.guard._seq
        if r == 0:
            channel.send(op, value, tokens, rows)
        else:
            received.append(channel.receive())
        costs.append(comm.guard._seq - seq)
    results["window_received"], results["window_collectives"] = received, costs
    torch.save(results, out / f"rank{r}.pt")


def window_messages() -> list[tuple[int, int, list[int], torch.Tensor | None]]:
    """(op, value, tokens, rows): no tokens, a verification window, exactly the inline capacity,
    one past it, a long list, rows in bf16 with tokens."""
    from glm53.dist.window_channel import WindowChannel as C

    g = torch.Generator().manual_seed(5)
    return [(C.TRUNCATE, 41, [], None), (C.FORWARD, 40, list(range(100, 115)), None),
            (C.FORWARD, 7, list(range(C.INLINE_TOKENS)), None), (C.EMBED, 0, list(range(3, 3 + C.INLINE_TOKENS + 1)), None),
            (C.FORWARD, 2**33, [2**40 + i for i in range(40)], None),
            (C.MTP_FORWARD, 12, [9, 8], torch.randn(2, 6, generator=g).to(torch.bfloat16))]


def packed_inputs(rank: int) -> list[torch.Tensor]:
    """Mixed dtypes and sizes that are not multiples of 8 bytes (the packing pads each piece)."""
    g = torch.Generator().manual_seed(900 + rank)
    return [torch.randn(3, 5, generator=g).to(torch.bfloat16), torch.randint(-2**40, 2**40, (2,), generator=g),
            torch.rand(7, generator=g) < 0.5, torch.randn(2, 3, generator=g), torch.zeros(0, 4)]


MLA_HEADS, MLA_NOPE, MLA_ROPE, MLA_V, MLA_R, MLA_N, MLA_T = (8, 6), 16, 8, 12, 20, 37, 4
MLA_SCALE = (MLA_NOPE + MLA_ROPE) ** -0.5


def mla_inputs(n_heads: int):
    """Queries, kv_b, latent rows and a selection mask (query 3 selects only positions 1, 5: rank 1's)."""
    g = torch.Generator().manual_seed(500 + n_heads)
    q_nope = torch.randn(MLA_T, n_heads, MLA_NOPE, generator=g)
    q_rot = torch.randn(MLA_T, n_heads, MLA_ROPE, generator=g)
    kv_b = torch.randn(n_heads * (MLA_NOPE + MLA_V), MLA_R, generator=g) * 0.3
    rows = torch.randn(MLA_N, MLA_R + MLA_ROPE, generator=g)
    mask = torch.rand(MLA_T, MLA_N, generator=g) < 0.4
    mask[3] = False
    mask[3, [1, 5]] = True
    return q_nope, q_rot, kv_b, rows, mask


def spin(comm: Comm, out: Path) -> None:
    """Collectives in a loop until a peer is killed; 'ready' files tell the test when to kill."""
    t = torch.ones(1024)
    for i in range(10**9):
        comm.all_reduce_sum(t.clone(), name="spin_all_reduce")
        if i == 20:
            (out / f"ready{comm.rank}").write_text(str(os.getpid()))


def stuck(comm: Comm, out: Path) -> None:
    """Rank 1 stays alive (heartbeat on) but never joins the collective the others wait in."""
    if comm.rank == 1:
        (out / "ready1").write_text("")
        time.sleep(120)
    else:
        (out / f"ready{comm.rank}").write_text("")
        comm.all_reduce_sum(torch.ones(4), name="stuck_all_reduce")


def cache_settings(comm: Comm, out: Path) -> None:
    """The same prefix cache settings pass; a disk tier on rank 0 only is refused on every rank."""
    from kv_cache.cache import CacheConfigError
    from kv_cache.engine_adapter import same_settings_over_comm

    same_settings_over_comm(comm, True, True, 16)
    for name, disk, boundary in (("refused", comm.rank == 0, None), ("refused_boundary", True, 16 * (comm.rank == 1))):
        try:
            same_settings_over_comm(comm, True, disk, boundary)
        except CacheConfigError as e:
            (out / f"{name}{comm.rank}").write_text(str(e))


# ---- the model over R ranks (phase 2) ---------------------------------------------------------
PROMPT = [(7 * i + 3) % 1900 + 20 for i in range(45)]  # 45 tokens: past the tiny model's index_topk (32)
STEPS = 64
PREFILL_PIECE = 13  # chunk starts that are not multiples of R


def greedy(model, state, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Prefill in pieces, then greedy decode: (tokens, fp32 logits [steps + 1, vocab])."""
    for a in range(0, len(prompt), PREFILL_PIECE):
        out = model.forward(state, prompt[a:a + PREFILL_PIECE], a)
    rows = [model.logits(out.hidden[-1:])[0]]
    tokens: list[int] = []
    for _ in range(steps):
        tokens.append(int(rows[-1].argmax()))
        out = model.forward(state, [tokens[-1]], state.length)
        rows.append(model.logits(out.hidden)[0])
    return tokens, torch.stack(rows)


def load_model(model_dir: Path, plan):
    from glm53.config import Glm53Config
    from glm53.model.transformer import Glm53Model
    from glm53.loading.loader import load_weights

    cfg = Glm53Config.from_dir(model_dir)
    weights = load_weights(model_dir, cfg, plan=plan, dtype=torch.float32, with_mtp=False, progress=lambda m: None)
    return Glm53Model(cfg, weights, plan, torch.float32)


SHORT_PROMPT = [31, 7]  # at R = 3, 4 some ranks hold no row at all during prefill and the first steps
SHORT_STEPS = 6


def model(comm: Comm, out: Path) -> None:
    """One group, one load of this rank's slices (heads, columns and vocabulary do not depend on
    DCP), then DCP off and on (and, at R = 4, the same request twice) through two plans."""
    from glm53.config import Glm53Config
    from glm53.dist.rank_plan import DistRankPlan
    from glm53.model.transformer import Glm53Model

    model_dir = Path(os.environ["GLM53_TEST_MODEL"])
    cfg = Glm53Config.from_dir(model_dir)
    results: dict[str, object] = {"rank": comm.rank}
    weights = None
    for dcp_on in (False, True):
        plan = DistRankPlan.create(comm, cfg.vocab_size, dcp_on=dcp_on)
        if weights is None:
            weights = load_model(model_dir, plan).w
        m = Glm53Model(cfg, weights, plan, torch.float32)
        state = m.new_state("fp32")  # the model asks its plan: DcpKVState with this rank's positions
        results[f"dcp{int(dcp_on)}"] = greedy(m, state, PROMPT, STEPS)
        own = plan.ownership  # the cache rows this rank keeps (layer 0: a function of the embeddings alone)
        results[f"dcp{int(dcp_on)}_rows"] = (own.owned_positions(0, state.length), state.capacity,
                                             state.latent[0][: own.count(state.length)].clone())
        results[f"dcp{int(dcp_on)}_short"] = greedy(m, m.new_state("fp32"), SHORT_PROMPT, SHORT_STEPS)
        if dcp_on and comm.world_size == 4:  # the same request again, fresh state: same bits
            results["dcp1_again"] = greedy(m, m.new_state("fp32"), PROMPT, STEPS)
    results["q_b_rows"] = weights.layers[0].attn.q_b.shape[0]
    torch.save(results, out / f"rank{comm.rank}.pt")


def nccl(comm: Comm, out: Path) -> None:
    """The collectives and merges on CUDA tensors (NCCL); results saved on the CPU."""
    dev = comm.device
    r, R = comm.rank, comm.world_size
    results: dict[str, object] = {"rank": r, "backend": comm.backend}
    results["all_gather"] = comm.all_gather(torch.tensor([r * 10 + 1.5], device=dev)).cpu()
    own = dcp.Ownership(r, R)
    for n in ATTN_LENGTHS:
        q, k, v = (t.to(dev) for t in attention_inputs(n))
        pos = own.owned_positions(0, n, device=dev)
        o, lse = dcp.attend_reference(q, k[pos], v[pos], SCALE)
        results[f"attn{n}"] = tuple(t.cpu() for t in dcp.dcp_merge(comm, o, lse))
        owners = dcp.dcp_merge_to_owners(comm, o, lse, tp.head_ranges(HEADS, R))
        results[f"attn{n}_owners"] = tuple(t.cpu() for t in owners)
    for n, k_sel in TOPK_CASES:
        scores, positions = topk_inputs(n)
        mine = own.owned_positions(0, n)
        got = dcp.dcp_topk(comm, scores[:, mine].to(dev), positions[mine].to(dev), k_sel)
        results[f"topk{n}_{k_sel}"] = tuple(t.cpu() for t in got)
    torch.save(results, out / f"rank{r}.pt")


def spin_cuda(comm: Comm, out: Path) -> None:
    t = torch.ones(1024, device=comm.device)
    for i in range(10**9):
        comm.all_reduce_sum(t.clone(), name="spin_all_reduce")
        if i == 20:
            torch.cuda.synchronize()
            (out / f"ready{comm.rank}").write_text(str(os.getpid()))


ENGINE_OPTIONS = {"device": "cpu", "dtype": "fp32", "kv_dtype": "fp32", "prefill_chunk": 16, "cache_block": 16}
ENGINE_REQUESTS = [  # (prompt, max_tokens, sampling, cancel after n tokens or None)
    (PROMPT, 20, None, None),
    (PROMPT + [5, 6, 7], 12, None, None),  # extends the live conversation: reuse on every rank alike
    (PROMPT[:40], 30, None, 3),  # rank 0's client goes away after 3 tokens
    (PROMPT[:38], 16, {"temperature": 0.9, "top_p": 0.95}, None),  # seed drawn on rank 0, shared
]


def engine_requests(spec_rank: int, world: int, port: int, out: Path) -> None:
    """RankEngine: rank 0 serves ENGINE_REQUESTS, the others follow; rank 0 saves replies and seeds."""
    from glm53.dist.rank_engine import RankEngine

    from glm53.runtime.errors import EngineError

    eng = RankEngine(os.environ["GLM53_TEST_MODEL"], tp=world, rank=spec_rank, master="127.0.0.1",
                     master_port=port, rendezvous_timeout_s=60, **ENGINE_OPTIONS)
    if eng.rank != 0:
        delay = float(os.environ.get("GLM53_TEST_FOLLOW_DELAY", "0"))  # a follower a little behind rank 0
        while True:
            time.sleep(delay)
            if not eng.follow_one():
                return
    # first what never holds the ranks in step: requests rank 0 refuses, and max_tokens 0 (no
    # collective without a prefix cache); a follower behind must still find every request after them
    for prompt, max_tokens in (([eng.engine.vocab_size + 5], 4), (PROMPT, 10 ** 9)):
        try:
            eng.generate(prompt, max_tokens)
        except EngineError:
            pass
        else:
            raise AssertionError(f"rank 0 accepted a request the engine refuses: {prompt[:3]}, {max_tokens}")
    for _ in range(3):
        assert eng.generate(PROMPT, 0) == []
    replies = []
    for prompt, max_tokens, sampling, cancel in ENGINE_REQUESTS:
        seen: list[int] = []

        def on_tokens(new: list[int], seen=seen, cancel=cancel) -> bool:
            seen.extend(new)
            return cancel is None or len(seen) < cancel

        reply = eng.generate(prompt, max_tokens, sampling, on_tokens)
        replies.append((reply, eng.engine.last_stats["seed"], eng.engine.last_stats["finish_reason"]))
    eng.close()
    torch.save({"replies": replies}, out / "rank0.pt")


# ---- prefix cache and drafting over R ranks (tests/test_multirank_cache_draft.py) -------------------
CACHE_PROMPT = PROMPT  # 45 tokens over a 16-token grid: chunks 0, 1 whole, chunk 2 partial
CACHE_STEPS = 6
DRAFT_PROMPTS = [  # repeated spans, so copy drafts find continuations to propose
    [300, 301, 302, 303, 304, 305, 306, 307] * 3 + [300, 301, 302, 303],  # the tiny model's reply loops
    [11, 12, 13, 14, 15, 16] * 5 + [11, 12],
    [(5 * i) % 37 + 40 for i in range(20)] * 2,
]
DRAFT_STEPS = 20
SEEDED = {"temperature": 0.8, "top_p": 0.9, "seed": 1234}


def cache_draft_cases(reply_of: dict[str, list[int]]) -> list[tuple[str, list[int], int, dict]]:
    """(name, prompt, max_tokens, sampling) in serving order; later prompts extend earlier replies
    (rank 0 passes what it has seen in `reply_of`; the followers receive prompts from rank 0)."""
    p = CACHE_PROMPT
    edited = list(p)
    edited[30] = 1999
    cases = [
        ("base", lambda: p, CACHE_STEPS, {"draft": False}),
        ("append", lambda: p + reply_of["base"] + [5, 6, 7, 8, 9, 10, 11], CACHE_STEPS, {"draft": False}),
        ("resend", lambda: p, CACHE_STEPS, {"draft": False}),
        ("one_word", lambda: p + [99], CACHE_STEPS, {"draft": False}),
        ("edit", lambda: edited, CACHE_STEPS, {"draft": False}),
        ("restore", lambda: p + reply_of["base"] + [5, 6, 7, 8, 9, 10, 11], CACHE_STEPS, {"draft": False}),
    ]
    for i, q in enumerate(DRAFT_PROMPTS):
        for mode, sampling in (("greedy", {}), ("seeded", SEEDED)):
            cases.append((f"drafted{i}_{mode}", lambda q=q: q, DRAFT_STEPS, dict(sampling, draft=True)))
            if i == 0 and mode == "greedy":
                # right after a drafted request: its reply's rows (written by verification, past the
                # frontier) are live and match the new prompt, yet must not be reused
                cases.append(("after_draft", lambda: DRAFT_PROMPTS[0] + reply_of["drafted0_greedy"] + [5, 6],
                              CACHE_STEPS, {"draft": False}))
            cases.append((f"serial{i}_{mode}", lambda q=q: q, DRAFT_STEPS, dict(sampling, draft=False)))
            cases.append((f"scripted{i}_{mode}", lambda q=q: q, DRAFT_STEPS, dict(sampling, draft=True)))
    return cases


class ScriptedDrafts:
    """A draft source for rank 0 that knows the serial replies: it proposes them, every second window
    wrong halfway, so windows are accepted in full and in part (rows of rejected drafts truncated
    on every rank). Followers never see it."""

    name, taps, needs_hidden, max_depth = "scripted", (), False, 6

    def __init__(self, replies: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        self.replies, self.vocab = replies, vocab

    def new_source(self, target: object) -> "ScriptedDrafts":
        self.calls = 0
        return self

    def commit(self, tokens, out=None, kept_rows: int = 0) -> None:
        pass

    def propose(self, tokens, depth: int, sample=None) -> list[int]:
        for prompt, reply in self.replies.items():
            if tuple(tokens[:len(prompt)]) == prompt:
                m = len(tokens) - len(prompt)  # reply tokens committed; the next draft is reply[m]
                drafts = list(reply[m:m + depth])
                self.calls += 1
                if len(drafts) > 1 and self.calls % 2 == 0:  # every second window: wrong halfway
                    drafts[len(drafts) // 2] = (drafts[len(drafts) // 2] + 1) % self.vocab
                return drafts
        return []


def cache_draft(spec_rank: int, world: int, port: int, out: Path) -> None:
    """RankEngine with the prefix cache and copy drafts on every rank (as glm53.cuda_engine builds it):
    the cases warm (one cache, requests in order), then again with TF_GLM53_PREFIX_CACHE=0 (cold: no
    reuse at all). Every rank saves, per case, its rows, its serial logits and its cache stats."""
    from glm53.dist.rank_engine import RankEngine
    from glm53.serving.compose import ServeFeatures
    from kv_cache.engine_adapter import attach_prefix_cache

    eng = RankEngine(os.environ["GLM53_TEST_MODEL"], tp=world, rank=spec_rank, master="127.0.0.1",
                     master_port=port, rendezvous_timeout_s=60, features=ServeFeatures(), **ENGINE_OPTIONS)
    inner = eng.engine
    results: dict[str, object] = {"rank": eng.rank, "drafter": getattr(inner.drafter, "kind", None),
                                  "health": (eng.prefix_cache_enabled, eng.drafting_enabled),
                                  "background_stores": inner.prefix_cache._staging is not None}
    replies: dict[str, list[int]] = {}
    for phase in ("warm", "cold"):
        if phase == "cold":
            attach_prefix_cache(inner, comm=eng.comm, settings=Settings.from_env({"TF_GLM53_PREFIX_CACHE": "0"}))
        got: dict[str, list[int]] = {}
        for name, make, max_tokens, sampling in cache_draft_cases(replies):  # warm replies build later prompts
            inner.trace = []
            stored_before = inner.prefix_cache.stats_dict()["stored_chunks"]  # stats_dict lands pending stores
            started = time.monotonic()
            if eng.rank == 0:
                plan = inner.drafter
                if name.startswith("scripted"):  # the serial reply of this prompt and sampling is known
                    serial = got[name.replace("scripted", "serial")]
                    inner.drafter = ScriptedDrafts({tuple(make()): serial}, inner.vocab_size)
                try:
                    got[name] = eng.generate(make(), max_tokens, sampling)
                finally:
                    inner.drafter = plan
                if phase == "warm":
                    replies[name] = got[name]
            else:
                assert eng.follow_one()
            st = inner.state
            results[f"{phase}/{name}"] = {
                "reply": got.get(name), "stats": dict(inner.last_stats),
                "trace": [(p, row.clone()) for p, row in inner.trace],
                "rows": {k: v.clone() for k, v in st.export_rows(0, st.length).items()},
                "length": st.length, "frontier": st.frontier, "slots": st.slots(0, st.length),
                "stored_chunks": inner.prefix_cache.stats_dict()["stored_chunks"] - stored_before,
                "seconds": time.monotonic() - started}
    results["draft_totals"] = inner.drafter.stats.metrics() if eng.rank == 0 else None
    if eng.rank == 0:
        eng.close()
    else:
        assert not eng.follow_one()
    torch.save(results, out / f"rank{eng.rank}.pt")


# ---- each draft source over R ranks (tests/test_multirank_cache_draft.py) ----------------------------
DRAFT_SOURCES = ("copy", "mtp", "dflash2")
LOOPING_PROMPT = [300, 301, 302, 303, 304, 305, 306, 307, 300, 301, 706, 950]
SOURCE_OPTIONS = dict(ENGINE_OPTIONS, prefill_chunk=4, cache_block=4)  # a fine grid and blocks


def source_prompts(source: str, n: int, vocab: int) -> list[tuple[list[int] | None, int, dict]]:
    """(fresh prompt, or None to extend the previous request's prompt + reply; max_tokens; sampling)."""
    rng = random.Random(f"{source}/{n}")
    cases = []
    for i in range(n):
        fresh = None if i % 3 == 2 else [rng.randrange(vocab) for _ in range(rng.randint(2, 12))]
        max_tokens = rng.randint(2, 6)
        if fresh is not None and i % 4 == 0:  # greedy; the tiny model's greedy reply loops (1956 1785 1762) after
            fresh, max_tokens = LOOPING_PROMPT, 10  # 3 tokens: copy drafts land from the 5th on
        sampling = {} if i % 2 == 0 else {"temperature": 0.8, "top_p": 0.9, "seed": 100 + i}
        cases.append((fresh, max_tokens, sampling))
    return cases


def draft_sources_batched(spec_rank: int, world: int, port: int, out: Path) -> None:
    """RankEngine (prefix cache on, grid 4) switched through copy, MTP and DFlash2 drafts (the plan
    built on every rank), serving through the batched runtime in lockstep (batch_engine): per source,
    rank 0 submits GLM53_TEST_PER_SOURCE requests twice, serial and drafted, in two waves (the fresh
    prompts, then those extending an earlier drafted reply) and saves both replies and the drafting and
    reuse stats; every rank saves its step count. A follower runs each wave as one follow_one()."""
    from drafter.glm53_target import DraftPlan
    from glm53.dist.rank_engine import RankEngine
    from glm53.serving.compose import ServeFeatures

    per_source = int(os.environ["GLM53_TEST_PER_SOURCE"])
    eng = RankEngine(os.environ["GLM53_TEST_MODEL"], tp=world, rank=spec_rank, master="127.0.0.1",
                     master_port=port, rendezvous_timeout_s=60, features=ServeFeatures(), **SOURCE_OPTIONS)
    inner = eng.engine
    results: dict[str, object] = {"rank": eng.rank}
    batch = eng.batch_engine(max_seqs=32, max_waiting=1 << 20, step_tokens=64) if eng.rank == 0 else None
    if eng.rank != 0:
        assert eng.follow_one()  # BATCH_START
    for source in DRAFT_SOURCES:
        started = time.monotonic()
        inner.drafter = DraftPlan.from_contract(inner, drafter=os.environ["GLM53_TEST_DFLASH"] if source == "dflash2"
                                                else None, settings=Settings(draft_source=source), world=world)
        cases = source_prompts(source, per_source, inner.vocab_size)
        rows: list[dict] = [{} for _ in cases]
        for wave in (0, 1):  # fresh prompts first; then each extension of the request before it
            if eng.rank != 0:
                assert eng.follow_one()  # one BATCH_WAKE: the wave runs until the batch is idle
                continue
            seqs = {}
            for i, (fresh, max_tokens, sampling) in enumerate(cases):
                if (fresh is None) != (wave == 1):
                    continue
                prompt = fresh if fresh is not None else cases[i - 1][0][:24] + rows[i - 1]["drafted"] + [7, 8]
                cases[i] = (prompt, max_tokens, sampling) if fresh is None else cases[i]
                for mode in ("serial", "drafted"):
                    seqs[i, mode] = batch.submit(prompt, max_tokens, dict(sampling, draft=mode == "drafted"))
            while not batch.idle:
                batch.step()
            for (i, mode), seq in seqs.items():
                rows[i][mode], rows[i][f"{mode}_stats"] = seq.reply, dict(seq.stats)
        results[source] = {"kind": inner.drafter.kind, "requests": rows, "seconds": time.monotonic() - started,
                           "totals": inner.drafter.stats.metrics() if eng.rank == 0 else None}
    results["steps"] = (batch.batch if batch is not None else eng._batch.batch).steps
    if eng.rank == 0:
        eng.close()
    else:
        assert not eng.follow_one()
    torch.save(results, out / f"rank{eng.rank}.pt")


def draft_sources(spec_rank: int, world: int, port: int, out: Path) -> None:
    """RankEngine (prefix cache on, grid 4) switched through copy, MTP and DFlash2 drafts (the plan
    built on every rank): per source, rank 0 serves GLM53_TEST_PER_SOURCE requests twice, serial then
    drafted, and saves both replies, the drafting and reuse stats; every rank saves its row count."""
    from drafter.glm53_target import DraftPlan
    from glm53.dist.rank_engine import RankEngine
    from glm53.serving.compose import ServeFeatures

    per_source = int(os.environ["GLM53_TEST_PER_SOURCE"])
    eng = RankEngine(os.environ["GLM53_TEST_MODEL"], tp=world, rank=spec_rank, master="127.0.0.1",
                     master_port=port, rendezvous_timeout_s=60, features=ServeFeatures(), **SOURCE_OPTIONS)
    inner = eng.engine
    results: dict[str, object] = {"rank": eng.rank}
    for source in DRAFT_SOURCES:
        started = time.monotonic()
        inner.drafter = DraftPlan.from_contract(inner, drafter=os.environ["GLM53_TEST_DFLASH"] if source == "dflash2"
                                                else None, settings=Settings(draft_source=source), world=world)
        rows, history = [], []
        for fresh, max_tokens, sampling in source_prompts(source, per_source, inner.vocab_size):
            prompt = fresh if fresh is not None else history[:24]
            pair = {}
            for mode in ("serial", "drafted"):
                if eng.rank == 0:
                    pair[mode] = eng.generate(prompt, max_tokens, dict(sampling, draft=mode == "drafted"))
                    pair[f"{mode}_stats"] = dict(inner.last_stats)
                else:
                    assert eng.follow_one()
                pair[f"{mode}_length"] = inner.state.length
            rows.append(pair)
            if eng.rank == 0:
                history = prompt + pair["drafted"] + [7, 8]
        results[source] = {"kind": inner.drafter.kind, "requests": rows, "seconds": time.monotonic() - started,
                           "totals": inner.drafter.stats.metrics() if eng.rank == 0 else None}
    if eng.rank == 0:
        eng.close()
    else:
        assert not eng.follow_one()
    torch.save(results, out / f"rank{eng.rank}.pt")


# ---- several requests at once over R ranks (tests/test_multirank_batch.py) --------------------------
BATCH_OPTIONS = dict(ENGINE_OPTIONS, prefill_chunk=8, cache_block=8)


def batch_requests(n: int, vocab: int, seed: int) -> list[dict]:
    """n requests: prompts of 2-40 tokens, a third extending one of three shared openings; greedy or
    seeded; a third drafted; about one in six cancelled by its client after 2 tokens; an arrival
    step each (a few at once, then more while the first decode)."""
    rng = random.Random(seed)
    openings = [[rng.randrange(vocab) for _ in range(rng.randint(10, 24))] for _ in range(3)]
    out = []
    for i in range(n):
        tail = [rng.randrange(vocab) for _ in range(rng.randint(2, 16))]
        prompt = rng.choice(openings) + tail if rng.random() < 0.35 else tail
        sampling = {} if rng.random() < 0.5 else {"temperature": 0.8, "top_p": 0.9, "seed": rng.randrange(1 << 30)}
        sampling["draft"] = rng.random() < 0.35
        out.append({"prompt": prompt, "max_tokens": rng.randint(3, 12), "sampling": sampling,
                    "cancel_after": 2 if rng.random() < 0.17 else None, "arrival": 0 if i < 4 else rng.randint(0, n)})
    for i, arrival in ((0, 0), (1, 0)):  # two that share an opening while both run: its pages shared in place
        tail = [rng.randrange(vocab) for _ in range(3)]
        out[i].update(prompt=openings[0] + tail, max_tokens=16, cancel_after=None, arrival=arrival,
                      sampling=dict(out[i]["sampling"], ignore_eos=True))
    return out


def batch_ranks(spec_rank: int, world: int, port: int, out: Path) -> None:
    """RankEngine as glm53.cuda_engine builds it (prefix cache, the plan's drafts) serving
    GLM53_TEST_REQUESTS requests twice: alone, one at a time (generate), then through the batched
    runtime (batch_engine) in their arrival schedule with a small pool (preemptions); each client
    that leaves does so after the same tokens. Rank 0 saves both replies; every rank its step count."""
    from glm53.dist.rank_engine import RankEngine
    from glm53.serving.compose import ServeFeatures

    import glm53.ops

    eng = RankEngine(os.environ["GLM53_TEST_MODEL"], tp=world, rank=spec_rank, master="127.0.0.1",
                     master_port=port, rendezvous_timeout_s=60, features=ServeFeatures(), **BATCH_OPTIONS)
    grouped = [0]  # the indexer's calls over a group of windows (several sequences' rows in one call)
    scores_spans = glm53.ops.index_scores_spans

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        grouped[0] += 1
        return scores_spans(*args, **kwargs)

    glm53.ops.index_scores_spans = counted
    if eng.rank != 0:
        eng.follow()
        batch = eng._batch.batch
        torch.save({"rank": eng.rank, "steps": batch.steps, "preempted": batch.scheduler.preempted_total,
                    "grouped": grouped[0],
                    "pool_capacity": batch.pool.capacity, "drafter": eng.engine.drafter.kind,
                    "pages": (batch.pool.store.free_pages, batch.pool.store.usable_pages)}, out / f"rank{eng.rank}.pt")
        return
    requests = batch_requests(int(os.environ["GLM53_TEST_REQUESTS"]), eng.engine.vocab_size, seed=world)

    def leaving_after(n: int | None, seen: list[int]):
        def on_tokens(new: list[int]) -> bool:
            seen.extend(new)
            return n is None or len(seen) < n
        return on_tokens

    alone = []
    for r in requests:
        alone.append((eng.generate(r["prompt"], r["max_tokens"], dict(r["sampling"]),
                                   leaving_after(r["cancel_after"], [])), eng.engine.last_stats["finish_reason"]))
    position_bytes = eng.engine.model.new_state(eng.engine.kv_dtype).bytes_per_position()
    batch = eng.batch_engine(max_seqs=6, pool_bytes=position_bytes * 64, pool_block=8, step_tokens=24)
    pending = sorted(range(len(requests)), key=lambda i: requests[i]["arrival"])
    seqs: dict[int, object] = {}
    most = step = 0
    while pending or not batch.idle:
        while pending and requests[pending[0]]["arrival"] <= step:
            i = pending.pop(0)
            r = requests[i]
            seqs[i] = batch.submit(r["prompt"], r["max_tokens"], dict(r["sampling"]),
                                   leaving_after(r["cancel_after"], []))
        batch.step()
        most = max(most, batch.stats()["running"])
        step += 1
    batched = [(seqs[i].reply, seqs[i].finish_reason, seqs[i].stats.get("cached_tokens", 0),
                seqs[i].stats.get("preemptions", 0), seqs[i].stats.get("shared_tokens", 0)) for i in range(len(requests))]
    stats = batch.stats()
    eng.close()
    torch.save({"rank": 0, "requests": requests, "alone": alone, "batched": batched, "steps": batch.batch.steps,
                "grouped": grouped[0],
                "preempted": stats["preempted_total"], "most_running": most, "pool_capacity": batch.pool.capacity,
                "drafter": eng.engine.drafter.kind, "pages": (batch.pool.store.free_pages, batch.pool.store.usable_pages)},
               out / "rank0.pt")


SCENARIOS = {"suite": suite, "spin": spin, "stuck": stuck, "model": model, "nccl": nccl, "spin_cuda": spin_cuda,
             "cache_settings": cache_settings}
ENGINE_SCENARIOS = {"engine": engine_requests, "cache_draft": cache_draft, "draft_sources": draft_sources,
                    "draft_sources_batched": draft_sources_batched, "batch_ranks": batch_ranks}  # these build their own group


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=sorted([*SCENARIOS, *ENGINE_SCENARIOS]))
    parser.add_argument("--rank", type=int)
    parser.add_argument("--world", type=int)
    parser.add_argument("--port", type=int)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--env", action="store_true", help="rendezvous from MASTER_ADDR/... instead")
    parser.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.scenario in ENGINE_SCENARIOS:
        ENGINE_SCENARIOS[args.scenario](args.rank, args.world, args.port, args.out)
        (args.out / f"done{args.rank}").write_text("")
        return
    if args.env:
        spec = spec_from_env(timeout_s=args.timeout)
    else:
        spec = RendezvousSpec(args.rank, args.world, "127.0.0.1", args.port, timeout_s=args.timeout)
    device = torch.device(f"cuda:{spec.rank}") if args.scenario in ("nccl", "spin_cuda") else torch.device("cpu")
    settings = Settings.from_env()  # this process's entry point: the knobs the test gave it
    comm = rendezvous(spec, device=device, settings=GuardSettings.from_settings(settings),
                      backend=settings.dist_backend)
    SCENARIOS[args.scenario](comm, args.out)
    comm.close()
    (args.out / f"done{comm.rank}").write_text("")


if __name__ == "__main__":
    main()
