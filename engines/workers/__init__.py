"""The composition layer: engines put together into workers, above `training/` and `rollout/`.

`actor_group` (plain engine classes as named Ray actors, or in-process objects, with a dispatch proxy), `hybrid`
(a trainer and a rollout engine in one worker: verl's hybrid engine) and `offload` (a GPU trainer's memory handed to
its colocated engine while it generates). The per-process plumbing they use is below, in `runtime/`; the weight
transports in `sync/`.
"""
