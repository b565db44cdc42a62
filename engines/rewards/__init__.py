"""Rewards: built-in functions, their registry, the process-pool scorer and the reward-model engine.

Deliberately imports nothing: pool workers import `rlstages.engines.rewards.registry` and `.scorer`, and must not
pay for torch or transformers (only `reward_model` needs them).
"""
