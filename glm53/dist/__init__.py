"""One rank of the GLM-5.3 layout (TP R + DCP R) over torch.distributed.

- rendezvous: join R ranks at rank 0's address and port (or a torchrun environment) -> Comm
- guard: heartbeat and collective watchdog; a dead or stuck peer stops the lane, named
- collectives: Comm, the guarded collectives (incl. a sum in fixed rank order)
- dcp: position ownership (p -> rank p % R, slot p // R), log-sum-exp merge, top-k merge
- tp: head / 128-column block / vocabulary partitions
- rank_plan: DistRankPlan, the model's plug points on this rank; dcp_state: DcpKVState, its KV state
- request_channel: rank 0's requests to the followers, through the rendezvous store
- window_channel: drafted decoding over R ranks (rank 0 drafts, the others replay its windows)
- rank_engine: RankEngine, the family contract over R ranks; rank_batch: the batched runtime in lockstep
"""
