"""The engine's exactness properties on the tiny checkpoint (CPU, fp32, grid C = 32).

The forward is row-invariant (glm53.ops), so reuse resumes at any token: rows and logits after a
resume equal a cold prefill bit for bit wherever the resume starts, and a decode step writes the
same row a prefill writes."""
from __future__ import annotations

import random

import torch

from glm53.runtime.engine import prefill_pieces, prefill_waves
from glm53.runtime.errors import EngineError
from glm53.runtime.sampling import SamplingParams
from glm53.settings import SettingsError
from tests.fixtures_tiny import TINY_CHUNK, fresh_engine_state, tiny_dirs, tiny_engine  # noqa: F401


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 2000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _rows_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].contiguous().view(torch.uint8), b[k].contiguous().view(torch.uint8)) for k in a)


def test_grid_pieces_depend_on_absolute_position_only() -> None:
    assert prefill_pieces(0, 70, 32) == [(0, 32), (32, 64), (64, 70)]
    assert prefill_pieces(45, 100, 32) == [(45, 64), (64, 96), (96, 100)]
    assert prefill_pieces(64, 64, 32) == []
    rng = random.Random(7)
    for _ in range(200):  # any range: a partition whose every inner cut is a grid boundary
        c, a = rng.randint(1, 50), rng.randint(0, 300)
        b = a + rng.randint(0, 300)
        ps = prefill_pieces(a, b, c)
        assert sum(e - s for s, e in ps) == b - a
        assert all(ps[i][1] == ps[i + 1][0] for i in range(len(ps) - 1))
        assert all(s // c == (e - 1) // c and (e == b or e % c == 0) for s, e in ps)


def test_unaligned_pieces_run_from_the_start_in_chunks() -> None:
    assert prefill_pieces(45, 100, 32, aligned=False) == [(45, 77), (77, 100)]
    assert prefill_pieces(60, 70, 32, aligned=False) == [(60, 70)]  # crosses 64: one piece, not two
    assert prefill_pieces(64, 64, 32, aligned=False) == []
    rng = random.Random(8)
    for _ in range(200):
        c, a = rng.randint(1, 50), rng.randint(0, 300)
        b = a + rng.randint(0, 300)
        ps = prefill_pieces(a, b, c, aligned=False)
        assert [s for s, _ in ps] == list(range(a, b, c)) and (not ps or ps[-1][1] == b)


def test_waves_group_consecutive_pieces_up_to_their_size() -> None:
    pieces = prefill_pieces(45, 300, 32, aligned=False)
    assert prefill_waves(pieces, 128) == [pieces[0:4], pieces[4:8]]
    assert prefill_waves([(0, 32), (32, 64), (64, 70)], 64) == [[(0, 32), (32, 64)], [(64, 70)]]
    assert prefill_waves([(0, 32), (32, 50)], 16) == [[(0, 32)], [(32, 50)]]  # a piece over the wave: alone
    assert prefill_waves([], 128) == []
    rng = random.Random(9)
    for _ in range(200):
        c, a, w = rng.randint(1, 50), rng.randint(0, 300), rng.randint(1, 200)
        ps = prefill_pieces(a, a + rng.randint(0, 300), c, aligned=False)
        waves = prefill_waves(ps, w)
        assert [p for wave in waves for p in wave] == ps
        assert all(len(wave) == 1 or wave[-1][1] - wave[0][0] <= w for wave in waves)
        assert all(later[-1][1] - earlier[0][0] > w for earlier, later in zip(waves, waves[1:]))  # greedy


def test_prefill_in_waves_gives_one_piece_at_a_times_bits(tiny_dirs) -> None:  # noqa: F811
    """The engine's waves (TF_GLM53_PREFILL_WAVE: pieces' attention apart, the feed-forward blocks
    over the wave at once) against one piece a wave: the same logits and cache rows, bit for bit,
    also after a resume that starts mid-wave; the grid-boundary mode never groups pieces."""
    from glm53.runtime.engine import Glm53Engine

    prompt = _prompt(300, 21)
    got, calls = {}, {}
    for wave in (TINY_CHUNK, 3 * TINY_CHUNK + 5):
        engine = Glm53Engine(tiny_dirs.model, device="cpu", dtype="fp32", kv_dtype="fp32", prefill_chunk=TINY_CHUNK,
                             prefill_wave=wave)
        seen, forward_wave = [], engine.model.forward_wave

        def counted(state, tokens, pieces, taps=(), forward_wave=forward_wave, seen=seen):
            if len(pieces) > 1:  # forward() is a wave of one piece
                seen.append(list(pieces))
            return forward_wave(state, tokens, pieces, taps)

        engine.model.forward_wave = counted
        engine.trace = []
        engine.generate(prompt[:110], 1, {"ignore_eos": True})
        engine.generate(prompt, 1, {"ignore_eos": True})  # resumes at 110
        rows = engine.state.export_rows(0, len(prompt))
        got[wave], calls[wave] = ([t[1] for t in engine.trace], rows), seen
    assert calls[TINY_CHUNK] == []
    assert calls[3 * TINY_CHUNK + 5] == [[(0, 32), (32, 64), (64, 96)], [(110, 142), (142, 174), (174, 206)],
                                         [(206, 238), (238, 270), (270, 300)]]
    assert all(torch.equal(a, b) for a, b in zip(got[TINY_CHUNK][0], got[3 * TINY_CHUNK + 5][0]))
    assert _rows_equal(got[TINY_CHUNK][1], got[3 * TINY_CHUNK + 5][1])
    grid = Glm53Engine(tiny_dirs.model, device="cpu", dtype="fp32", kv_dtype="fp32", prefill_chunk=TINY_CHUNK,
                       prefill_wave=4 * TINY_CHUNK, prefix_reuse_boundary="1")
    assert grid.wave == TINY_CHUNK


def test_a_bad_wave_size_is_refused(tiny_dirs, monkeypatch) -> None:  # noqa: F811
    import pytest

    from glm53.runtime.engine import Glm53Engine

    monkeypatch.setenv("TF_GLM53_PREFILL_WAVE", "lots")  # built without settings: the environment's
    with pytest.raises(SettingsError, match="TF_GLM53_PREFILL_WAVE='lots': expected a positive integer"):
        Glm53Engine(tiny_dirs.model, device="cpu")
    monkeypatch.delenv("TF_GLM53_PREFILL_WAVE")
    with pytest.raises(EngineError, match="TF_GLM53_PREFILL_WAVE=0: expected a positive integer"):
        Glm53Engine(tiny_dirs.model, device="cpu", prefill_wave=0)  # an option: the engine's error


def test_a_short_turn_across_a_grid_boundary_is_one_forward_and_the_same_bits(tiny_dirs) -> None:  # noqa: F811
    """Row-invariant ops: a turn of fewer than C new tokens that crosses a multiple of C is one
    forward (the grid-boundary mode runs two), and its logits are the grid mode's bits."""
    from glm53.runtime.engine import Glm53Engine

    prompt = _prompt(80, 16)
    first, second = 60, 70  # new tokens [60, 70) cross TINY_CHUNK's multiple 64
    assert first < (first // TINY_CHUNK + 1) * TINY_CHUNK < second and second - first < TINY_CHUNK
    forwards, logits = {}, {}
    for mode in ("0", "1"):
        engine = Glm53Engine(tiny_dirs.model, device="cpu", dtype="fp32", kv_dtype="fp32", prefill_chunk=TINY_CHUNK,
                             prefix_reuse_boundary=mode)
        engine.generate(prompt[:first], 1, {"ignore_eos": True})
        calls, forward = [], engine.forward

        def counted(state, tokens, start, taps=(), forward=forward, calls=calls):
            calls.append((start, len(tokens)))
            return forward(state, tokens, start, taps)

        engine.forward = counted
        engine.trace = []
        engine.generate(prompt[:second], 1, {"ignore_eos": True})
        forwards[mode], logits[mode] = calls, engine.trace[0][1]
        assert engine.last_stats["cached_tokens"] == (first if mode == "0" else first // TINY_CHUNK * TINY_CHUNK)
    assert forwards["0"] == [(first, second - first)]
    assert len(forwards["1"]) >= 2
    assert torch.equal(logits["0"], logits["1"])


def test_same_request_twice_gives_bitwise_same_logits_and_tokens(tiny_engine) -> None:  # noqa: F811
    prompt = _prompt(70, 1)
    runs = []
    for _ in range(2):
        with fresh_engine_state(tiny_engine, reuse_live=False):
            tiny_engine.trace = []
            tokens = tiny_engine.generate(prompt, 12, {"ignore_eos": True})
            runs.append((tokens, torch.stack([row for _, row in tiny_engine.trace])))
    assert runs[0][0] == runs[1][0]
    assert torch.equal(runs[0][1], runs[1][1])


def test_resume_from_rows_of_a_shorter_request_is_bitwise_a_cold_prefill(tiny_engine) -> None:  # noqa: F811
    """Rows [0, s) kept from an earlier request that ended at an arbitrary s (45: inside chunk 1; 1;
    63: one short of a boundary) plus the resumed prefill equal, bit for bit, a cold prefill of the
    whole prompt: every row and the first logits. The engine resumes at s itself."""
    prompt = _prompt(100, 2)
    with fresh_engine_state(tiny_engine):
        tiny_engine.trace = []
        tiny_engine.generate(prompt, 1, {"ignore_eos": True})
        cold_rows = {k: v.clone() for k, v in tiny_engine.state.export_rows(0, 100).items()}
        cold_logits = tiny_engine.trace[0][1]
        assert tiny_engine.state.frontier == 100
    for s in (1, 45, 63, 64, 99):
        with fresh_engine_state(tiny_engine):
            tiny_engine.generate(prompt[:s], 1, {"ignore_eos": True})  # leaves rows [0, s), frontier s
            assert tiny_engine.state.frontier == s
            tiny_engine.trace = []
            tiny_engine.generate(prompt, 1, {"ignore_eos": True})
            assert tiny_engine.last_stats["cached_tokens"] == s
            assert _rows_equal(tiny_engine.state.export_rows(0, 100), cold_rows), f"resume after {s} rows"
            assert torch.equal(tiny_engine.trace[0][1], cold_logits)


def test_restored_rows_from_outside_resume_like_a_cold_run(tiny_engine) -> None:  # noqa: F811
    """The prefix cache's path: rows [0, 64) imported into a fresh state, then the rest prefilled."""
    prompt = _prompt(90, 3)
    with fresh_engine_state(tiny_engine):
        tiny_engine.generate(prompt, 1, {"ignore_eos": True})
        cold = {k: v.clone() for k, v in tiny_engine.state.export_rows(0, 90).items()}
        restored = {k: v.clone() for k, v in tiny_engine.state.export_rows(0, 64).items()}
    with fresh_engine_state(tiny_engine):
        state = tiny_engine.model.new_state(tiny_engine.kv_dtype)
        state.import_rows(0, restored, prompt[:64])
        tiny_engine.state = state
        tiny_engine.generate(prompt, 1, {"ignore_eos": True})
        assert tiny_engine.last_stats["cached_tokens"] == 64
        assert _rows_equal(tiny_engine.state.export_rows(0, 90), cold)


def test_decode_rows_are_beyond_the_frontier_and_not_reused(tiny_engine) -> None:  # noqa: F811
    prompt = _prompt(40, 4)
    with fresh_engine_state(tiny_engine):
        reply = tiny_engine.generate(prompt, 30, {"ignore_eos": True})
        assert tiny_engine.state.frontier == 40 and tiny_engine.state.length == 40 + 29
        follow_up = prompt + reply + _prompt(5, 5)
        tiny_engine.generate(follow_up, 1, {"ignore_eos": True})
        assert tiny_engine.last_stats["cached_tokens"] == 40  # the frontier, not 69


def test_a_decode_step_writes_the_row_a_prefill_writes(tiny_engine) -> None:  # noqa: F811
    """Row invariance end to end: the rows decode writes for the reply equal, bit for bit, the rows a
    cold prefill of prompt + reply writes (they are still never reused: the frontier rule stands)."""
    prompt = _prompt(40, 14)
    with fresh_engine_state(tiny_engine, reuse_live=False):
        reply = tiny_engine.generate(prompt, 12, {"ignore_eos": True})
        decoded = {k: v.clone() for k, v in tiny_engine.state.export_rows(0, 51).items()}
        tiny_engine.generate(prompt + reply[:11], 1, {"ignore_eos": True})
        assert _rows_equal(tiny_engine.state.export_rows(0, 51), decoded)


def test_grid_boundary_mode_floors_reuse_to_the_grid(tiny_dirs) -> None:  # noqa: F811
    """TF_GLM53_PREFIX_REUSE_BOUNDARY=1 (for ops that are not row-invariant) keeps the old rule:
    reuse floored to a multiple of the prefill grid; results are the same bits either way."""
    from glm53.runtime.engine import Glm53Engine

    prompt = _prompt(80, 15)
    got = {}
    for mode in ("1", "0"):
        engine = Glm53Engine(tiny_dirs.model, device="cpu", dtype="fp32", kv_dtype="fp32", prefill_chunk=TINY_CHUNK,
                             prefix_reuse_boundary=mode)
        engine.generate(prompt[:45], 1, {"ignore_eos": True})
        engine.trace = []
        engine.generate(prompt, 1, {"ignore_eos": True})
        got[mode] = (engine.last_stats["cached_tokens"], engine.trace[0][1])
    assert got["1"][0] == 32 and got["0"][0] == 45
    assert torch.equal(got["1"][1], got["0"][1])


def test_seeded_sampling_is_keyed_by_seed_and_position(tiny_engine) -> None:  # noqa: F811
    prompt = _prompt(30, 6)
    params = {"temperature": 1.0, "top_p": 0.95, "top_k": 50, "seed": 1234, "ignore_eos": True}
    with fresh_engine_state(tiny_engine, reuse_live=False):
        a = tiny_engine.generate(prompt, 16, params)
        b = tiny_engine.generate(prompt, 16, params)
        c = tiny_engine.generate(prompt, 16, {**params, "seed": 99})
        unseeded = tiny_engine.generate(prompt, 16, {**params, "seed": None})
        drawn = tiny_engine.last_stats["seed"]
        again = tiny_engine.generate(prompt, 16, {**params, "seed": drawn})
    assert a == b and a != c
    assert isinstance(drawn, int) and unseeded == again


def test_fp8_latent_cache_runs_deterministically_close_to_fp32(tiny_dirs) -> None:  # noqa: F811
    from glm53.runtime.engine import Glm53Engine

    prompt = _prompt(50, 7)
    results = {}
    for kv in ("fp32", "fp8"):
        engine = Glm53Engine(tiny_dirs.reference, device="cpu", dtype="fp32", kv_dtype=kv, prefill_chunk=TINY_CHUNK,
                             reuse_live=False)
        engine.trace = []
        engine.generate(prompt, 4, SamplingParams(ignore_eos=True))
        first = engine.trace[0][1]
        engine.trace = []
        engine.generate(prompt, 4, SamplingParams(ignore_eos=True))
        assert torch.equal(engine.trace[0][1], first)
        results[kv] = (first, engine.state)
    state = results["fp8"][1]
    assert state.latent[0].dtype == torch.float8_e4m3fn and state.latent_scale[0].shape[0] >= 50
    assert state.bytes_per_position() < results["fp32"][1].bytes_per_position() / 3
    assert (results["fp8"][0] - results["fp32"][0]).abs().max() < 0.25  # fp8 rows: ~2^-4 relative error


def test_mtp_layer_runs_window_or_row_by_row_alike(tiny_engine) -> None:  # noqa: F811
    """The MTP layer (stored as layer num_hidden_layers) over its own cache: a window of rows equals
    the same rows fed one at a time, bit for bit (row-invariant ops)."""
    model = tiny_engine.model
    assert model.w.mtp is not None, "the tiny checkpoint has one MTP layer"
    prompt = _prompt(40, 8)
    with torch.inference_mode():
        state = model.new_state("fp32")
        hidden = model.forward(state, prompt, 0).hidden
        window_state = model.new_mtp_state("fp32")
        logits, mtp_hidden = model.mtp_forward(window_state, hidden[:-1], prompt[1:], 0)
        assert logits.shape == (39, tiny_engine.cfg.vocab_size) and mtp_hidden.shape == hidden[:-1].shape
        row_state = model.new_mtp_state("fp32")
        rows = [model.mtp_forward(row_state, hidden[i:i + 1], prompt[i + 1:i + 2], i)[0] for i in range(39)]
    assert torch.equal(torch.cat(rows), logits)
    assert window_state.length == row_state.length == 39


def test_bf16_compute_with_fp8_cache_generates_deterministically(tiny_dirs) -> None:  # noqa: F811
    from glm53.runtime.engine import Glm53Engine

    engine = Glm53Engine(tiny_dirs.reference, device="cpu", dtype="bf16", kv_dtype="fp8", prefill_chunk=TINY_CHUNK,
                         reuse_live=False)
    prompt = _prompt(45, 9)
    a = engine.generate(prompt, 5, {"ignore_eos": True})
    b = engine.generate(prompt, 5, {"ignore_eos": True})
    assert a == b and len(a) == 5
    assert engine.state.latent[0].dtype == torch.float8_e4m3fn
