"""Split placement's weight sync: a torch.distributed broadcast group from the trainer's source rank to every
process that holds rollout weights (verl / OpenRLHF's split-placement sync; gloo on CPU, NCCL on GPUs).

The group joins the trainer's source rank (rank 0, it hosts the store) and the rollout side's receiving
processes: the rollout actor itself for the HF engine, or an engine's own worker processes for engines that
keep their weights out of the actor (vLLM's workers, through `collective_rpc`): such an engine implements
`GroupReceiver` (`rlstages.engines.base`) and its workers run `membership.join_group` / `wire.receive_into`, so the
payload goes from the trainer straight into the process that loads it, with no hop through the actor.

Per bucket the source broadcasts a header (meta length, payload length, shared file generation, offset), the
JSON meta (name, dtype, shape, offset) and one flat byte payload; receivers view their copy of the payload as
the named tensors and load them. One bucket at a time on both sides: no process holds a second full copy of
the model. Every trainer rank walks `named_weights()` in step, because gathering sharded weights (ZeRO-3,
TP/PP) is a collective itself.

When every receiver runs on the source's node, the payload skips the socket (the CPU twin of verl's CUDA IPC):
the source casts each tensor straight into its own region of a shared-memory file under /dev/shm, mapped by
every member and reused by every sync, and broadcasts only the header and meta. A receiver that can adopt
tensors (`adopt_weights`, the HF engine) makes its weights views of that file, so the next sync's cast is the
only copy; others copy out of it once the source is done. One all-reduce at the end tells the source every
receiver is done. The file grows (a new, larger file) when the weights outgrow it, and each file is unlinked
once all have mapped it: the memory lives as long as the mappings, so a killed worker leaves nothing behind
in /dev/shm. Across nodes the payload is broadcast (and adopted as received).

On GPUs the group is NCCL (bf16 buckets broadcast from the source's GPU), a group of its own beside the trainer's
world group, as OpenRLHF's and TRL's sync groups are. NCCL refuses two ranks of one communicator on one GPU
("Duplicate GPU detected"), which happens when a rollout worker shares the source's GPU without sharing its
process: the driver asks every member for its GPU's UUID before forming the group and says so in one line
(`distinct_gpus`); such a layout takes the hybrid engine instead, whose push is CUDA IPC (`sync.cuda_ipc`).
Members must also agree on `NCCL_CUMEM_ENABLE` (vLLM >= 0.16 no longer forces it; the config sets it for every
worker): a mismatch is refused the same way (`same_nccl_cumem`).

Modules, one job each: `membership` (who joins, the checks NCCL needs, joining and leaving), `wire` (the bucket
protocol of the source and the receivers), `shared_region` (the same-node shared-memory file), `flat` (engines
that form the group with their own API: SGLang) and `driver` (`CollectiveSync`, the driver's round).
"""
