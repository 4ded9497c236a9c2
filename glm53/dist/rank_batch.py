"""Several requests at once over R ranks: one BatchEngine on every rank, stepped in lockstep.

Rank 0's front submits and cancels. Each step, rank 0 broadcasts what changed since the last one
(the requests it accepted, their seeds drawn, and the sequences it cancelled); every rank applies
that and runs the same step: the same admissions, prefix-cache lookups, pool grants, preemptions
and forward (whose collectives meet), and, since every rank computes the same logits bit for bit,
the same tokens and draft windows. So the scheduler's decision is rank 0's, carried by its inputs,
and each rank holds its own DCP slots of every sequence in its own pool.

What could make ranks decide differently is kept off the step: a client leaving (rank 0's
on_tokens) becomes a cancellation broadcast with the next step, and the pools take the smallest
rank's capacity. Before each forward the ranks compare their step's work (a digest, one
all_gather): a rank that planned otherwise stops the lane naming the step and the ranks, instead
of meeting the others in a mismatched collective.

While no sequence runs the followers wait on the rendezvous store (no collective to time out), as
between one-at-a-time requests; rank 0 wakes them through the same request channel.
"""
from __future__ import annotations

import hashlib
from typing import Any

import torch

from glm53.dist.request_channel import BATCH_START, BATCH_WAKE
from glm53.runtime import BatchEngine
from glm53.runtime.scheduler import Work
from glm53.runtime.sequence import Sequence


