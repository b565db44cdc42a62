"""Each backend's memory model, named by its registry entry (`RolloutBackend.memory`, `TrainingBackend.memory`):
`backends` (weights, gradients, optimizer states and offload by backend; a rollout engine's reservation), and what
they need: `gpus` (the GPU table), `model` (`ModelDims`, the model's sizes), `layout` (TP / PP / EP / DP and the
layers per stage), `result` (`RankMemory`, `MemoryPlan`). Pure arithmetic, no RunConfig: the plan of a whole run
that uses them is `rlstages.tasks.driver.memory_plan`."""
