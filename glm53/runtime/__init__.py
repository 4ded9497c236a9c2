"""The batched runtime (docs/engine.md, "Batched runtime"): several requests decoded together
over one KV pool, each reply the bits it gets alone.

    sequence.py   Sequence: a request's tokens, KV state, sampling and draft state
    kv_pool.py    PagedPool: pages of one store (a rank's) for every sequence's rows
    scheduler.py  Scheduler: admission, the wait queue, each step's work, preemption
    runner.py     ModelRunner: one forward over a step's work, one head product
    drafted.py    DraftedRun: the drafter's loop for one sequence, in lockstep with the steps
    batch.py      BatchEngine: submit / step / cancel over the above
"""
from glm53.runtime.batch import BatchEngine, QueueFull, TooLarge  # noqa: F401
