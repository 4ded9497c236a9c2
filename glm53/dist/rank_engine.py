"""One rank of the TP R + DCP R layout, through the model's plug points (glm53.model.parallel.RankPlan).

    comm = rendezvous(RendezvousSpec(rank, R, master, master_port))
    plan = DistRankPlan.create(comm, cfg.vocab_size)   # DCP on (Settings.dcp, TF_GLM53_DCP, says)
    weights = load_weights(model_dir, cfg, plan=plan)  # this rank's slices
    model = Glm53Model(cfg, weights, plan)
    state = plan.new_state(model, kv_dtype)            # holds only this rank's positions under DCP

What each plug point does here:
- head_range / ffn_columns / vocab_range: glm53.dist.tp (the layout plan's split arithmetic); heads
  are split by TP whether DCP is on or off (q_b / kv_b rows and o_proj columns of this rank only);
- sum_partials: gather + sum in fixed rank order (same bits on every rank, deterministic at any R);
- embed: lookup in this rank's vocabulary rows, zeros elsewhere, summed (exact: one term is non-zero);
- gather_logits: all-gather of the vocabulary slices (padded to the largest), concatenated;
- new_state: DcpKVState, holding (and reading back) only this rank's positions under DCP;
- merge_topk: DCP on: index scores of the owned positions (with their global positions) -> this
  rank's own top-k candidates and their keys (glm53.dist.dcp.PendingSelection), merged after attend's exchange into
  the global top-k (ties to the lower position, the model's own rule) as a Selection of this
  rank's rows (local slots, fixed width); DCP off: local (every rank holds every position and
  every score);
- attend: DCP on: glm53.dist.dcp.tp_dcp_attention: each rank absorbs its heads' queries through
  its W_UK slice, one all-gather shares them (with a 'full' layer's top-k candidates: one round
  trip for both), each rank attends with every head over the selected
  rows it owns (a rank with none: lse = -inf), one all-to-all returns (out, lse) to the heads'
  owners, merged by log-sum-exp in rank order, W_UV of the owner's heads; o_proj row partials are
  then summed in rank order by sum_partials. DCP off: the world-1 attention on this rank's heads.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch

from glm53.dist import dcp, tp
from glm53.dist.collectives import Comm
from glm53.model.kv_state import KVState
from glm53.model.indexer import Selection, select_topk
from glm53.model.mla import AttentionWeights
from glm53.model.parallel import RankPlan
from glm53.settings import Settings

if TYPE_CHECKING:
    from glm53.model.transformer import Glm53Model


@dataclass(frozen=True)
class DistRankPlan(RankPlan):
    comm: Comm | None = field(default=None, compare=False, repr=False)
    vocab_size: int = 0
    dcp: bool = False

    @classmethod
    def create(cls, comm: Comm, vocab_size: int, dcp_on: bool = True) -> "DistRankPlan":
        return cls(world=comm.world_size, rank=comm.rank, comm=comm, vocab_size=vocab_size,
                   dcp=dcp_on and comm.world_size > 1)

    @property
    def ownership(self) -> dcp.Ownership:
        return dcp.Ownership.for_rank(self.rank, self.world, enabled=self.dcp)

    # ---- what this rank holds ------------------------------------------------------------
    def head_range(self, n_heads: int) -> range:
        return range(*tp.head_ranges(n_heads, self.world)[self.rank])

    def ffn_columns(self, layer: int, width: int) -> range:
        return range(*tp.column_ranges(width, self.world, layer)[self.rank])

    def vocab_range(self, vocab: int) -> range:
        return range(*tp.vocab_ranges(vocab, self.world)[self.rank])

    # ---- collectives ---------------------------------------------------------------------
    def sum_partials(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.world == 1 else self._comm.sum_in_rank_order(x, name="sum_partials")

    def embed(self, table: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return table[tokens]
        first = tp.vocab_ranges(self.vocab_size, self.world)[self.rank][0]
        local = tokens - first
        mine = (local >= 0) & (local < table.shape[0])
        rows = table[local.clamp(0, table.shape[0] - 1)] * mine[:, None].to(table.dtype)
        return self._comm.sum_in_rank_order(rows, name="embed")

    def gather_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return local_logits
        sizes = [b - a for a, b in tp.vocab_ranges(self.vocab_size, self.world)]
        width = max(sizes)
        padded = torch.nn.functional.pad(local_logits, (0, width - local_logits.shape[-1]))
        parts = self._comm.all_gather(padded, name="gather_logits")  # [R, T, width]
        return torch.cat([parts[r][..., : sizes[r]] for r in range(self.world)], dim=-1)

    # ---- attention: heads by TP, positions by DCP -------------------------------------------
    def merge_topk(self, scores: torch.Tensor, key_positions: torch.Tensor | None, k: int,
                   nan_flag: torch.Tensor | None = None) -> Selection | dcp.PendingSelection:
        """scores [Tq, n] of the keys this rank holds at key_positions -> the Selection of those among
        the global top-k, as indices into this rank's rows. key_positions None (DCP off, or a cache
        that holds every position): local. DCP on: this rank's candidates, exchanged in attend's
        all-gather of the queries (dcp.PendingSelection: one round trip for both)."""
        if key_positions is None:
            return select_topk(scores, k, nan_flag)
        if nan_flag is not None and nan_flag.is_cuda and torch.cuda.is_current_stream_capturing():
            raise NotImplementedError("a DCP rank's top-k syncs with its peers; it is never graph-captured")
        # NaN scores on any rank reach every rank in the exchange: all raise (or flag) together
        return dcp.PendingSelection.of(scores, key_positions, self.ownership, k, nan_flag)

    def attend(self, w: AttentionWeights, q_nope: torch.Tensor, q_rot: torch.Tensor, rows: torch.Tensor,
               key_positions: torch.Tensor | None, selection: Selection | dcp.PendingSelection,
               total_heads: int) -> torch.Tensor:
        if key_positions is None:  # every rank holds every position: attend locally with our heads
            return super().attend(w, q_nope, q_rot, rows, key_positions, selection, total_heads)
        return dcp.tp_dcp_attention(self._comm, q_nope, q_rot, w.w_uk_t, w.w_uv, rows, selection,
                                    tp.head_ranges(total_heads, self.world), w.scale)

    # ---- state ---------------------------------------------------------------------------
    def new_state(self, model: "Glm53Model", kv_dtype: str = "bf16") -> KVState:
        """The cache for one sequence on this rank (only owned positions under DCP)."""
        indexed = frozenset(l.index for l in model.w.layers if l.indexer is not None)
        return DcpKVState(n_layers=len(model.w.layers), latent_dim=model.cfg.latent_dim,
                          index_dim=model.cfg.index_head_dim, indexed_layers=indexed, kv_dtype=kv_dtype,
                          device=model.device, own=self.ownership)

    # ---- helpers ---------------------------------------------------------------------------
    @property
    def _comm(self) -> Comm:
        if self.comm is None:
            raise RuntimeError(f"DistRankPlan for world {self.world} has no Comm; build it with DistRankPlan.create(comm)")
        return self.comm


@dataclass
class DcpKVState(KVState):
    """KVState holding only this rank's positions (p % R == rank, at slot p // R).

    Writes take rows for absolute positions and keep the owned ones; reads return only the owned
    rows of [0, stop), in position order, and `owned_positions(stop)` says which positions they
    are (the model scores and attends over exactly these). Capacity counts local slots."""

    own: dcp.Ownership = dcp.Ownership(0, 1)

    def reserve(self, n: int, exact: bool = False) -> None:
        super().reserve(self.own.count(n), exact)

    def bytes_per_position(self) -> int:
        """A position's share of this rank's bytes (it holds one position in R): what a KV pool
        counts, so that R ranks' pools hold as many positions as one rank's of R times the bytes."""
        return -(-super().bytes_per_position() // self.own.ranks)

    def owned_positions(self, stop: int) -> torch.Tensor | None:
        if self.own.ranks == 1:
            return None
        return self.own.owned_positions(0, stop, device=self.device)

    def write_latent(self, layer: int, start: int, rows: torch.Tensor) -> None:
        self._write_owned(self.latent[layer], self.latent_scale[layer], start, rows)

    def write_index(self, layer: int, start: int, rows: torch.Tensor) -> None:
        self._write_owned(self.index_keys[layer], self.index_scale[layer], start, rows)

    def read_latent(self, layer: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        return self._read(self.latent[layer], self.latent_scale[layer], self.own.count(stop), dtype)

    def read_index(self, layer: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        return self._read(self.index_keys[layer], self.index_scale[layer], self.own.count(stop), dtype)

    def slots(self, start: int, stop: int) -> tuple[int, int]:
        """This rank's local slots of positions [start, stop): [own.count(start), own.count(stop)).
        The prefix cache stores and restores exactly these per rank (each rank its own chunk rows)."""
        return self.own.count(start), self.own.count(stop)

    def _write_owned(self, store: torch.Tensor, scale: torch.Tensor | None, start: int, rows: torch.Tensor) -> None:
        slots, mine = self.own.rows_to_write(start, rows)
        if slots.numel():
            self._write(store, scale, int(slots[0]), mine)  # owned slots of a range are consecutive


# ---- drafted decoding over R ranks: rank 0 decides, the others replay its windows ----------------
_DTYPES = {1: torch.float32, 2: torch.bfloat16, 3: torch.float16}
_DTYPE_CODES = {v: k for k, v in _DTYPES.items()}


class WindowChannel:
    """Rank 0's drafted-decoding decisions, replayed by ranks 1..R-1.

    Drafting, acceptance and sampling happen on rank 0 only. Every forward of the model (target
    window, MTP layer step, and the embedding / LM head lookups DFlash2 borrows) is a sequence of
    collectives, so rank 0 broadcasts each such call first and every follower runs the same call:
      FORWARD start tokens        a verification window of the target;
      TRUNCATE length             rows of rejected drafts dropped;
      MTP_FORWARD start tokens X  one MTP layer call (X: the hidden rows it conditions on), on every
                                  rank's own MTP cache (the MTP layer is TP-sharded like the others);
      MTP_TRUNCATE length         the MTP cache follows rank 0's (rejected chained rows dropped);
      EMBED tokens / HEAD X       the target's embedding of tokens / logits of hidden rows X (DFlash2);
      END length                  the request is over: keep `length` rows (the pending token's row
                                  is dropped, exactly as on rank 0).
    Since all ranks compute the same values bit for bit, nothing else need agree. X travels as fp32
    (exact for fp32 / bf16 / fp16) and is restored to its dtype."""

    FORWARD, TRUNCATE, END, MTP_FORWARD, MTP_TRUNCATE, EMBED, HEAD = 1, 2, 3, 4, 5, 6, 7
    HEADER = 6  # op, value, token count, rows' shape (2) and dtype code
    # a window's tokens ride in the header up to this many (verification windows are <= 14
    # drafts + 1): one broadcast per call instead of two; longer lists follow in a second one
    INLINE_TOKENS = 16

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    @property
    def leader(self) -> bool:
        return self.comm.rank == 0

    def send(self, op: int, value: int, tokens: Sequence[int] = (), rows: torch.Tensor | None = None) -> None:
        shape = (0, 0, 0) if rows is None else (int(rows.shape[0]), int(rows.shape[1]), _DTYPE_CODES[rows.dtype])
        tokens = [int(t) for t in tokens]
        inline = tokens[:self.INLINE_TOKENS]
        header = torch.tensor([op, value, len(tokens), *shape, *inline, *[0] * (self.INLINE_TOKENS - len(inline))],
                              dtype=torch.int64, device=self.comm.device)
        self.comm.broadcast(header, name="draft_window")
        if len(tokens) > self.INLINE_TOKENS:
            self.comm.broadcast(torch.tensor(tokens[self.INLINE_TOKENS:], dtype=torch.int64, device=self.comm.device),
                                name="draft_window_tokens")
        if rows is not None:
            self.comm.broadcast(rows.detach().to(device=self.comm.device, dtype=torch.float32).contiguous(),
                                name="draft_window_rows")

    def receive(self) -> tuple[int, int, list[int], torch.Tensor | None]:
        header = self.comm.broadcast(torch.zeros(self.HEADER + self.INLINE_TOKENS, dtype=torch.int64,
                                                 device=self.comm.device), name="draft_window").tolist()
        op, value, n, r, c, code = header[:self.HEADER]
        tokens = header[self.HEADER:self.HEADER + min(n, self.INLINE_TOKENS)]
        if n > self.INLINE_TOKENS:
            t = self.comm.broadcast(torch.zeros(n - self.INLINE_TOKENS, dtype=torch.int64, device=self.comm.device),
                                    name="draft_window_tokens")
            tokens += t.tolist()
        rows = None
        if code:
            rows = self.comm.broadcast(torch.zeros(r, c, dtype=torch.float32, device=self.comm.device),
                                       name="draft_window_rows").to(_DTYPES[code])
        return op, value, tokens, rows

    def lead(self, target: object) -> "LeadingTarget":
        return LeadingTarget(target, self)

    def follow_windows(self, target: object) -> None:
        """Run rank 0's calls on this rank's `target` (a glm53.runtime.engine.Glm53Target) until END. The MTP
        layer's cache of this request is created at its first call (a fresh one per request, as on
        rank 0)."""
        from drafter.glm53_target import Glm53MtpAdapter

        mtp: Glm53MtpAdapter | None = None
        while True:
            op, value, tokens, rows = self.receive()
            if op == self.FORWARD:
                target.forward(tokens, value)   # taps need no collective: rank 0 alone keeps them
            elif op == self.TRUNCATE:
                target.truncate(value)
            elif op in (self.MTP_FORWARD, self.MTP_TRUNCATE):
                if mtp is None:
                    mtp = Glm53MtpAdapter(target.engine.model, getattr(target.engine, "kv_dtype", "bf16"))
                if op == self.MTP_FORWARD:
                    mtp.forward(rows, tokens, value)
                else:
                    mtp.truncate(value)
            elif op == self.EMBED:
                target.embed(torch.tensor(tokens, dtype=torch.long))
            elif op == self.HEAD:
                target.lm_head(rows)
            elif op == self.END:
                target.truncate(min(value, target.length()))
                return
            else:
                raise RuntimeError(f"glm53.dist: rank {self.comm.rank}: unknown draft-window op {op} from rank 0")


class LeadingTarget:
    """Rank 0's Target: each forward, truncation and borrowed embedding / head call is announced to
    the followers first. DFlash2 (drafter.sources.dflash2) runs its own small model on rank 0 alone,
    on the taps of rank 0's forwards (layer outputs after TP's reductions: the same on every rank)."""

    def __init__(self, target: object, channel: WindowChannel) -> None:
        self.target, self.channel = target, channel
        self.vocab_size = target.vocab_size

    def length(self) -> int:
        return self.target.length()

    def canonical_frontier(self) -> int:
        return self.target.canonical_frontier()

    def forward(self, tokens, start: int, *, taps=()):
        self.channel.send(WindowChannel.FORWARD, start, list(tokens))
        return self.target.forward(tokens, start, taps=taps)

    def truncate(self, length: int) -> None:
        self.channel.send(WindowChannel.TRUNCATE, length)
        self.target.truncate(length)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        self.channel.send(WindowChannel.EMBED, 0, [int(t) for t in token_ids.reshape(-1).tolist()])
        return self.target.embed(token_ids)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        self.channel.send(WindowChannel.HEAD, 0, rows=hidden)
        return self.target.lm_head(hidden)

    def lead_mtp(self, adapter: object) -> "LeadingMtpAdapter":
        """Rank 0's MTP adapter: each call is replayed on every rank's own MTP cache."""
        return LeadingMtpAdapter(adapter, self.channel)

    def end(self) -> None:
        """The request is over on rank 0: the followers keep the same rows."""
        self.channel.send(WindowChannel.END, self.target.length())


class LeadingMtpAdapter:
    """drafter.sources.mtp.MtpAdapter on rank 0 over R ranks: MTP_FORWARD / MTP_TRUNCATE first."""

    def __init__(self, adapter: object, channel: WindowChannel) -> None:
        self.adapter, self.channel = adapter, channel

    @property
    def state(self) -> object:
        return self.adapter.state

    def forward(self, hidden: torch.Tensor, tokens: Sequence[int], start: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.channel.send(WindowChannel.MTP_FORWARD, start, list(tokens), rows=hidden)
        return self.adapter.forward(hidden, tokens, start)

    def truncate(self, length: int) -> None:
        self.channel.send(WindowChannel.MTP_TRUNCATE, length)
        self.adapter.truncate(length)


# ---- the family contract over R ranks ------------------------------------------------------------
REQUEST_KEY = "glm53/request/"
READ_KEY = "glm53/read/"  # + seq: how many followers have read request seq (deleted once all have)
STOP = "stop"
BATCH_START = "batch_start"  # rank 0 serves through glm53.dist.rank_batch from now on: build yours
BATCH_WAKE = "batch_wake"  # rank 0 has a step to run: RankBatch.follow() until the batch is idle


class RankEngine:
    """Glm53Engine on one rank of R: rank 0 serves `generate`, ranks 1..R-1 run `follow()`.

    Rank 0 publishes each request (prompt, max_tokens, sampling with its seed resolved) through the
    rendezvous store; every rank then runs the same Glm53Engine.generate, whose forwards meet in the
    collectives. All ranks compute the same logits bit for bit, so they decide the same tokens; a
    cancellation on rank 0 (on_tokens returning False) is broadcast at each decided batch so every
    rank stops at the same token. Followers wait for requests on the store (no collective timeout
    while idle); the guard still stops them within seconds when rank 0 dies.

    `serve_features=True` (what glm53.cuda_engine asks for) adds what one rank gets from cuda_engine:
    - the prefix cache on every rank (kv_cache.engine_adapter.attach_prefix_cache with this rank's
      comm: each rank stores its own rows under its own key, a hit is the minimum every rank holds);
      every rank looks up, restores and stores for every request, in the same order;
    - drafted decoding (drafter.glm53_target.DraftPlan: copy, MTP or DFlash2 drafts, as at one
      rank): rank 0 drafts and verifies, the followers replay its calls (WindowChannel).

    `settings` (glm53.settings.Settings; default the environment's, parsed here) gives the device,
    DCP, the guard's timings, the backend and everything the engine, cache and draft plan read;
    `device`, `dcp_on` and the engine options win over it."""

    def __init__(self, model_dir: str, *, tp: int, rank: int, master: str = "127.0.0.1", master_port: int = 29551,
                 device: str | None = None, dcp_on: bool | None = None, rendezvous_timeout_s: float = 120.0,
                 load_timeout_s: float = 3600.0, serve_features: bool = False, drafter: object = None,
                 no_drafts: bool = False, mtp_drafts: int | None = None, settings: Settings | None = None,
                 **engine_options: object) -> None:
        from glm53.config import Glm53Config
        from glm53.dist.guard import GuardSettings
        from glm53.dist.rendezvous import RendezvousSpec, rendezvous
        from glm53.runtime.engine import Glm53Engine

        settings = Settings.from_env() if settings is None else settings
        dev = device or settings.device or ("cuda" if torch.cuda.is_available() else "cpu")
        torch_device = torch.device(f"cuda:{rank % max(torch.cuda.device_count(), 1)}") if dev == "cuda" else torch.device("cpu")
        self.comm = rendezvous(RendezvousSpec(rank, tp, master, master_port, rendezvous_timeout_s), device=torch_device,
                               settings=GuardSettings.from_settings(settings), backend=settings.dist_backend)
        cfg = Glm53Config.from_dir(model_dir)
        self.plan = DistRankPlan.create(self.comm, cfg.vocab_size, settings.dcp if dcp_on is None else dcp_on)
        self.engine = Glm53Engine(model_dir, tp=tp, rank=rank, master=master, master_port=master_port,
                                  device=dev, plan=self.plan, no_drafts=no_drafts, mtp_drafts=mtp_drafts,
                                  drafter=None if serve_features else drafter, settings=settings, **engine_options)
        self.engine.window_channel = WindowChannel(self.comm)
        if serve_features:
            from drafter.glm53_target import DraftPlan
            from kv_cache.engine_adapter import attach_prefix_cache

            self.engine.drafter = DraftPlan.from_contract(self.engine, drafter=drafter or None, no_drafts=no_drafts,
                                                          mtp_drafts=mtp_drafts, world=tp)
        # ranks load at different speeds (minutes at full size): meet on the store, not in a collective
        self.comm.store_barrier("weights_loaded", load_timeout_s)
        if serve_features and engine_options.get("prefix_cache") is None:
            # after the barrier: attaching checks the ranks' cache settings in a collective
            attach_prefix_cache(self.engine, comm=self.comm)
        self.eos = self.engine.eos
        self._seq = 0
        self._unread: list[int] = []  # rank 0: published requests some follower may not have read yet
        self._batch: Any = None  # glm53.dist.rank_batch.RankBatch once rank 0 asked for batch_engine()

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def settings(self) -> Settings:
        return self.engine.settings

    # ---- what the front reports (/health, verify.sh) -------------------------------------------
    @property
    def prefix_cache_enabled(self) -> bool:
        cache = self.engine.prefix_cache
        if cache is not None:
            return bool(getattr(cache, "enabled", True))
        return bool(self.engine.reuse_live)

    @property
    def drafting_enabled(self) -> bool:
        return self.engine.drafter is not None and not self.engine.no_drafts

    @property
    def chunk(self) -> int:
        """The prefill piece size (the grid where reuse stops at its multiples): /health's prefill_chunk."""
        return self.engine.chunk

    @property
    def last_stats(self) -> dict:
        return self.engine.last_stats

    @property
    def prefix_cache(self) -> object:
        return self.engine.prefix_cache

    @property
    def drafter(self) -> object:
        return self.engine.drafter

    # ---- rank 0 ---------------------------------------------------------------------------
    def batch_engine(self, **options: Any) -> Any:
        """Rank 0: the batched runtime over every rank (glm53.dist.rank_batch.RankBatch: each rank
        steps its own BatchEngine in lockstep), or None where the ops are not row-invariant (the
        grid-boundary mode: requests run one at a time through `generate`). From then on every
        request, `generate`'s too, runs through it."""
        if self.rank != 0:
            raise RuntimeError(f"batch_engine runs on rank 0; rank {self.rank} runs follow()")
        if self.engine.reuse_boundary is not None:
            return None
        if self._batch is None:
            from glm53.dist.rank_batch import RankBatch

            self._batch = RankBatch(self, options)
        return self._batch

    def generate(self, prompt: list[int], max_tokens: int, sampling: object = None,
                 on_tokens=None) -> list[int]:
        if self.rank != 0:
            raise RuntimeError(f"generate runs on rank 0; rank {self.rank} runs follow()")
        if self._batch is not None:  # the followers step batches now: the request is a batch of one
            seq = self._batch.submit(prompt, max_tokens, sampling, on_tokens)
            while not seq.finished:
                self._batch.step()
            return seq.reply
        params = self.engine._params(sampling).with_seed()  # one seed for every rank
        self._publish(("generate", list(prompt), max_tokens, params))
        if self.engine.will_draft(params):  # cancellation travels with the windows (END)
            return self.engine.generate(prompt, max_tokens, params, on_tokens)

        def agreed(new: list[int]) -> bool:
            keep_going = True if on_tokens is None else on_tokens(new) is not False
            self.comm.broadcast(torch.tensor([int(keep_going)], device=self.comm.device), name="continue")
            return keep_going

        return self.engine.generate(prompt, max_tokens, params, agreed)

    def close(self) -> None:
        if self.rank == 0:
            if self._batch is not None:
                self._batch.close()
            self._publish((STOP,))
        self.comm.close()

    # ---- ranks 1..R-1 ------------------------------------------------------------------------
    def follow(self) -> None:
        """Run what rank 0 publishes until it says stop; then leave the group."""
        while self.follow_one():
            pass

    def follow_one(self) -> bool:
        """Run rank 0's next request; False (after leaving the group) when rank 0 said stop."""
        request = self._next_request()
        if request[0] == STOP:
            self.comm.close()
            return False
        if request[0] in (BATCH_START, BATCH_WAKE):  # rank 0 serves several requests at once
            from glm53.dist.rank_batch import RankBatch

            if request[0] == BATCH_START:
                self._batch = RankBatch(self, request[1])
            else:
                self._batch.follow()
            return True
        _, prompt, max_tokens, params = request

        def agreed(new: list[int]) -> bool:
            flag = self.comm.broadcast(torch.tensor([0], device=self.comm.device), name="continue")
            return bool(flag.item())

        try:
            self.engine.generate(prompt, max_tokens, params, agreed)
        except Exception as exc:  # a request rank 0 rejected the same way: stay in step
            from glm53.runtime.engine import EngineError

            if not isinstance(exc, EngineError):
                raise
        return True

    # ---- the request channel (the rendezvous store) -----------------------------------------
    def _publish(self, request: tuple) -> None:
        import pickle

        self._seq += 1
        self.comm.store.set(f"{REQUEST_KEY}{self._seq}", pickle.dumps(request))
        # a request is deleted once every follower has read it: not every request meets the ranks
        # in a collective (max_tokens 0 without a prefix cache), so a follower may still be behind
        followers = self.comm.world_size - 1
        while self._unread and int(self.comm.store.add(f"{READ_KEY}{self._unread[0]}", 0)) >= followers:
            seq = self._unread.pop(0)
            self.comm.store.delete_key(f"{REQUEST_KEY}{seq}")
            self.comm.store.delete_key(f"{READ_KEY}{seq}")
        self._unread.append(self._seq)

    def _next_request(self) -> tuple:
        import pickle
        from datetime import timedelta

        self._seq += 1
        key = f"{REQUEST_KEY}{self._seq}"
        while True:
            if self.comm.guard.failure is not None:
                raise RuntimeError(self.comm.guard.failure)
            try:
                self.comm.store.wait([key], timedelta(seconds=1))
                request = pickle.loads(self.comm.store.get(key))
                self.comm.store.add(f"{READ_KEY}{self._seq}", 1)
                return request
            except Exception as exc:  # the 1 s wait ran out: keep waiting (the guard watches rank 0)
                if "timeout" not in str(exc).lower() and "timed out" not in str(exc).lower():
                    raise
