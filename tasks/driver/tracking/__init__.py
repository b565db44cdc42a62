"""MLflow, and only here (tests/test_dependency_rule.py): the tracking store (`store`), the run's logging
(`runs`, through the run directory's journal: `journal`, `outbox`), the model registry (`registry`), the
comparison queries of `rlstages compare` (`queries`) and the plots (`plots`).
Callers use the names below: `tracking.log_step(...)`."""

from rlstages.tasks.driver.tracking.plots import log_reward_curve
from rlstages.tasks.driver.tracking.queries import (
    RunRecord,
    compare_link,
    experiment_id,
    experiment_runs,
    metric_series,
)
from rlstages.tasks.driver.tracking.registry import log_policy, set_alias
from rlstages.tasks.driver.tracking.runs import (
    STEP_KEY,
    earlier_step_seconds,
    end,
    flush,
    last_logged_step,
    log_dataset,
    log_directory,
    log_eval_metrics,
    log_file,
    log_run_metrics,
    log_samples,
    log_step,
    log_table,
    metric_history,
    run_link,
    run_tags,
    set_tags,
    start_or_resume,
    system_tags,
    wait_for_backlog,
)
from rlstages.tasks.driver.tracking.store import DEFAULT_URI, client, store_problem, tracking_uri, tracking_uri_origin

__all__ = [
    "DEFAULT_URI",
    "STEP_KEY",
    "RunRecord",
    "client",
    "compare_link",
    "earlier_step_seconds",
    "end",
    "experiment_id",
    "experiment_runs",
    "flush",
    "last_logged_step",
    "log_dataset",
    "log_directory",
    "log_eval_metrics",
    "log_file",
    "log_policy",
    "log_reward_curve",
    "log_run_metrics",
    "log_samples",
    "log_step",
    "log_table",
    "metric_history",
    "metric_series",
    "run_link",
    "run_tags",
    "set_alias",
    "set_tags",
    "start_or_resume",
    "store_problem",
    "system_tags",
    "tracking_uri",
    "tracking_uri_origin",
    "wait_for_backlog",
]