class RankBatch:
    """BatchEngine's interface (submit, cancel, step, idle, stats, pool) over R ranks. Rank 0 holds
    one as the front's runtime (RankEngine.batch_engine); followers build theirs when rank 0's
    START arrives and run `follow()` for each WAKE."""

    def __init__(self, rank_engine: Any, options: dict[str, Any]) -> None:
        self.rank_engine = rank_engine
        self.comm = rank_engine.comm
        self.leader = self.comm.rank == 0
        if not self.leader:  # a follower's queue is rank 0's admissions: never bounded here
            options = dict(options, max_waiting=1 << 62)
        self.batch = BatchEngine(rank_engine.engine, lockstep=True, **options)
        if self.leader:
            s = self.batch.scheduler
            shared = {"max_seqs": s.max_seqs, "step_tokens": s.step_tokens, "pool_block": self.batch.pool.block}
            rank_engine.requests.publish((BATCH_START, shared))
        capacities = self.comm.all_gather(torch.tensor([self.batch.pool.capacity], dtype=torch.int64),
                                          name="batch_pool_capacity")
        self.batch.pool.limit(int(capacities.min()))
        self.batch.on_plan = self._compare_plans
        self._events: list[tuple] = []  # rank 0: accepted submits and cancels since the last step
        self._leaving: list[Sequence] = []  # rank 0: sequences whose client left during a step
        self._awake = False  # rank 0: the followers are in follow(), not on the store
        self._by_number: dict[int, Sequence] = {}  # followers: running and waiting sequences

    # ---- what the front calls (rank 0) ----------------------------------------------------------
    @property
    def pool(self) -> Any:
        return self.batch.pool

    @property
    def idle(self) -> bool:
        return self.batch.idle

    @property
    def running(self) -> int:
        return self.batch.running

    @property
    def steps(self) -> int:
        return self.batch.steps

    def stats(self) -> dict[str, Any]:
        return self.batch.stats()

    def submit(self, prompt: list[int], max_tokens: int, sampling: Any = None, on_tokens: Any = None,
               on_done: Any = None, rid: str = "-", on_admit: Any = None) -> Sequence:
        self._require_leader("submit")
        box: list[Sequence] = []

        def relay(tokens: list[int]) -> bool:
            # the client's answer is rank 0's alone: a departure ends the sequence after the step,
            # through a cancellation every rank applies at the same point
            if on_tokens is not None and on_tokens(tokens) is False and box and box[0] not in self._leaving:
                self._leaving.append(box[0])
            return True

        seq = self.batch.submit(prompt, max_tokens, sampling, relay, on_done, rid, on_admit)
        box.append(seq)
        if not seq.finished:  # max_tokens 0 finishes at once and never reaches the scheduler
            self._events.append(("submit", seq.number, seq.prompt, seq.max_tokens, seq.params, rid))
        return seq

    def cancel(self, seq: Sequence) -> None:
        self._require_leader("cancel")
        if seq.finished:
            return
        self._events.append(("cancel", seq.number))
        self.batch.cancel(seq)

    def step(self) -> bool:
        """One step on every rank; False when nothing ran (nothing broadcast when nothing changed)."""
        self._require_leader("step")
        if not self._events and self.batch.idle:
            return False
        if not self._awake:
            self.rank_engine.requests.publish((BATCH_WAKE,))
            self._awake = True
        events, self._events = self._events, []
        self.comm.broadcast_object(events, name="batch_events")
        stepped = self.batch.step()
        leaving, self._leaving = self._leaving, []
        for seq in leaving:
            self.cancel(seq)
        if self.batch.idle and not self._events:
            self._awake = False  # the followers see the same idle batch and go back to the store
        return stepped

    def run(self) -> None:
        """Step until every submitted sequence has finished."""
        while not self.batch.idle or self._events:
            self.step()

    def close(self) -> None:
        """Rank 0: release awake followers (they cancel what they hold and return to the store)."""
        if self.leader and self._awake:
            self.comm.broadcast_object([("leave",)], name="batch_events")
            self._awake = False

    # ---- followers -----------------------------------------------------------------------------
    def follow(self) -> None:
        """Steps with rank 0 from a WAKE until the batch is idle (or rank 0 leaves)."""
        while True:
            events = self.comm.broadcast_object(None, name="batch_events")
            if not self._apply(events):
                return
            self.batch.step()
            if self.batch.idle:
                return

    def _apply(self, events: list[tuple]) -> bool:
        for event in events:
            if event[0] == "submit":
                _, number, prompt, max_tokens, params, rid = event
                seq = self.batch.submit(prompt, max_tokens, params, rid=rid, on_done=self._forget)
                if seq.number != number:
                    raise RuntimeError(f"rank {self.comm.rank}: request {rid} is arrival {seq.number} here and "
                                       f"{number} on rank 0: the ranks' batches diverged")
                self._by_number[number] = seq
            elif event[0] == "cancel":
                seq = self._by_number.get(event[1])
                if seq is not None:
                    self.batch.cancel(seq)
            elif event[0] == "leave":
                for seq in list(self._by_number.values()):
                    self.batch.cancel(seq)
                return False
        return True

    def _forget(self, seq: Sequence) -> None:
        self._by_number.pop(seq.number, None)

    # ---- every rank --------------------------------------------------------------------------
    def _compare_plans(self, work: list[Work]) -> None:
        mine = plan_digest(work)
        every = self.comm.all_gather(torch.tensor([mine], dtype=torch.int64), name="batch_plan")
        if bool((every != every[0]).any()):
            differ = [r for r in range(self.comm.world_size) if int(every[r, 0]) != int(every[0, 0])]
            raise RuntimeError(f"step {self.batch.steps + 1}: rank(s) {differ} planned a different batch than "
                               "rank 0 (the ranks' schedulers diverged); the lane stops rather than compute "
                               "a wrong reply: report it with the ranks' logs")

    def _require_leader(self, what: str) -> None:
        if not self.leader:
            raise RuntimeError(f"{what} runs on rank 0; rank {self.comm.rank} follows (RankBatch.follow)")


def plan_digest(work: list[Work]) -> int:
    """A step's work as one int64: each sequence's arrival number, rows and tokens, in order."""
    h = hashlib.blake2b(digest_size=8)
    for w in work:
        h.update(repr((w.seq.number, w.start, w.prefill, w.tokens)).encode())
    return int.from_bytes(h.digest(), "little", signed=True)

