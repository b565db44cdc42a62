"""Per-process plumbing of a worker: `device` (where it computes), `heap` (its allocator), `payload` (a weight
bucket's bytes), `rendezvous` (torch.distributed wiring), `profiling`; `cuda_ipc` until it joins `sync/`. What
composes engines into workers is above `training/` and `rollout/`, in `workers/`."""
