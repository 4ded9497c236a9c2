"""Distributed primitives for the GLM-5.3 layout (TP R + DCP R) over torch.distributed.

- rendezvous: join R ranks at rank 0's address and port (or a torchrun environment) -> Comm
- guard: heartbeat and collective watchdog; a dead or stuck peer stops the lane, named
- collectives: Comm, the guarded collectives (incl. a sum in fixed rank order)
- dcp: position ownership (p -> rank p % R, slot p // R), log-sum-exp merge, top-k merge
- tp: head / 128-column block / vocabulary partitions
"""
