"""Prefect flows (training, evaluation, conversion, deployments) and the `rlstages` command line."""

import os

# Defaults for a machine with no Prefect Cloud; the user's environment wins. Hugging Face's offline mode is the
# user's to set (HF_HUB_OFFLINE=1): hub model ids then resolve from the local cache only.
for _key, _value in {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DEDUP_LOGS": "0",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    # INFO: the run log (one line per step, evaluations, checkpoint commits, retries, recoveries) reaches the
    # terminal and the Prefect UI's log pane; successful task runs' "Finished" lines stay out of the terminal
    "PREFECT_LOGGING_LEVEL": "INFO",
}.items():
    os.environ.setdefault(_key, _value)

# The temporary Prefect server a flow starts when PREFECT_API_URL is unset (a subprocess that inherits this
# environment) runs services that serve nothing on a server living as long as one run: automations (triggers,
# actions; ~11 ms of CPU per training step on 2 cores). `rlstages server up` or PREFECT_API_URL gives a real
# server, which these never reach (`TEMPORARY_SERVER_ENV` holds those set here; `rlstages server up` leaves them
# out). Batching the task-run recorder would save more (~80 ms of server CPU per step) but, measured, made the
# server log "Error flushing N events" with a traceback when it stopped during a flush: not done.
TEMPORARY_SERVER_DEFAULTS = {
    "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_ACTIONS_ENABLED": "false",
}
TEMPORARY_SERVER_ENV: dict[str, str] = {}
if not os.environ.get("PREFECT_API_URL"):
    TEMPORARY_SERVER_ENV = {k: v for k, v in TEMPORARY_SERVER_DEFAULTS.items() if k not in os.environ}
    os.environ.update(TEMPORARY_SERVER_ENV)
