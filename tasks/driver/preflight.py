"""Pre-flight: every input a run depends on is checked before a directory, Ray, Prefect or MLflow starts.

`preflight(cfg)` runs the checks of `CHECKS` in order, cheapest first, and raises `PreflightError` (one line:
the field or file, and what was expected) for the first problem; it returns warnings (e.g. prompts to be
truncated). What a run would find out only once it has started is rehearsed here where that is cheap: the
LoRA wrapper is built on the meta device, the tracking store's URI is opened without writing, a local
cluster's GPUs and CPUs are counted, data paths that look local must exist. `rlstages run`, `resume` and
`config show` run every check; `eval` and `deploy` skip the ones that do not apply to them.

Adding a check: write `def check_<what>(cfg: RunConfig) -> list[str] | None` in `checks/` that raises
`PreflightError("<field>: <value> <what is wrong>; <what was expected>")` and may return warnings, and put
it in `CHECKS` (cheap checks before expensive ones); a row in tests/flows/test_bad_inputs.py shows it works.
A check never creates, changes or starts anything.
"""

from __future__ import annotations

from collections.abc import Collection

from rlstages.configs import RunConfig
from rlstages.tasks.driver.checks import Check, PreflightError
from rlstages.tasks.driver.checks.config import (
    check_backend_packages,
    check_backends,
    check_context_parallel,
    check_faults,
    check_freeze,
    check_import_allowed,
    check_imports,
    check_lora_targets,
    check_models,
    check_multi_turn,
    check_profile,
    check_replay,
    check_run_dir,
    check_run_name,
    check_tool_isolation,
    check_tracking_store,
)
from rlstages.tasks.driver.checks.resources import check_cluster_resources
from rlstages.tasks.driver.data.checks import check_data_files, check_data_rows, check_images, check_prompt_lengths

__all__ = [
    "CHECKS",
    "Check",
    "PreflightError",
    "check_import_allowed",
    "check_multi_turn",
    "check_run_dir",
    "check_tool_isolation",
    "preflight",
]


def preflight(cfg: RunConfig, measure_prompts: bool = True, skip: Collection[Check] = ()) -> list[str]:
    """Run every check of `CHECKS` but those in `skip` (and the prompt measurement unless `measure_prompts`);
    returns their warnings. Any problem is a PreflightError (its message names the field or file)."""
    skipped = set(skip) | (set() if measure_prompts else {check_prompt_lengths})
    warnings: list[str] = []
    for check in CHECKS:
        if check in skipped:
            continue
        try:
            warnings += check(cfg) or []
        except PreflightError:
            raise
        except (ValueError, OSError) as exc:  # the checks that other modules own say the field or file too
            raise PreflightError(str(exc)) from None
    return warnings


# The pre-flight, in order: cheap checks of the config and the files first, then what imports or reads more.
CHECKS: tuple[Check, ...] = (
    check_run_name,
    check_profile,
    check_faults,
    check_replay,
    check_backends,
    check_models,
    check_freeze,
    check_data_files,
    check_imports,
    check_tracking_store,
    check_lora_targets,
    check_tool_isolation,
    check_multi_turn,
    check_context_parallel,
    check_prompt_lengths,
    check_data_rows,
    check_images,
    check_run_dir,
    check_backend_packages,
    check_cluster_resources,
)
