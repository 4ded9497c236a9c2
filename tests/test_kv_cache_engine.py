"""Prefix reuse through the real glm53 engine on the tiny checkpoint: bitwise against cold runs.

For randomized prompts and the extension patterns of an agent conversation (append, identical
resend, one-word extension, an edit in the middle, a multi-turn chat re-rendered by the chat
template), every KV row and every logit computed after the reused prefix equals a cold run bit
for bit, and so do the replies; reuse is token-exact (up to the edit, up to the frontier), never
floored to a grid. TF_GLM53_PREFIX_CACHE=0 gives identical replies. The disk tier restores exact
rows. On the real model, chunking derived from the prompt's length cannot break exactness (the ops
are row-invariant); with plain matmuls in their place it does, and the grid rule still protects.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

from glm53.serving.front.chat import ChatText
from glm53.runtime.engine import Glm53Engine
from glm53.model.kv_state import KVState
from glm53.settings import Settings
from kv_cache import chain_hashes
from kv_cache import diskfile
from kv_cache.disk import SUFFIX
from kv_cache.engine_adapter import attach_prefix_cache, cache_key_for
from kv_cache.restore import node_bytes
from tests.fixtures_tiny import tiny_dirs  # noqa: F401  (the session's one tiny checkpoint)

C = 16  # prefill grid
B = 8  # cache block: prompts of 40-60 tokens span several blocks and a tail

GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def engine(tiny_dirs) -> Glm53Engine:  # noqa: F811
    # the serving defaults on a CPU (fp32 compute, bf16 latent cache), a small grid and block
    return Glm53Engine(tiny_dirs.model, device="cpu", dtype="fp32", kv_dtype="bf16", prefill_chunk=C, cache_block=B)


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


class Run:
    """One generate call, with the prefill's hidden states captured from engine.run."""

    def __init__(self, engine: Glm53Engine, prompt: list[int], max_tokens: int, sampling: dict) -> None:
        captured = []
        real_run = engine.run

        def run(*args, **kwargs):
            outs = real_run(*args, **kwargs)
            if not captured:
                captured.extend(outs)
            return outs

        engine.run = run
        try:
            self.reply = engine.generate(list(prompt), max_tokens, dict(sampling))
        finally:
            del engine.run
        self.stats = dict(engine.last_stats)
        self.cached = self.stats["cached_tokens"]
        # rows [cached, len), per prefill piece as the engine computes them (one head GEMM over
        # all rows at once would tile differently from one per piece)
        self.logits = torch.cat([engine.model.logits(o.hidden) for o in captured])
        state = engine.state
        self.rows = {k: v.clone() for k, v in state.export_rows(0, state.length).items()}


def cold(engine: Glm53Engine, prompt: list[int], max_tokens: int, sampling: dict) -> Run:
    """The same request on an engine with no reuse at all (fresh state, no cache)."""
    saved = engine.state, engine.prefix_cache, engine.reuse_live
    engine.state, engine.prefix_cache, engine.reuse_live = None, None, False
    try:
        return Run(engine, prompt, max_tokens, sampling)
    finally:
        engine.state, engine.prefix_cache, engine.reuse_live = saved


def assert_exact(warm: Run, ref: Run, what: str) -> None:
    assert warm.reply == ref.reply, what
    assert ref.cached == 0
    n = warm.cached
    assert torch.equal(raw(warm.logits), raw(ref.logits[n:])), f"{what}: logits after {n} reused rows differ"
    assert warm.rows.keys() == ref.rows.keys()
    for name in ref.rows:
        assert torch.equal(raw(warm.rows[name]), raw(ref.rows[name])), f"{what}: rows {name} differ"


