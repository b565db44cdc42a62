"""A simulator of asynchronous training (issue 52): a discrete-event model of rollout workers, the real bounded
queue, the trainer and weight syncs, with latencies fitted from a recorded run or a GPU profile; and the split
and eta it suggests (docs/async.md, "Simulator")."""
