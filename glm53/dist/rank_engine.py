"""The family contract over R ranks: Glm53Engine on one rank of R (TP R + DCP R), rank 0 serving,
ranks 1..R-1 following. The rank's plan is glm53.dist.rank_plan.DistRankPlan; requests reach the
followers through glm53.dist.request_channel, drafted windows through glm53.dist.window_channel.
Its features (prefix cache, drafts) come from a composition root (glm53/serving/compose.py)."""
from __future__ import annotations

from typing import Any

import torch

from glm53.config import Glm53Config
from glm53.dist.guard import GuardSettings
from glm53.dist.rank_batch import RankBatch
from glm53.dist.rank_plan import DistRankPlan
from glm53.dist.rendezvous import RendezvousSpec, rendezvous
from glm53.dist.request_channel import BATCH_START, BATCH_WAKE, STOP, RequestChannel
from glm53.dist.window_channel import WindowChannel
from glm53.runtime.engine import Glm53Engine
from glm53.runtime.errors import EngineError
from glm53.runtime.features import Drafting, EngineFeatures, PrefixCache
from glm53.settings import Settings


class _AfterEveryRankLoaded:
    """A rank's engine features, the prefix cache only once every rank has loaded its weights: ranks
    load at different speeds (minutes at full size) and meet on the store, not in a collective, while
    building the cache checks the ranks' cache settings in a collective. `meet()` waits once."""

    def __init__(self, features: EngineFeatures | None, meet: Any) -> None:
        self.features, self._meet, self._met = features, meet, False

    def meet(self) -> None:
        if not self._met:
            self._meet()
            self._met = True

    def drafting(self, engine: Glm53Engine) -> Drafting | None:
        return None if self.features is None else self.features.drafting(engine)

    def prefix_cache(self, engine: Glm53Engine) -> PrefixCache | None:
        self.meet()
        return None if self.features is None else self.features.prefix_cache(engine)


class RankEngine:
    """Glm53Engine on one rank of R: rank 0 serves `generate`, ranks 1..R-1 run `follow()`.

    Rank 0 publishes each request (prompt, max_tokens, sampling with its seed resolved) through the
    rendezvous store; every rank then runs the same Glm53Engine.generate, whose forwards meet in the
    collectives. All ranks compute the same logits bit for bit, so they decide the same tokens; a
    cancellation on rank 0 (on_tokens returning False) is broadcast at each decided batch so every
    rank stops at the same token. Followers wait for requests on the store (no collective timeout
    while idle); the guard still stops them within seconds when rank 0 dies.

    `features` (glm53.runtime.features.EngineFeatures, from the composition root) gives every rank
    what one rank gets: the prefix cache on every rank (each rank stores its own rows under its own
    key, a hit is the minimum every rank holds; every rank looks up, restores and stores for every
    request, in the same order) and drafted decoding (rank 0 drafts and verifies, the followers
    replay its calls through WindowChannel). None: neither, unless the engine options name them.

    `settings` (glm53.settings.Settings; default the environment's, parsed here) gives the device,
    DCP, the guard's timings, the backend and everything the engine, cache and draft plan read;
    `device`, `dcp_on` and the engine options win over it."""

    def __init__(self, model_dir: str, *, tp: int, rank: int, master: str = "127.0.0.1", master_port: int = 29551,
                 device: str | None = None, dcp_on: bool | None = None, rendezvous_timeout_s: float = 120.0,
                 load_timeout_s: float = 3600.0, features: EngineFeatures | None = None,
                 drafter: Drafting | None = None, no_drafts: bool = False, mtp_drafts: int | None = None,
                 settings: Settings | None = None, **engine_options: Any) -> None:
        settings = Settings.from_env() if settings is None else settings
        dev = device or settings.device or ("cuda" if torch.cuda.is_available() else "cpu")
        torch_device = torch.device(f"cuda:{rank % max(torch.cuda.device_count(), 1)}") if dev == "cuda" else torch.device("cpu")
        self.comm = rendezvous(RendezvousSpec(rank, tp, master, master_port, rendezvous_timeout_s), device=torch_device,
                               settings=GuardSettings.from_settings(settings), backend=settings.dist_backend)
        cfg = Glm53Config.from_dir(model_dir)
        self.plan = DistRankPlan.create(self.comm, cfg.vocab_size, settings.dcp if dcp_on is None else dcp_on)
        loaded = _AfterEveryRankLoaded(features, lambda: self.comm.store_barrier("weights_loaded", load_timeout_s))
        self.engine = Glm53Engine(model_dir, tp=tp, rank=rank, master=master, master_port=master_port,
                                  device=dev, plan=self.plan, no_drafts=no_drafts, mtp_drafts=mtp_drafts,
                                  drafter=drafter, settings=settings, features=loaded,
                                  window_channel=WindowChannel(self.comm), **engine_options)
        loaded.meet()
        self.eos = self.engine.eos
        self.requests = RequestChannel(self.comm)
        self._batch: RankBatch | None = None  # once rank 0 asked for batch_engine()

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
        self.requests.publish(("generate", list(prompt), max_tokens, params))
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
            self.requests.publish((STOP,))
        self.comm.close()

    # ---- ranks 1..R-1 ------------------------------------------------------------------------
    def follow(self) -> None:
        """Run what rank 0 publishes until it says stop; then leave the group."""
        while self.follow_one():
            pass

    def follow_one(self) -> bool:
        """Run rank 0's next request; False (after leaving the group) when rank 0 said stop."""
        request = self.requests.next()
        if request[0] == STOP:
            self.comm.close()
            return False
        if request[0] in (BATCH_START, BATCH_WAKE):  # rank 0 serves several requests at once
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
            if not isinstance(exc, EngineError):
                raise
        return True
