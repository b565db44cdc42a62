"""Prefect flows (training, evaluation, conversion, deployments) and the `rlstages` command line."""

import os

# Defaults for a machine with no Prefect Cloud; the user's environment wins. Hugging Face's offline mode is the
# user's to set (HF_HUB_OFFLINE=1): hub model ids then resolve from the local cache only.
for _key, _value in {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DEDUP_LOGS": "0",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "PREFECT_LOGGING_LEVEL": "WARNING",
}.items():
    os.environ.setdefault(_key, _value)
