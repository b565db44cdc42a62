"""The driver's Prefect-free services: cluster and placement, engine specs, Ray auth, data, tracking, the
pre-flight, the run directory. Below the stage tasks of `rlstages.tasks`, above `rlstages.engines`; never
imports Prefect (tests/test_dependency_rule.py)."""
