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
