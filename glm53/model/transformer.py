"""The GLM-5.3 decoder stack: embedding, decoder layers (MLA + DSA indexer, dense MLP or MoE), final
norm and head; and the MTP layer (mtp.py) on top when the checkpoint has one.

`Glm53Model.forward(state, tokens, start)` runs tokens at absolute positions [start, start + T) on
top of the cache rows [0, start), writes their rows and returns the hidden states. The arithmetic is
the same for a prefill piece, a decode step and a verification window: every op is row-invariant
(glm53.ops), so a row's bits do not depend on T or on where the forward starts. The engine decides
chunking (memory) and which rows count as canonical prefill (the prefix cache's frontier).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from glm53.config import Glm53Config
from glm53.model.kv_state import KVState
from glm53 import ops
from glm53.model.indexer import (IndexerWeights, Selection, index_head_weights, index_scores, index_scores_spans,
                                 indexer_keys, indexer_queries, selects_without_sync)
from glm53.model.mla import AttentionWeights, latent_rows, output_projection, project_queries
from glm53.model.moe import MLPWeights, MoEWeights
from glm53.model.norm import rms_norm
from glm53.model.paged_kv import BatchSlots, PagedKVState, PageStore
from glm53.model.parallel import AttentionSpan, RankPlan
from glm53.model.rope import inverse_frequencies, rope_angles

@dataclass
class LayerWeights:
    index: int  # cache layer index
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    attn: AttentionWeights
    indexer: IndexerWeights | None  # None on 'shared' layers
    ffn: MLPWeights | MoEWeights


@dataclass
class MtpWeights:
    enorm: torch.Tensor
    hnorm: torch.Tensor
    eh_proj: torch.Tensor  # [hidden, 2 * hidden] (or an EXL3 linear): input is [enorm(embed(next token)) | hnorm(hidden)]
    layer: LayerWeights
    head_norm: torch.Tensor
    head: torch.Tensor | None  # None: the main head (shared)
    embed: torch.Tensor | None  # None: the main embedding (shared)


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [vocab (this rank's rows), hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    head: torch.Tensor  # [vocab (this rank's rows), hidden]
    mtp: MtpWeights | None = None
    bytes_read: int | None = None  # checkpoint bytes this rank read (R > 1: exactly its planned slices)
    exl3_bytes: int = 0  # the packed EXL3 banks on the device (trellis, sign vectors, tables)
    dense_from_exl3: dict[str, int] = field(default_factory=dict)  # linears decoded at load -> bytes


@dataclass(frozen=True)
class Span:
    """Where a forward's rows go and which cache rows its queries read.

    positions [T]: the absolute positions of the window's rows (on the model's device). start: the
    first of them as a host int (the eager forward: slice writes), or None (a graph-captured window:
    writes by index, nothing read back to the host). key_bound: the queries score and attend over
    cache rows [0, key_bound), key_bound >= the window's end; rows past the window lie in every
    query's future, so they score -inf and are never selected: the same selection, whatever the
    bound (index_scores is key-invariant). nan_flag: None (NaN scores raise at once) or a device
    bool the selection or-s NaN into, checked after the layers (by the eager forward on a GPU,
    or by whoever replays the graph)."""

    positions: torch.Tensor
    start: int | None
    key_bound: int
    nan_flag: torch.Tensor | None = None


@dataclass
class ForwardOutput:
    hidden: torch.Tensor  # [T, hidden] after the final norm (what the head reads)
    last_layer: torch.Tensor  # [T, hidden] before the final norm
    taps: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> its output [T, hidden]


class Glm53Model:
    def __init__(self, cfg: Glm53Config, weights: ModelWeights, plan: RankPlan | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        self.cfg = cfg
        self.w = weights
        self.plan = plan or RankPlan()
        self.dtype = dtype
        self.device = torch.device(device)
        self.inv_freq = inverse_frequencies(cfg).to(self.device)

    # ---- caches ---------------------------------------------------------------------------
    def new_state(self, kv_dtype: str = "bf16") -> KVState:
        """A fresh cache for one sequence, as the rank plan lays it out."""
        return self.plan.new_state(self, kv_dtype)

    def new_paged_state(self, store: PageStore) -> PagedKVState:
        """An empty sequence in pages of a KV pool's store, as the rank plan lays it out."""
        return self.plan.new_paged_state(store)

    def new_mtp_state(self, kv_dtype: str = "bf16") -> KVState:
        if self.w.mtp is None:
            raise RuntimeError("this checkpoint has no MTP layer (num_nextn_predict_layers = 0 or its tensors are absent)")
        indexed = frozenset([0]) if self.w.mtp.layer.indexer is not None else frozenset()
        return KVState(n_layers=1, latent_dim=self.cfg.latent_dim, index_dim=self.cfg.index_head_dim,
                       indexed_layers=indexed, kv_dtype=kv_dtype, device=self.device)

    # ---- forward --------------------------------------------------------------------------
    def forward(self, state: KVState, tokens: list[int] | torch.Tensor, start: int,
                taps: tuple[int, ...] = ()) -> ForwardOutput:
        n = len(tokens) if isinstance(tokens, list) else tokens.numel()
        return self.forward_wave(state, tokens, [(start, start + n)], taps)[0]

    def forward_wave(self, state: KVState, tokens: list[int] | torch.Tensor, pieces: list[tuple[int, int]],
                     taps: tuple[int, ...] = ()) -> list[ForwardOutput]:
        """Consecutive prefill pieces [a, b) as one wave, layer by layer: each piece's attention as
        forward() runs it (its rows written, its queries over keys [0, b)), each layer's feed-forward
        block over the whole wave's rows at once. Every op is row-invariant, so each row gets the
        bits of forward() piece by piece, while a MoE layer reads its experts once a wave instead
        of once a piece (bench/bench_moe_prefill.py). One ForwardOutput a piece; forward() is a wave
        of one piece."""
        ids = self._ids(tokens)
        x = self.plan.embed(self.w.embed, ids).to(self.dtype)
        outs = self._run_pieces(state, self.w.layers, x, pieces, taps)
        state.tokens.extend(tokens if isinstance(tokens, list) else ids.tolist())
        return [ForwardOutput(hidden=rms_norm(x, self.w.final_norm, self.cfg.rms_norm_eps), last_layer=x, taps=t)
                for x, t in outs]

    def forward_batch(self, items: list[tuple[KVState, list[int]]], taps: tuple[int, ...] = ()
                      ) -> list[ForwardOutput]:
        """Several sequences' windows in one forward: each (state, tokens) continues its state's
        rows. Per layer each window's attention runs over its own state, and the feed-forward block
        over every window's rows at once. Every op is row-invariant, so each row gets the bits of
        forward(state, tokens, state.length) run alone (tests/test_batch_exact.py); a MoE layer reads
        its experts once a step for all sequences. A state may have several windows if they are
        adjacent in `items`: consecutive pieces, run as forward_wave runs them (each piece's
        attention after the previous piece's rows of that layer are written)."""
        if not items:
            return []
        sizes = [len(tokens) for _, tokens in items]
        if min(sizes) <= 0:
            raise ValueError("forward_batch needs at least one token per window")
        ends: dict[int, int] = {}
        spans = []
        nan_flag = torch.zeros((), dtype=torch.bool, device=self.device) if self.device.type == "cuda" else None
        for i, ((state, _), n) in enumerate(zip(items, sizes)):
            if id(state) in ends and items[i - 1][0] is not state:
                raise ValueError("forward_batch: a state's windows must be adjacent (consecutive pieces)")
            a = ends.get(id(state), state.length)
            ends[id(state)] = a + n
            state.reserve(a + n)
            spans.append(Span(torch.arange(a, a + n, device=self.device), a, a + n, nan_flag))
        ids = self._ids([t for _, tokens in items for t in tokens])
        x = self.plan.embed(self.w.embed, ids).to(self.dtype)
        outs = self._layers_over([state for state, _ in items], self.w.layers, list(x.split(sizes)), spans, taps)
        if nan_flag is not None and bool(nan_flag):
            raise ValueError("indexer scores contain NaN; the selection is undefined")
        for state, tokens in items:
            state.tokens.extend(tokens)
        return [ForwardOutput(hidden=rms_norm(x, self.w.final_norm, self.cfg.rms_norm_eps), last_layer=x, taps=t)
                for x, t in outs]

    def forward_window(self, state: KVState, ids: torch.Tensor, span: Span, taps: tuple[int, ...] = ()
                       ) -> ForwardOutput:
        """The forward of a short window as glm53.runtime.cuda_graphs captures it: ids [T] and span.positions
        on the device, rows written by index, keys [0, span.key_bound) scored; no host sync and no
        shape that depends on the position, so one capture serves every window of that length and
        bound. The caller reserves room and keeps state.tokens. The per-row arithmetic is forward()'s."""
        return self.forward_windows([state], ids, [span], taps)[0]

    def forward_windows(self, states: list[KVState], ids: torch.Tensor, spans: list[Span], taps: tuple[int, ...] = ()
                        ) -> list[ForwardOutput]:
        """forward_window over several sequences at once (a batched decode step as a graph captures it):
        span i's rows are ids' next len(span.positions) entries, over states[i]; the projections and
        feed-forward blocks over every row, each span's attention over its own state (forward_batch's
        arithmetic, so each row keeps the bits it gets alone)."""
        x = self.plan.embed(self.w.embed, ids).to(self.dtype)
        sizes = [span.positions.shape[0] for span in spans]
        outs = self._layers_over(states, self.w.layers, list(x.split(sizes)), spans, taps)
        return [ForwardOutput(hidden=rms_norm(last, self.w.final_norm, self.cfg.rms_norm_eps), last_layer=last,
                              taps=taken) for last, taken in outs]

    def graph_safe(self, rows: int) -> bool:
        """Whether forward_windows over `rows` rows runs without host syncs (so a CUDA graph can hold
        it): every feed-forward block's `capturable(rows)` (a dense MLP always)."""
        return all(getattr(layer.ffn, "capturable", lambda _: True)(rows) for layer in self.w.layers)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [T, vocab] from final-normed hidden states."""
        return self.plan.gather_logits(ops.linear(hidden, self.w.head)).to(torch.float32)

    def mtp_forward(self, state: KVState, prev_hidden: torch.Tensor, next_tokens: list[int] | torch.Tensor,
                    start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer (DeepSeek-V3 style) at positions [start, start + T): row i combines the main
        model's hidden state at position start + i with the token at start + i + 1 and predicts the
        token at start + i + 2. Returns (fp32 logits [T, vocab], hidden [T, hidden] before the head's
        norm, to chain a further step). Its cache is `state` (from new_mtp_state)."""
        m = self.w.mtp
        if m is None:
            raise RuntimeError("this checkpoint has no MTP layer")
        ids = self._ids(next_tokens)
        e = self.plan.embed(m.embed if m.embed is not None else self.w.embed, ids).to(self.dtype)
        x = ops.project(torch.cat([rms_norm(e, m.enorm, self.cfg.rms_norm_eps),
                                  rms_norm(prev_hidden.to(self.dtype), m.hnorm, self.cfg.rms_norm_eps)], dim=-1),
                       m.eh_proj)
        [(out, _)] = self._run_pieces(state, [m.layer], x, [(start, start + ids.shape[0])], ())
        state.tokens.extend(next_tokens if isinstance(next_tokens, list) else ids.tolist())
        normed = rms_norm(out, m.head_norm, self.cfg.rms_norm_eps)
        head = m.head if m.head is not None else self.w.head
        return self.plan.gather_logits(ops.linear(normed, head)).to(torch.float32), out

    # ---- internals ------------------------------------------------------------------------
    def _ids(self, tokens: list[int] | torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.device).reshape(-1)
        if ids.numel() == 0:
            raise ValueError("forward needs at least one token")
        return ids

    def _run_pieces(self, state: KVState, layers: list[LayerWeights], x: torch.Tensor, pieces: list[tuple[int, int]],
                    taps: tuple[int, ...]) -> list[tuple[torch.Tensor, dict[int, torch.Tensor]]]:
        """`layers` over x's rows at the consecutive pieces [a, b) (eager: slice writes), each piece's
        attention apart, each feed-forward block over all the rows; per piece its output and taps."""
        start, stop = pieces[0][0], pieces[-1][1]
        sizes = [b - a for a, b in pieces]
        if min(sizes) <= 0 or any(p[1] != q[0] for p, q in zip(pieces, pieces[1:])) or stop - start != x.shape[0]:
            raise ValueError(f"pieces {pieces} must be non-empty, consecutive and cover the {x.shape[0]} rows")
        if start != state.length:
            raise ValueError(f"forward at position {start} but the cache holds {state.length} rows; windows must continue it")
        state.reserve(stop)
        # on a GPU the full layers' NaN checks go into one device flag, read once after the layers:
        # a host sync per full layer would stall the launch queue 39 times a prefill piece
        nan_flag = torch.zeros((), dtype=torch.bool, device=self.device) if self.device.type == "cuda" else None
        spans = [Span(torch.arange(a, b, device=self.device), a, b, nan_flag) for a, b in pieces]
        outs = self._layers_over(state, layers, list(x.split(sizes)), spans, taps)
        if nan_flag is not None and bool(nan_flag):
            raise ValueError("indexer scores contain NaN; the selection is undefined")
        return outs

    def _layers_over(self, state: KVState | list[KVState], layers: list[LayerWeights], xs: list[torch.Tensor],
                     spans: list[Span], taps: tuple[int, ...]) -> list[tuple[torch.Tensor, dict[int, torch.Tensor]]]:
        """The layers over spans' rows xs (one span: a forward or a captured window; consecutive
        spans of one state: a wave; a list of states: span i over states[i], a batch of sequences):
        every projection and feed-forward block over all the rows at once, each span's cache
        writes, selection and attention apart; per span its output and taps."""
        states = state if isinstance(state, list) else [state] * len(spans)
        sizes = [x.shape[0] for x in xs]
        x = xs[0] if len(xs) == 1 else torch.cat(xs)
        positions = spans[0].positions if len(spans) == 1 else torch.cat([span.positions for span in spans])
        cos, sin = rope_angles(self.inv_freq, positions, self.dtype)
        # a paged cache's places of every window, once for all the layers (None: each state's own calls)
        places = BatchSlots.of(states, [s.start for s in spans], [s.positions for s in spans],
                               [s.key_bound for s in spans])
        selections: list[Selection | None] = [None] * len(spans)
        taken: list[dict[int, torch.Tensor]] = [{} for _ in spans]
        for layer in layers:
            x, h = self._attention_rows(states, layer, x, spans, sizes, cos, sin, selections, places)
            x = x + self.plan.sum_partials(layer.ffn(h))
            if layer.index in taps:
                for i, part in enumerate(x.split(sizes)):
                    taken[i][layer.index] = part
        return list(zip(x.split(sizes), taken))

    def _layer(self, state: KVState, layer: LayerWeights, x: torch.Tensor, span: Span,
               cos: torch.Tensor, sin: torch.Tensor, selection: Selection | None
               ) -> tuple[torch.Tensor, Selection]:
        """One layer over one span (bench/bench_layer_decode_prefill.py times it alone)."""
        x, h, selection = self._attention(state, layer, x, span, cos, sin, selection)
        return x + self.plan.sum_partials(layer.ffn(h)), selection

    def _attention(self, state: KVState, layer: LayerWeights, x: torch.Tensor, span: Span,
                   cos: torch.Tensor, sin: torch.Tensor, selection: Selection | None
                   ) -> tuple[torch.Tensor, torch.Tensor, Selection]:
        """A layer up to its feed-forward block over one span: x after the attention's residual,
        the normed input of the feed-forward block, and the selection (the next 'shared' layers
        reuse it)."""
        selections = [selection]
        x, h = self._attention_rows([state], layer, x, [span], [x.shape[0]], cos, sin, selections)
        return x, h, selections[0]

    def _attention_rows(self, states: list[KVState], layer: LayerWeights, x: torch.Tensor, spans: list[Span],
                        sizes: list[int], cos: torch.Tensor, sin: torch.Tensor,
                        selections: list[Selection | None], places: BatchSlots | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer up to its feed-forward block over the rows of several spans (sizes: each span's
        rows, in order): the projections over all the rows at once, then per span its cache rows
        written, its keys read back and its selection (updated in `selections`: the next 'shared'
        layers reuse it), then every span's attention (plan.attend_spans: under DCP in shared
        exchanges), then the output projection over all the rows. `places`: the spans' slots in one
        paged store (their rows written with one copy a kind, their reads through precomputed slots).
        Returns x after the attention's residual and the normed input of the feed-forward block."""
        cfg, a, plan = self.cfg, layer.attn, self.plan
        h = rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
        q_resid, q_nope, q_rot = project_queries(a, h, cos, sin)
        latents = latent_rows(a, h, cos, sin)
        if layer.indexer is not None:
            index_keys = indexer_keys(layer.indexer, h, cos, sin)
            q_idx = indexer_queries(layer.indexer, q_resid, cos, sin)
            head_weights = index_head_weights(layer.indexer, h)
        if places is not None:  # every sequence's rows in one copy a kind
            places.put("latent", layer.index, latents)
            if layer.indexer is not None:
                places.put("index_keys", layer.index, index_keys)
        together: set[int] = set()
        if layer.indexer is not None and places is not None:
            together = self._select_together(layer, states, spans, q_idx, head_weights, places, selections)
        parts, a0 = [], 0
        for i, (state, span, n) in enumerate(zip(states, spans, sizes)):
            rows = slice(a0, a0 + n)
            a0 += n
            stop = span.key_bound
            slots = places.spans[i] if places is not None else None
            # the rows this rank holds (all of [0, stop) unless the cache is split by position)
            key_positions = state.owned_positions(stop)
            if places is None:
                _write(state.write_latent, state.write_latent_at, layer.index, span, latents[rows])
            if layer.indexer is not None and i not in together:
                if places is None:
                    _write(state.write_index, state.write_index_at, layer.index, span, index_keys[rows])
                keys, key_rows = state.index_view(layer.index, stop, self.dtype, slots)
                scores = index_scores(layer.indexer, q_idx[rows], head_weights[rows], keys, span.positions, key_positions,
                                      key_rows)
                selections[i] = plan.merge_topk(scores, key_positions, cfg.index_topk, span.nan_flag)
            elif selections[i] is None:
                raise ValueError(f"layer {layer.index} shares the indexer selection but no earlier full layer ran")
            # read back when the span attends: attend to what is stored (a paged cache: its store, the
            # selection translated to its slots)
            read_cached, rows_of = state.attention_view(layer.index, stop, self.dtype, slots)
            parts.append(AttentionSpan(q_nope[rows], q_rot[rows], read_cached, key_positions, selections[i], rows_of))
        # every span's attention at once: under DCP their exchanges are shared (two a layer, not two a span)
        out = plan.attend_spans(a, parts, cfg.num_attention_heads)
        x = x + plan.sum_partials(output_projection(a, out))
        return x, rms_norm(x, layer.post_norm, cfg.rms_norm_eps)

    def _select_together(self, layer: LayerWeights, states: list[KVState], spans: list[Span], q_idx: torch.Tensor,
                         head_weights: torch.Tensor, places: BatchSlots, selections: list[Selection | None]
                         ) -> set[int]:
        """The selections of a batched step's windows of equal length, a group at a time: one score
        launch over every window's keys (a table of their slots), one top-k over the group's rows, one
        translation to slots; a few launches a layer where each window took a dozen. Each window's
        selection is the one it gets alone: the scores are key-invariant and its padding scores -inf,
        which the top-k's rule never ranks above a key of its own. Under DCP the group's candidates go
        to the exchange as each window's (plan.merge_topk: a row's candidates are its own), and each
        window's translation waits for its resolved selection. Only where the keys are read in place
        (not fp8). Returns the windows done."""
        if not places.store.reads_in_place(self.dtype):
            return set()
        keys, done = places.store.layer("index_keys", layer.index), set()
        for group in places.groups():
            if not selects_without_sync(len(group.members) * group.length, group.key_table.shape[1], self.device):
                continue
            # the positions of the longest window's keys: every window's on this rank, as far as it has keys
            longest = group.members[group.longest]
            key_positions = states[longest].owned_positions(spans[longest].key_bound)
            scores = index_scores_spans(layer.indexer, group.rows(q_idx), group.rows(head_weights), keys,
                                        group.positions, group.key_table, key_positions)
            chosen = self.plan.merge_topk(scores, key_positions, self.cfg.index_topk,
                                          spans[group.members[0]].nan_flag)
            parts = chosen.split_rows(group.length)
            if isinstance(chosen, Selection):
                group.translate(chosen.indices, [part.indices for part in parts])
            for i, part in zip(group.members, parts):
                selections[i] = part
            done.update(group.members)
        return done


def _write(at_start, at_positions, layer: int, span: Span, rows: torch.Tensor) -> None:  # noqa: ANN001
    """Rows into the cache: by slice from the host start, or by index (a captured window)."""
    if span.start is not None:
        at_start(layer, span.start, rows)
    else:
        at_positions(layer, span.positions, rows)