def conversation(rng: random.Random, vocab: int, earlier: list[list[int]]):
    """(name, prompt builder from the previous prompt and reply) for each pattern."""
    def rand(n):
        return [rng.randrange(3, vocab) for _ in range(n)]
    return [
        ("first turn", lambda p, r: rand(rng.randint(40, 60))),
        ("append a turn", lambda p, r: p + r + rand(rng.randint(20, 40))),
        ("identical resend", lambda p, r: list(p)),
        ("one-word extension", lambda p, r: p + [rng.randrange(3, vocab)]),
        ("edit in the middle", lambda p, r: p[:len(p) // 2] + [(p[len(p) // 2] + 1) % vocab] + p[len(p) // 2 + 1:]),
        ("unrelated prompt", lambda p, r: rand(30)),
        ("back to the earlier conversation (host tier)", lambda p, r: earlier[0] + rand(5)),
    ]


def run_patterns(engine: Glm53Engine, seed: int, environ: dict | None = None) -> None:
    cache = attach_prefix_cache(engine, revision="tiny-test", settings=Settings.from_env(environ or {}))
    engine.state = None
    rng = random.Random(seed)
    prompt, reply, earlier = [], [], []
    reused, lengths = {}, {}
    for name, build in conversation(rng, engine.vocab_size, earlier):
        previous = prompt
        prompt = build(prompt, reply)
        if name == "edit in the middle":
            earlier.append(prompt)
        warm = Run(engine, prompt, 3, GREEDY)
        assert_exact(warm, cold(engine, prompt, 3, GREEDY), name)
        reply = warm.reply
        reused[name], lengths[name] = warm.cached, (len(previous), len(prompt))
    # token-exact reuse: the previous prompt's canonical rows, never its reply's decode rows
    assert reused["first turn"] == 0 and reused["unrelated prompt"] == 0
    assert reused["append a turn"] == lengths["append a turn"][0]
    assert reused["identical resend"] == lengths["identical resend"][1] - 1  # one token left to compute
    assert reused["one-word extension"] == lengths["one-word extension"][0]
    assert reused["edit in the middle"] == lengths["edit in the middle"][0] // 2  # exactly up to the edit
    assert reused["back to the earlier conversation (host tier)"] == len(earlier[0])  # blocks and tail
    s = cache.stats_dict()
    assert s["host_tokens"] == len(earlier[0]) and s["hits"] >= 5 and s["misses"] >= 2


def test_reuse_is_bitwise_for_every_extension_pattern(engine):
    run_patterns(engine, 20261129)


def test_reuse_is_bitwise_with_background_stores(engine):
    """Stores finished on the background thread (the GPU default, kv_cache/staging.py): the
    unrelated prompt overwrites the live rows right after a store, the earlier conversation
    comes back from the host tier."""
    run_patterns(engine, 20261201, {"TF_GLM53_STORE_STAGING_BYTES": "4M"})
    assert engine.prefix_cache._staging is not None


def test_a_restore_reserves_room_for_the_prompt_once(engine, monkeypatch):
    """600 tokens (75 blocks) back from the host tier into a fresh state: the cache grows once,
    to the prompt's length, not by doubling as blocks arrive (each doubling copies every row so
    far: 1.85x slower at 78 layers on the CPU, bench/bench_restore.py); the rows and logits are
    still a cold run's."""
    attach_prefix_cache(engine, revision="tiny-test", settings=Settings())
    rng = random.Random(6)
    prompt = [rng.randrange(3, engine.vocab_size) for _ in range(600)]
    engine.state = None
    Run(engine, prompt, 1, GREEDY)  # stored in the host tier
    engine.state = None  # another conversation's state: everything comes from the host tier
    grown, real = [], KVState.reserve

    def spy(self, n):
        before = self.capacity
        real(self, n)
        if self.capacity != before:
            grown.append(self.capacity)
    monkeypatch.setattr(KVState, "reserve", spy)
    warm = Run(engine, prompt + [7], 1, GREEDY)
    monkeypatch.undo()
    assert warm.cached == 600 and grown == [601]
    assert_exact(warm, cold(engine, prompt + [7], 1, GREEDY), "restore into a fresh state")


def rounds_env(engine: Glm53Engine) -> dict[str, str]:
    """A staging buffer of about two blocks' rows: stores of several blocks go in rounds."""
    block_bytes = engine.cache_block * engine.model.new_state(engine.kv_dtype).position_bytes()
    return {"TF_GLM53_STORE_STAGING_BYTES": str(2 * block_bytes + 4096)}


def assert_rounds(engine: Glm53Engine) -> None:
    staging = engine.prefix_cache._staging
    stores = engine.prefix_cache.stats.stored_chunks
    assert staging is not None and stores > 0
    assert staging.rounds > 0 and staging._buf.numel() <= staging.capacity
    requests = len(conversation(random.Random(0), 10, [[]]))  # one store each
    assert staging.rounds > requests, f"{staging.rounds} rounds for {requests} stores: none took several"


def test_reuse_is_bitwise_with_stores_in_rounds(engine):
    """Stores larger than the staging buffer go through it in rounds (a long turn of a deep model)."""
    run_patterns(engine, 20261202, rounds_env(engine))
    assert_rounds(engine)


@pytest.mark.gpu
def test_reuse_is_bitwise_on_cuda_with_stores_in_rounds(tiny_dirs):  # noqa: F811
    """The same on CUDA: each round's copies queued on the stream into the pinned buffer."""
    gpu_engine = Glm53Engine(tiny_dirs.model, device="cuda", prefill_chunk=C, cache_block=B)
    for seed in (4, 5):
        run_patterns(gpu_engine, seed, rounds_env(gpu_engine))
        assert_rounds(gpu_engine)
        assert gpu_engine.prefix_cache._staging._buf.is_pinned()


@pytest.mark.gpu
def test_reuse_is_bitwise_on_cuda(tiny_dirs):  # noqa: F811
    """The same patterns with the engine's GPU defaults (bf16 compute, bf16 cache)."""
    gpu_engine = Glm53Engine(tiny_dirs.model, device="cuda", prefill_chunk=C)
    for seed in (1, 2, 3):
        run_patterns(gpu_engine, seed)
    assert gpu_engine.dtype_name == "bf16"
    # the GPU default: stores through pinned staging, copied on the stream, landed in the background
    # (the unrelated prompt overwrote the rows right after such a store; the earlier conversation
    # then came back from the host tier bitwise)
    cache = gpu_engine.prefix_cache
    assert cache._staging is not None and cache.stats_dict()["stored_chunks"] > 0
    assert cache._staging._buf.is_pinned() and cache._staging._buf.numel() == 128 << 20  # pinned at start-up
    node = cache.host.nodes()[0]
    assert all(t.device.type == "cpu" and not t.is_pinned() for t in node.rows.values())
    # the restore ring was pinned at start-up at a node's size and the host-tier restores used it
    # as it was (a buffer too small is replaced by a larger one at the restore)
    restorer = cache._restorer
    ring = node_bytes(cache.key.chunk_size, gpu_engine.model.new_state(gpu_engine.kv_dtype).position_bytes())
    assert restorer.nodes_packed > 0
    assert all(b is not None and b.is_pinned() and b.numel() == ring for b in restorer._buffers)
    assert diskfile.plan(node.rows)[1] <= ring


def test_multi_turn_chat_rerendered_by_the_template(engine):
    text = ChatText(engine.model_dir)
    attach_prefix_cache(engine, revision="tiny-test", settings=Settings())
    engine.state = None
    sampling = {"temperature": 0.8, "seed": 11}
    messages = [{"role": "system", "content": "You are terse."}]
    users = ["What is the capital of France?", "And of Germany? Answer in one word.",
             "Now write a short poem about the sea, four lines.", "Thanks."]
    for i, user in enumerate(users):
        messages.append({"role": "user", "content": user})
        prompt = text.encode(text.render(messages))
        warm = Run(engine, prompt, 6, sampling)
        assert_exact(warm, cold(engine, prompt, 6, sampling), f"turn {i + 1}")
        if i:
            assert warm.cached > 0, f"turn {i + 1} reused nothing"
        # the next turn re-renders this reply from its text: its ids may differ from the decoded ones
        messages.append({"role": "assistant", "content": text.decode(warm.reply)})


def test_attaching_a_new_cache_closes_the_previous_one(engine, tmp_path):
    """A re-attached engine (a server re-configured, a test) must not leave the old cache's disk
    writer thread and tier alive until the process exits."""
    import threading

    def writers() -> int:
        return sum(t.name == "kv_cache-disk-writer" for t in threading.enumerate())

    env = {"TF_GLM53_DISK_CACHE": str(tmp_path), "TF_GLM53_DISK_CACHE_BYTES": "64M"}
    before = writers()
    caches = [attach_prefix_cache(engine, revision="tiny-test", settings=Settings.from_env(env)) for _ in range(4)]
    assert writers() == before + 1 and caches[-1] is engine.prefix_cache
    assert all(c._writer is None for c in caches[:-1])
    attach_prefix_cache(engine, revision="tiny-test", settings=Settings())
    assert writers() == before


def test_a_store_that_fails_does_not_fail_the_request(engine, monkeypatch, caplog):
    """The store runs after the reply is decoded: a failure in its copy (host memory, say) is
    logged and the store dropped; the reply stands, and the next request is exact."""
    import kv_cache.cache as cache_mod

    cache = attach_prefix_cache(engine, revision="tiny-test", settings=Settings())
    engine.state = None
    rng = random.Random(12)
    prompt = [rng.randrange(3, engine.vocab_size) for _ in range(45)]
    real = cache_mod.rows_to_host

    def failing(rows):
        raise MemoryError("injected: no host memory for the store")

    monkeypatch.setattr(cache_mod, "rows_to_host", failing)
    warm = Run(engine, prompt, 3, GREEDY)
    assert_exact(warm, cold(engine, prompt, 3, GREEDY), "the request whose store failed")
    assert "store of" in caplog.text and len(cache.host) == 0
    monkeypatch.setattr(cache_mod, "rows_to_host", real)
    engine.state = None  # no live rows: the next request can only reuse what a store kept
    Run(engine, prompt, 1, GREEDY)
    engine.state = None
    again = Run(engine, prompt + [5], 2, GREEDY)
    assert again.cached > 0
    assert_exact(again, cold(engine, prompt + [5], 2, GREEDY), "after a failed store")


def test_prefix_cache_off_gives_identical_replies(engine):
    rng = random.Random(5)
    base = [rng.randrange(3, engine.vocab_size) for _ in range(50)]
    prompts = [base, base + [7, 8, 9], base + [7, 8, 9] + [rng.randrange(3, 99) for _ in range(20)]]
    replies = {}
    for flag in ("1", "0"):
        switch = Settings.from_env({"TF_GLM53_PREFIX_CACHE": flag})
        cache = attach_prefix_cache(engine, revision="tiny-test", settings=switch)
        engine.state = None
        replies[flag] = [engine.generate(p, 4, dict(GREEDY)) for p in prompts]
        if flag == "0":
            assert cache.stats.lookups == 0 and engine.last_stats["cached_tokens"] == 0
        else:
            assert engine.last_stats["cached_tokens"] > 0
    assert replies["1"] == replies["0"]


def test_disk_tier_restores_exact_rows_after_a_restart(engine, tmp_path):
    env = {"TF_GLM53_DISK_CACHE": str(tmp_path), "TF_GLM53_DISK_CACHE_BYTES": "64M"}
    first = attach_prefix_cache(engine, revision="tiny-test", settings=Settings.from_env(env))
    engine.state = None
    rng = random.Random(9)
    prompt = [rng.randrange(3, engine.vocab_size) for _ in range(70)]
    Run(engine, prompt, 2, GREEDY)
    first.close()  # what process exit does: pending background writes finish
    # a new cache over the same folder (empty host tier) and no live rows: as after a restart
    cache = attach_prefix_cache(engine, revision="tiny-test", settings=Settings.from_env(env))
    engine.state = None
    longer = prompt + [5, 6]
    warm = Run(engine, longer, 3, GREEDY)
    assert warm.cached == 70 and cache.stats.disk_tokens == 70  # eight blocks and the 6-token tail
    assert_exact(warm, cold(engine, longer, 3, GREEDY), "disk resume")
    # the restore ring a GPU pins at start-up (restore.node_bytes) holds any of these files
    ring = node_bytes(B, engine.model.new_state(engine.kv_dtype).position_bytes())
    files = list((tmp_path / cache.key.digest().hex()).glob("*" + SUFFIX))
    assert len(files) == 9 and max(f.stat().st_size for f in files) <= ring
    # another revision never matches these files
    other = attach_prefix_cache(engine, revision="another-model", settings=Settings.from_env(env))
    engine.state = None
    assert Run(engine, longer, 1, GREEDY).cached == 0 and other.stats.misses == 1


def disk_resume(engine, folder, corrupt_block: int | None) -> tuple[Run, object]:
    """Fill a disk tier with a 70-token prompt (8 blocks of 8 and a tail), restart the cache, flip
    one payload bit of block `corrupt_block`'s file (None: none), and resume a longer prompt with
    one reader thread (a ring of two buffers for nine files): the reply, rows and logits must be
    a cold run's."""
    env = {"TF_GLM53_DISK_CACHE": str(folder), "TF_GLM53_DISK_CACHE_BYTES": "64M", "TF_GLM53_DISK_CACHE_THREADS": "1"}
    first = attach_prefix_cache(engine, revision="tiny-test", settings=Settings.from_env(env))
    engine.state = None
    rng = random.Random(21)
    prompt = [rng.randrange(3, engine.vocab_size) for _ in range(70)]
    Run(engine, prompt, 2, GREEDY)
    first.close()
    if corrupt_block is not None:
        victim = folder / first.key.digest().hex() / (chain_hashes(first.key, prompt)[corrupt_block].hex() + SUFFIX)
        data = bytearray(victim.read_bytes())
        data[-3] ^= 0x20
        victim.write_bytes(bytes(data))
    cache = attach_prefix_cache(engine, revision="tiny-test", settings=Settings.from_env(env))
    engine.state = None
    longer = prompt + [5, 6]
    warm = Run(engine, longer, 3, GREEDY)
    assert_exact(warm, cold(engine, longer, 3, GREEDY), f"disk resume, block {corrupt_block} corrupt")
    return warm, cache


def test_a_disk_file_failing_verification_at_restore_is_prefilled_instead(engine, tmp_path):
    """Disk files are read while the rows are restored: a bad one ends the restore at its block and
    the engine prefills from there, bitwise a cold run, reporting what it really reused."""
    warm, cache = disk_resume(engine, tmp_path, corrupt_block=3)
    # warm.cached is the request's own cached_tokens (what the response reports)
    assert warm.cached == 3 * B and cache.stats.disk_tokens == 3 * B and cache.disk.quarantined == 1


@pytest.mark.gpu
def test_disk_resume_is_bitwise_on_cuda(tiny_dirs, tmp_path):  # noqa: F811
    """On CUDA the files go through pinned buffers and one transfer each into a device scratch
    buffer; the ring of two is refilled only after each transfer has finished."""
    gpu_engine = Glm53Engine(tiny_dirs.model, device="cuda", prefill_chunk=C, cache_block=B)
    warm, cache = disk_resume(gpu_engine, tmp_path / "whole", corrupt_block=None)
    assert warm.cached == 70 and cache._restorer.files_read == 9
    # the ring was pinned when the cache opened over the files (start-up), not in the request
    assert all(b is not None and b.is_pinned() for b in cache._restorer._buffers)
    assert len({b.data_ptr() for b in cache._restorer._buffers}) == 2
    warm, cache = disk_resume(gpu_engine, tmp_path / "corrupt", corrupt_block=5)
    assert warm.cached == 5 * B and cache.disk.quarantined == 1


def test_key_follows_engine_settings(engine):
    k = cache_key_for(engine, revision="r")
    assert (k.chunk_size, k.kv_dtype, k.compute_dtype, k.ranks, k.rank, k.dcp) == (B, "bf16", "fp32", 1, 0, False)
    assert ("prefill_grid", str(C)) in k.extra and ("numerics", "row-invariant-1") in k.extra
    assert k.device_kind.startswith("cpu/")
    assert not any(name in ("kernels", "triton") for name, _ in k.extra)  # the CPU path runs no Triton


def test_key_follows_the_engine_source(engine, tmp_path):
    """Any change to the engine's Python source changes the key's numerics_source (so a kit upgrade
    never reuses rows of the old arithmetic, bumped tag or not); the same source, the same digest."""
    import shutil
    from pathlib import Path

    import glm53
    from kv_cache.engine_adapter import numerics_source

    copy = tmp_path / "glm53"
    shutil.copytree(Path(glm53.__file__).resolve().parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    before = numerics_source(copy)
    assert before == numerics_source() and ("numerics_source", before) in cache_key_for(engine, revision="r").extra
    ops_file = copy / "ops" / "torch_ops.py"
    ops_file.write_text(ops_file.read_text() + "\n# an edit\n")
    assert numerics_source(copy) != before
    ops_file.unlink()
    assert numerics_source(copy) != before


def test_key_names_the_kernel_stack(monkeypatch):
    """On CUDA the kernels in use, Triton's version and its FP-contraction default are part of the
    key: a Triton upgrade, TRITON_DEFAULT_FP_FUSION or TF_GLM53_KERNELS=torch can change a row's bits
    while torch's version stays, and rows written under one must never be reused under another; on
    the CPU, MKL's code path and reproducibility mode as the environment sets them.
    (kernel_stack needs no GPU: it reads the device type, the kernels the ops run (glm53.ops, set
    from TF_GLM53_KERNELS when an engine is built), the environment and the installed packages.)"""
    from importlib import metadata

    from kv_cache.engine_adapter import kernel_stack

    pytest.importorskip("triton")
    from glm53 import ops

    monkeypatch.setattr(ops, "_kernels", "auto")
    monkeypatch.delenv("TRITON_DEFAULT_FP_FUSION", raising=False)
    triton_stack = dict(kernel_stack("cuda"))
    assert triton_stack == {"kernels": "triton", "triton": metadata.version("triton"), "triton_fp_fusion": "default"}
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    assert dict(kernel_stack("cuda"))["triton_fp_fusion"] == "0"
    ops.use_kernels("torch")  # what an engine built with TF_GLM53_KERNELS=torch sets
    assert kernel_stack("cuda") == (("kernels", "torch"),)
    monkeypatch.delenv("MKL_CBWR", raising=False)
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    assert kernel_stack("cpu") == (("mkl_enable_instructions", "AVX2"), ("mkl_cbwr", "default"))


def _prefill(engine, prompt, chunk, state=None, start=0):
    state = state or engine.model.new_state(engine.kv_dtype)
    saved = engine.chunk
    engine.chunk = chunk
    try:
        outs = engine.run(state, prompt[start:], start, len(prompt))
    finally:
        engine.chunk = saved
    return state, torch.cat([engine.model.logits(o.hidden) for o in outs])


def _reuse_exact(engine, chunk_for) -> bool:
    """Prefill A with chunk_for(len(A)), keep its rows up to a boundary of that tiling, resume B
    (= A extended) with chunk_for(len(B)); compare with B cold under chunk_for(len(B))."""
    rng = random.Random(3)
    a = [rng.randrange(3, engine.vocab_size) for _ in range(45)]
    b = a + [rng.randrange(3, engine.vocab_size) for _ in range(30)]
    ca, cb = chunk_for(len(a)), chunk_for(len(b))
    state_a, _ = _prefill(engine, a, ca)
    reuse = (len(a) // ca) * ca
    state_a.truncate(reuse)
    warm, warm_logits = _prefill(engine, b, cb, state_a, reuse)
    ref, ref_logits = _prefill(engine, b, cb)
    rows_same = all(torch.equal(raw(x), raw(y)) for x, y in zip(warm.export_rows(0, len(b)).values(),
                                                               ref.export_rows(0, len(b)).values()))
    return rows_same and torch.equal(raw(warm_logits), raw(ref_logits[reuse:]))


def test_length_dependent_chunking_cannot_break_exactness_with_row_invariant_ops(engine):
    assert _reuse_exact(engine, lambda n: C)  # the grid
    assert _reuse_exact(engine, lambda n: math.ceil(n / 2))  # two chunks sized from the length
    assert _reuse_exact(engine, lambda n: 7 if n < 50 else 13)


def test_length_dependent_chunking_breaks_exactness_with_plain_matmuls(engine, monkeypatch):
    """The regression the grid exists for, on the real model: with MKL's plain products in place of
    the padded ones (rows then depend on the product's row count), chunks sized from the prompt's
    length make the reused rows differ from a cold run, and the fixed grid keeps them exact."""
    from glm53.ops import torch_ops

    monkeypatch.setattr(torch_ops, "linear", lambda x, w: x @ w.T)
    monkeypatch.setattr(engine, "wave", 1)  # one piece a wave, as the grid-boundary mode runs (waves need row invariance)
    assert _reuse_exact(engine, lambda n: C)  # the grid
    assert not _reuse_exact(engine, lambda n: math.ceil(n / 2))
    monkeypatch.setattr(engine, "wave", 4 * C)  # waves regroup the feed-forward rows: why that mode has none
    assert not _reuse_exact(engine, lambda n: C)
