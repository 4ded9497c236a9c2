"""The GLM-5.3 engine behind TensorFold's family contract (and the kit's own front).

`generate` serves one request at a time (several at once: `batch_engine()`, glm53/runtime). It
keeps the KV rows of the last conversation (`self.state`) so the next request that extends it
prefills only the new tokens
(reuse ends at the canonical prefill frontier: any token, since the forward is row-invariant), and
it hands its rows to an optional prefix cache (kv_cache.PrefixCache) for longer-lived reuse.
See docs/engine.md.

Knobs: the Settings fields device, dtype, kv_dtype, prefill_chunk, prefill_wave, cache_block,
prefix_reuse_boundary, cuda_graphs and kernels (glm53/settings.py: TF_GLM53_DEVICE, ...; the
defaults and how "auto" resolves are described there). Keyword options of the same names win over
them; the engine keeps the result as `engine.settings`, which the batched runtime, the prefix cache
and the draft plan built on it read.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from drafter.decode_loop import StopRule, drafted_decode
from drafter.policy import AdaptiveDepth, PolicyConfig
from drafter.target import WindowOutput
from glm53 import ops
from glm53.config import Glm53Config
from glm53.layout.plan import plan_layout
from glm53.loading.loader import load_weights
from glm53.model.exl3_layers import choose_decode_forms, decode_scratch_needs
from glm53.model.kv_state import KVState
from glm53.model.memory import report_line, weights_report
from glm53.model.parallel import RankPlan
from glm53.model.transformer import ForwardOutput, Glm53Model
from glm53.runtime.batch import BatchEngine
from glm53.runtime.cuda_graphs import WindowGraphs
from glm53.runtime.features import Drafting, DraftWindows, EngineFeatures, PrefixCache
from glm53.runtime.grammar import GrammarMatcher
from glm53.runtime.logits_policy import LogitsPolicy, policy_for
from glm53.runtime.errors import EngineError
from glm53.runtime.options import with_options
from glm53.runtime.sampling import SamplingParams
from glm53.runtime.state_target import StateTarget
from glm53.settings import Settings

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
OnTokens = Callable[[list[int]], Any]


def _wait_for(t: torch.Tensor) -> None:
    """Block until the device has computed `t` (a host timestamp taken after queueing its kernels
    would time the launches, not the work; sampling waits for it next anyway)."""
    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()


def prefill_pieces(start: int, stop: int, chunk: int, aligned: bool = True) -> list[tuple[int, int]]:
    """[start, stop) in pieces of at most `chunk` positions. aligned: cut at every multiple of
    `chunk`, so chunk k covers [kC, (k+1)C) whatever the prompt's length and wherever the run
    starts (what exact reuse needs where a row's arithmetic depends on its piece). Not aligned:
    consecutive pieces from `start` (row-invariant ops give every row the same bits under any cut,
    and a run of up to C new tokens is then one forward, not two when it crosses a multiple of C)."""
    pieces, pos = [], start
    while pos < stop:
        end = min((pos // chunk + 1) * chunk if aligned else pos + chunk, stop)
        pieces.append((pos, end))
        pos = end
    return pieces


def prefill_waves(pieces: list[tuple[int, int]], wave: int) -> list[list[tuple[int, int]]]:
    """Consecutive pieces grouped in order, each group at most `wave` positions (a piece longer
    than that alone)."""
    waves: list[list[tuple[int, int]]] = []
    for a, b in pieces:
        if waves and b - waves[-1][0][0] <= wave:
            waves[-1].append((a, b))
        else:
            waves.append([(a, b)])
    return waves


class _Cancelled(Exception):
    """on_tokens returned False: the client went away."""


class Glm53Target(StateTarget):
    """The drafter's Target protocol (drafter/target.py) over this engine's model and one state.
    Positions below `prompt_length` are canonical prefill (grid pieces, they move the frontier);
    later positions are decode / draft verification (same arithmetic, never reused)."""

    def __init__(self, engine: "Glm53Engine", state: KVState, prompt_length: int) -> None:
        super().__init__(engine, state)
        self.prompt_length = prompt_length
        self.forwards = 0

    def forward(self, tokens: Sequence[int], start: int, *, taps: Sequence[int] = ()) -> WindowOutput:
        outs = self.engine.run(self.state, list(tokens), start, self.prompt_length, taps=tuple(taps), all_logits=True)
        self.forwards += 1
        hidden = torch.cat([o.hidden for o in outs])
        taken = {k: torch.cat([o.taps[k] for o in outs]) for k in taps}
        return WindowOutput(start=start, logits=self.engine.model.logits(hidden), hidden=hidden, taps=taken)


class Glm53Engine:
    def __init__(self, model_dir: str | Path, *, drafter: Drafting | None = None, tp: int = 1, rank: int = 0,
                 master: str = "127.0.0.1", master_port: int = 29551, no_drafts: bool = False,
                 mtp_drafts: int | None = None, device: str | None = None, dtype: str | None = None,
                 kv_dtype: str | None = None, prefill_chunk: int | None = None, prefill_wave: int | None = None,
                 cache_block: int | None = None,
                 prefix_reuse_boundary: str | None = None, prefix_cache: PrefixCache | None = None,
                 plan: RankPlan | None = None, reuse_live: bool = True, cuda_graphs: str | None = None,
                 progress: Callable[[str], None] | None = None, settings: Settings | None = None,
                 features: EngineFeatures | None = None, window_channel: DraftWindows | None = None,
                 **unknown: Any) -> None:
        if unknown:
            raise EngineError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
        if tp < 1 or not 0 <= rank < tp:
            raise EngineError(f"--tp {tp} --rank {rank}: ranks run 0..tp-1")
        self.model_dir = Path(model_dir)
        self.cfg = Glm53Config.from_dir(model_dir)
        # built without settings (a library caller): the environment's, parsed here once
        self.settings = s = with_options(
            Settings.from_env() if settings is None else settings, device=device, dtype=dtype, kv_dtype=kv_dtype,
            prefill_chunk=prefill_chunk, prefill_wave=prefill_wave, cache_block=cache_block,
            prefix_reuse_boundary=prefix_reuse_boundary, cuda_graphs=cuda_graphs)
        ops.use_kernels(s.kernels)
        self.device = torch.device(s.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        on_gpu = self.device.type == "cuda"
        self.dtype_name = s.dtype or ("bf16" if on_gpu else "fp32")
        self.kv_dtype = s.kv_dtype
        self.chunk = s.prefill_chunk or (2048 if on_gpu else 256)
        self.cache_block = s.cache_block
        boundary = s.prefix_reuse_boundary
        if boundary == "auto":
            boundary = "0" if ops.row_invariant(self.device) else "1"
        # None: reuse resumes at any token (row-invariant ops); else at a multiple of the prefill grid
        self.reuse_boundary: int | None = self.chunk if boundary == "1" else None
        # a wave's rows get each piece's bits only where the ops are row-invariant: else one piece a wave
        wave = s.prefill_wave or 4 * self.chunk
        self.wave = wave if self.reuse_boundary is None else self.chunk
        self.plan = plan or RankPlan(world=tp, rank=rank)
        self.master, self.master_port = master, master_port
        self.drafter: Drafting | None = drafter
        self.no_drafts, self.mtp_drafts = no_drafts, mtp_drafts
        self.prefix_cache: PrefixCache | None = prefix_cache
        self.reuse_live = reuse_live
        weights = load_weights(model_dir, self.cfg, plan=self.plan, dtype=DTYPES[self.dtype_name],
                               device=self.device, progress=progress or (lambda s: None))
        self.model = Glm53Model(self.cfg, weights, self.plan, DTYPES[self.dtype_name], self.device)
        self.memory = self._memory_report(weights, progress or (lambda s: None))
        self.graphs = self._window_graphs(s.cuda_graphs)
        self.eos: list[int] = list(self.cfg.eos_token_ids)
        self.vocab_size = self.cfg.vocab_size
        self.state: KVState | None = None  # the retained conversation
        self.last_stats: dict[str, Any] = {}
        self.trace: list[tuple[int, torch.Tensor]] | None = None  # tests: set to [] to record (position, logits)
        # over several ranks (glm53.dist.window_channel.WindowChannel): rank 0 announces its draft
        # windows, the other ranks replay them; None at one rank
        self.window_channel = window_channel
        if features is not None:  # the composition root's drafts and prefix cache, built on the loaded model
            if drafter is None:
                self.drafter = features.drafting(self)
            if prefix_cache is None:
                self.prefix_cache = features.prefix_cache(self)

    def _memory_report(self, weights: Any, say: Callable[[str], None]) -> dict[str, Any]:
        """Reserve the EXL3 kernels' workspace for decode windows (before any graph is captured) and
        report what the rank holds against the layout plan's bytes for it (logged; /health shows it)."""
        workspace = 0
        if self.device.type == "cuda" and ops.kernel_choice() != "torch":
            from glm53.ops import triton_exl3  # heavy optional dependency: Triton, on CUDA only

            needs = decode_scratch_needs(weights, triton_exl3.DECODE_ROWS, self.cfg.num_experts_per_tok)
            workspace = triton_exl3.reserve(needs, self.device) if needs else 0
            if needs:
                say(choose_decode_forms(weights, DTYPES[self.dtype_name]))
        planned = plan_layout(self.model_dir, self.plan.world, self.cfg).bytes_per_rank()[self.plan.rank]
        report = weights_report(weights, planned, workspace)
        say(report_line(report))
        return report

    def _window_graphs(self, choice: str) -> WindowGraphs | None:
        if choice == "0":
            return None
        graphs = WindowGraphs(self.model)
        reason = graphs.why_not(self.model.new_state(self.kv_dtype), 1)
        if reason is None:
            return graphs
        if choice == "1":
            raise EngineError(f"TF_GLM53_CUDA_GRAPHS=1 but a decode step cannot be captured here: {reason}; "
                              "set it to auto or 0")
        return None

    def forward(self, state: KVState, tokens: list[int], start: int, taps: tuple[int, ...] = ()) -> ForwardOutput:
        """One forward of the model: a captured graph for a short window where one applies, else eager."""
        if self.graphs is not None:
            out = self.graphs.forward(state, tokens, start, taps)
            if out is not None:
                return out
        return self.model.forward(state, tokens, start, taps)

    def forward_batch(self, items: list[tuple[KVState, list[int]]], taps: tuple[int, ...] = ()) -> list[ForwardOutput]:
        """Several sequences' windows in one forward (Glm53Model.forward_batch): captured graphs where each
        sequence has one window and every window is short or a prefill piece beside short ones, else eager."""
        if self.graphs is not None:
            outs = self.graphs.forward_batch([(state, tokens, state.length) for state, tokens in items], taps)
            if outs is not None:
                return outs
        return self.model.forward_batch(items, taps)

    # ---- the forward over a window, split into canonical prefill pieces and decode rows -------
    @torch.inference_mode()
    def run(self, state: KVState, tokens: list[int], start: int, prompt_length: int, *,
            taps: tuple[int, ...] = (), all_logits: bool = False) -> list[ForwardOutput]:
        """Forward `tokens` at [start, start + n): rows below prompt_length in prefill pieces (canonical
        prefill, advancing the frontier when contiguous with it; grid pieces in the grid-boundary
        mode), the rest in one window (decode or draft verification: the same arithmetic, but never
        offered for reuse)."""
        outs: list[ForwardOutput] = []
        stop = start + len(tokens)
        split = max(start, min(stop, prompt_length))
        # the absolute grid only where reuse stops at it (ops that are not row-invariant)
        pieces = prefill_pieces(start, split, self.chunk, aligned=self.reuse_boundary is not None)
        for wave in prefill_waves(pieces, self.wave):
            (a, _), (_, b) = wave[0], wave[-1]
            if len(wave) == 1:
                outs.append(self.forward(state, tokens[a - start:b - start], a, taps))
            else:
                outs.extend(self.model.forward_wave(state, tokens[a - start:b - start], wave, taps))
            for a, b in wave:
                if state.frontier == a:
                    state.frontier = b
        if split < stop:
            outs.append(self.forward(state, tokens[split - start:], split, taps))
        return outs

    # ---- reuse ------------------------------------------------------------------------------
    def _state_for(self, prompt: list[int], prompt_ids: np.ndarray | None = None) -> tuple[KVState, int]:
        """A state holding reusable rows for a prefix of `prompt` (prompt_ids: the same as an int64
        array, when the caller has it), and how many rows it holds."""
        state = self.state if self.state is not None else self.model.new_state(self.kv_dtype)
        if self.prefix_cache is not None:
            ids = prompt_ids if prompt_ids is not None else prompt
            hit = self.prefix_cache.lookup(ids, live_tokens=state.token_ids(), live_frontier=state.frontier)
            state.truncate(hit.live_tokens)
            if hit.reused_tokens > hit.live_tokens:  # room for the prompt at once, not a doubling per restored block
                state.reserve(len(prompt))
            # disk rows are read as they are restored; a file that fails verification ends them early
            reused = hit.restore(lambda start, n, rows: state.import_rows(start, rows, prompt[start:start + n]),
                                 device=state.device)
            state.truncate(reused)
            return state, reused
        if not self.reuse_live:
            state.truncate(0)
            return state, 0
        common = 0
        for a, b in zip(state.tokens, prompt):
            if a != b:
                break
            common += 1
        # within the canonical extent, leaving the last prompt token to compute
        n = max(0, min(common, state.frontier, len(prompt) - 1))
        if self.reuse_boundary is not None:
            n = (n // self.reuse_boundary) * self.reuse_boundary
        state.truncate(n)
        return state, n

    def store_prefix(self, prompt: list[int] | np.ndarray, state: KVState) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.store(prompt, min(state.frontier, len(prompt)), state.export_rows)

    # ---- the contract -------------------------------------------------------------------------
    def _params(self, sampling: Any) -> SamplingParams:
        if sampling is None:
            return SamplingParams()
        if isinstance(sampling, SamplingParams):
            return sampling
        if isinstance(sampling, dict):
            return SamplingParams.from_request(sampling)
        raise EngineError(f"sampling must be SamplingParams, a dict or None; got {type(sampling).__name__}")

    def _check_prompt(self, prompt: Any, max_tokens: Any) -> tuple[list[int], np.ndarray]:
        """The prompt as a list and as an int64 array (the prefix cache's form, converted once)."""
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise EngineError("prompt must be a non-empty list of token ids")
        # exact types (bool is not an id), then the range on the array: C loops only (19k tokens:
        # ~1.4 ms on a slow core, against ~2 ms for a Python type test and min/max over the list)
        ids = None
        if set(map(type, prompt)) == {int}:
            try:
                ids = np.array(prompt, dtype=np.int64)
            except OverflowError:
                ids = None
        if ids is None or int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            bad = next(t for t in prompt if type(t) is not int or not 0 <= t < self.vocab_size)
            raise EngineError(f"prompt token {bad!r} is not an id in [0, {self.vocab_size})")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise EngineError(f"max_tokens must be an integer >= 0, got {max_tokens!r}")
        if len(prompt) + max_tokens > self.cfg.max_position_embeddings:
            raise EngineError(f"prompt ({len(prompt)}) + max_tokens ({max_tokens}) exceed the context "
                              f"({self.cfg.max_position_embeddings} positions)")
        return list(prompt), ids

    @torch.inference_mode()
    def generate(self, prompt: list[int], max_tokens: int, sampling: Any = None,
                 on_tokens: OnTokens | None = None) -> list[int]:
        """Decide up to max_tokens tokens after `prompt`. `on_tokens(new)` gets each decided batch;
        returning False stops the request. An eos token ends the reply and is part of it (unless
        ignore_eos). Returns the reply; `last_stats` describes the request."""
        prompt, prompt_ids = self._check_prompt(prompt, max_tokens)
        params = self._params(sampling).with_seed()
        policy = self._policy(params, prompt)
        t0 = time.perf_counter()
        state, cached = self._state_for(prompt, prompt_ids)
        self.state = state
        stats: dict[str, Any] = {"prompt_tokens": len(prompt), "cached_tokens": cached, "completion_tokens": 0,
                                 "prefill_tokens": len(prompt) - cached, "seed": params.seed,
                                 "finish_reason": "length", "drafted": False}
        if params.logprobs is not None:  # TokenLogprob per decided token, filled before on_tokens sees it
            stats["logprobs"] = []
        self.last_stats = stats
        reply: list[int] = []
        eos = frozenset(self.eos)
        if max_tokens == 0:
            return reply
        use_drafts = self.will_draft(params)
        taps = tuple(getattr(self.drafter, "taps", ()) or ()) if use_drafts else ()
        outs = self.run(state, prompt[cached:], cached, len(prompt), taps=taps)
        logits = self.model.logits(outs[-1].hidden[-1:])[0]
        _wait_for(logits)  # the first token's logits exist: until here the device may still be computing
        t_first = time.perf_counter()
        stats["ttft_s"] = t_first - t0
        stats["drafted"] = use_drafts
        try:
            if use_drafts:
                reply = self._drafted(state, prompt, cached, outs, logits, policy, max_tokens, eos, on_tokens, stats)
            else:
                reply = self._serial(state, prompt, logits, policy, max_tokens, eos, on_tokens, stats)
        finally:
            stats["completion_tokens"] = len(reply)
            stats["decode_s"] = time.perf_counter() - t_first
        # after the reply, off the time to first token: decode and verification write only past the
        # frontier, so the prompt's canonical rows are still what prefill wrote
        self.store_prefix(prompt_ids, state)
        return reply

    def _policy(self, params: SamplingParams, prompt: list[int]) -> LogitsPolicy:
        """The request's logits processing (glm53/runtime/logits_policy.py): the one sampler of both loops."""
        def grammar(text: str) -> Any:
            return GrammarMatcher(text, self.model_dir, self.vocab_size, tuple(self.eos))

        for token in params.logit_bias or ():
            if not 0 <= token < self.vocab_size:
                raise EngineError(f"logit_bias names token {token}, not an id in [0, {self.vocab_size})")
        return policy_for(params, prompt, self.vocab_size, grammar)

    @staticmethod
    def _publish_logprobs(policy: LogitsPolicy, stats: dict, new: int) -> None:
        """Append the records of the `new` tokens just decided to stats["logprobs"] (when asked for)."""
        out = stats.get("logprobs")
        if out is not None:
            first = policy.start + len(out)
            out.extend(policy.logprobs_at(range(first, first + new)))

    def will_draft(self, params: SamplingParams) -> bool:
        """Whether a request with these (resolved) sampling parameters decodes drafted."""
        return self.drafter is not None and params.draft and not self.no_drafts

    def _serial(self, state: KVState, prompt: list[int], logits: torch.Tensor, policy: LogitsPolicy,
                max_tokens: int, eos: frozenset[int], on_tokens: OnTokens | None, stats: dict) -> list[int]:
        reply: list[int] = []
        params = policy.params
        pos = len(prompt)
        while True:
            if self.trace is not None:
                self.trace.append((pos, logits.clone()))
            token = policy.choose(logits, pos)
            reply.append(token)
            self._publish_logprobs(policy, stats, 1)
            if token in eos and not params.ignore_eos:
                stats["finish_reason"] = "stop"
                return reply
            if on_tokens is not None and on_tokens([token]) is False:
                stats["finish_reason"] = "cancelled"
                return reply
            if len(reply) >= max_tokens:
                return reply
            out = self.forward(state, [token], pos)
            logits = self.model.logits(out.hidden[-1:])[0]
            pos += 1

    def _drafted(self, state: KVState, prompt: list[int], cached: int, outs: list[ForwardOutput],
                 logits: torch.Tensor, policy: LogitsPolicy, max_tokens: int, eos: frozenset[int],
                 on_tokens: OnTokens | None, stats: dict) -> list[int]:
        """Drafted decoding through drafter.decode_loop.drafted_decode, handed the prefill this engine
        already ran (`prefilled`: hidden states and taps for rows [cached, len(prompt)); of the logits
        only the last row is computed, the others are a stride-0 view of it, since the loop reads only
        the last). `self.drafter` is a DraftSource or a factory (drafter.glm53_target.DraftPlan).
        Over several ranks (`window_channel`) rank 0 runs the loop and the others replay its windows."""
        reply: list[int] = []

        def forward_tokens(new: list[int]) -> None:
            reply.extend(new)
            self._publish_logprobs(policy, stats, len(new))
            if on_tokens is not None and on_tokens(new) is False:
                raise _Cancelled

        hidden = torch.cat([o.hidden for o in outs])
        taps = {k: torch.cat([o.taps[k] for o in outs]) for k in (outs[0].taps if outs else {})}
        prefilled = WindowOutput(start=cached, logits=logits[None].expand(hidden.shape[0], -1), hidden=hidden,
                                 taps=taps)
        target = Glm53Target(self, state, len(prompt))
        channel = self.window_channel
        if channel is not None and not channel.leader:
            channel.follow_windows(target)  # rank 0 drafts, accepts and samples; this rank replays
            stats["draft"] = {}
            return []
        if channel is not None:
            target = channel.lead(target)
        try:
            return self._drafted_loop(target, state, prompt, prefilled, policy, max_tokens, eos, forward_tokens,
                                      reply, stats)
        finally:
            if channel is not None:
                target.end()

    def _drafted_loop(self, target: Any, state: KVState, prompt: list[int], prefilled: Any, policy: LogitsPolicy,
                      max_tokens: int, eos: frozenset[int], forward_tokens: Callable[[list[int]], None],
                      reply: list[int], stats: dict) -> list[int]:
        params = policy.params
        try:
            result = drafted_decode(target, prompt, policy.choose, StopRule(max_tokens, eos, params.ignore_eos),
                                    self.drafter, policy=self.depth_policy(params), on_tokens=forward_tokens,
                                    prefilled=prefilled)
            stats["draft"] = result.stats.metrics() if hasattr(result.stats, "metrics") else {}
            if result.tokens and result.tokens[-1] in eos and not params.ignore_eos:
                stats["finish_reason"] = "stop"
            return result.tokens
        except _Cancelled:
            stats["finish_reason"] = "cancelled"
            state.truncate(min(state.length, len(prompt) + len(reply) - 1))
            return reply

    def depth_policy(self, params: SamplingParams) -> AdaptiveDepth:
        """The drafter's depth policy for a request, from the engine's settings (TF_GLM53_DRAFT_MAX_DEPTH,
        _EWMA, _RELAXED_TOP2), with relaxed top-2 off where the request processes logits or asks for
        logprobs (it keeps drafts the processed row may forbid, a grammar's, and that the policy's state
        and records never saw). The one rule of both drafted loops (here and glm53/runtime/drafted.py)."""
        config = PolicyConfig.from_settings(self.settings)
        if config.relaxed_top2 and (params.processes_logits or params.logprobs is not None):
            config = dataclasses.replace(config, relaxed_top2=False)
        return AdaptiveDepth(config)

    def batch_engine(self, **options: Any) -> BatchEngine | None:
        """The batched runtime over this engine's model (glm53.runtime.BatchEngine: several requests
        at once over one KV pool, each reply the bits `generate` gives it alone), or None where it
        does not run: one rank of several (RankEngine.batch_engine serves them), or ops that are not
        row-invariant (the grid-boundary mode, where a row's bits depend on its batch); requests there
        run one at a time through `generate`."""
        if self.plan.world != 1 or self.reuse_boundary is not None:
            return None
        return BatchEngine(self, **options)

    def follow(self) -> None:
        """The loop of a non-zero rank, executing what rank 0 decides. World 1: nothing to follow."""
        if self.plan.world == 1:
            return
        raise EngineError(f"this engine holds one rank of {self.plan.world} alone; several ranks run "
                          "glm53.dist.rank_engine.RankEngine (glm53.cuda_engine builds it with tp > 1)")
