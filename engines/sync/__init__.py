"""Trainer -> rollout weight sync: one `WeightSync` class per transport, chosen once when the workers are built.

`protocol` (the `WeightSync` Protocol, `SyncRound`, what a transport needs of the rollout side), `buckets` (the one
bucketizer every transport shares, and the object store's encoding), `registry` (the lazy table of transports and
the choice by placement, cluster mode and device), the transports: `object_store`, `in_process` (in-process copy:
all engines in the driver, or a hybrid worker's), `collective` (a gloo / NCCL broadcast group, its payload through a
shared-memory file on one node), `shm_files` and `cuda_ipc` (a colocated engine's own worker processes, by its
device). Below `training/` and `rollout/` (they use the bucketizer and the receiving sides); above `runtime/`.
"""
