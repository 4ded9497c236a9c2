"""Rank 0's requests to ranks 1..R-1, through the rendezvous store.

Followers wait for requests on the store, not in a collective (no collective timeout while idle);
the guard still stops them within seconds when rank 0 dies. A request is deleted once every
follower has read it."""
from __future__ import annotations

import pickle
from datetime import timedelta

from glm53.dist.collectives import Comm

REQUEST_KEY = "glm53/request/"
READ_KEY = "glm53/read/"  # + seq: how many followers have read request seq (deleted once all have)
STOP = "stop"
BATCH_START = "batch_start"  # rank 0 serves through glm53.dist.rank_batch from now on: build yours
BATCH_WAKE = "batch_wake"  # rank 0 has a step to run: RankBatch.follow() until the batch is idle


class RequestChannel:
    """Numbered requests (pickled tuples) on the store: rank 0 publishes, every follower reads each
    in order."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self._seq = 0
        self._unread: list[int] = []  # rank 0: published requests some follower may not have read yet

    def publish(self, request: tuple) -> None:
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

    def next(self) -> tuple:
        """A follower: the next request, waiting for it (1 s at a time, checking the guard)."""
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
