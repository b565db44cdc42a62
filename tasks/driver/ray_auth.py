"""Ray clusters we start are closed: token authentication on, and a single-node Ray listens on 127.0.0.1 only.

Ray (>= 2.5x) checks a shared secret on every gRPC call when `RAY_AUTH_MODE=token`; the token is read from
`RAY_AUTH_TOKEN` or the file `RAY_AUTH_TOKEN_PATH` (default `~/.ray/auth_token`). `ensure_token` creates that
file (0600, 256 random bits) when it is missing, and every process we start (workers, `ray start` nodes)
inherits the environment that points at it. A multi-node cluster uses the same token on every node (copy the
file, or set RAY_AUTH_TOKEN from a secret store): docs/production.md. Nothing here disables authentication;
a user who sets RAY_AUTH_MODE=disabled gets a warning.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # 0: Ray's node address is 127.0.0.1 (its servers bind there)

log = logging.getLogger(__name__)


def token_path() -> Path:
    """Where the token lives: RAY_AUTH_TOKEN_PATH, else Ray's default ~/.ray/auth_token."""
    return Path(os.environ.get(TOKEN_PATH_ENV) or Path.home() / ".ray" / "auth_token").expanduser()


def ensure_token() -> Path | None:
    """Create the token file (mode 0600) if there is neither a token nor a file; point RAY_AUTH_TOKEN_PATH at it.
    Returns the file (None when the token comes from RAY_AUTH_TOKEN)."""
    if os.environ.get(TOKEN_ENV):
        return None
    path = token_path()
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another process created it first: use theirs
            pass
        else:
            with os.fdopen(fd, "w") as fh:
                fh.write(secrets.token_hex(32))
    os.environ[TOKEN_PATH_ENV] = str(path)
    return path


def secure_env(local: bool) -> dict[str, str]:
    """The environment that turns token auth on (and, for a local single-node Ray, loopback-only addresses);
    also applied to this process. For `ray start` subprocesses pass `local=False` with --node-ip-address."""
    if os.environ.get(MODE_ENV, "token").lower() != "token":
        log.warning(
            "%s=%s: this Ray cluster accepts calls from anyone who reaches it; unset it to keep token auth on",
            MODE_ENV,
            os.environ[MODE_ENV],
        )
        return {}
    env = {MODE_ENV: "token"}
    path = ensure_token()
    if path is not None:
        env[TOKEN_PATH_ENV] = str(path)
    # 0: a local Ray binds 127.0.0.1 and takes no other node; 1 (Ray's default here) for `ray start` nodes of a
    # cluster, which must not inherit a 0 that an earlier local Ray of this process set
    env[LOOPBACK_ENV] = "0" if local else "1"
    os.environ.update(env)
    _refresh_imported_ray(local)
    return env


def _refresh_imported_ray(local: bool) -> None:
    """Ray reads these settings when it is imported; an already imported Ray is told again (what Ray's own
    `ray.init` does when it turns token auth on by default)."""
    import sys

    if "ray" not in sys.modules:
        return
    try:
        from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]  # ray private API

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = not local
    except (ImportError, AttributeError):  # another Ray: the environment still reaches every new process
        pass


# No idle workers started ahead of need: Ray starts one per CPU when a driver connects, but every actor of a run
# carries its own environment (threads, allocator), so none of them could take one; each sat idle for the whole
# run (~80 MB of RSS, ~2 s of CPU to start: in the demo and at every local Ray of the test suite).
NO_PRESTART = {"prestart_worker_first_driver": False, "enable_worker_prestart": False}


def init_local_ray(**kwargs: object) -> None:
    """`ray.init` of a new single-node Ray: token auth on, listening on 127.0.0.1, no idle workers prestarted, no
    autoscaler monitor, no dashboard process when `include_dashboard=False` (`lean_head`)."""
    import ray

    from rlstages.tasks.driver.lean_head import lean_head

    secure_env(local=True)
    system = {**NO_PRESTART, **dict(kwargs.pop("_system_config", None) or {})}  # type: ignore[call-overload]
    with lean_head(kwargs.get("include_dashboard")):  # type: ignore[arg-type]
        ray.init(_node_ip_address="127.0.0.1", _system_config=system, **kwargs)  # type: ignore[arg-type]
