"""Local Prefect and MLflow servers for people who want the UIs: `rlstages server up | down | status`.

`up` starts `prefect server start` and `mlflow server` as detached processes (each the leader of its own
process group, logging into the state directory), waits until both answer their health endpoints, and
records PIDs, ports and URLs in `<dir>/servers.json`. `down` stops exactly those process groups by PID
(SIGTERM, then SIGKILL after a grace period); nothing is killed by name. The integration tests start their
servers the same way. Production servers (Postgres, object storage) are described in docs/production.md.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from rlstages.flows import TEMPORARY_SERVER_ENV

STATE_FILE = "servers.json"
_BIN = Path(sys.executable).parent
out = Console()
err = Console(stderr=True)


@dataclass(frozen=True)
class Server:
    """One started server: what it is, where it answers, and the process group that runs it."""

    name: str
    pid: int
    url: str
    health: str
    log: str
    log_from: int = 0  # the log's size when this start began: what the start wrote follows it

    @property
    def api_url(self) -> str:
        """The URL clients are configured with (PREFECT_API_URL / MLFLOW_TRACKING_URI)."""
        return f"{self.url}/api" if self.name == "prefect" else self.url


def _port_taken(host: str, port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex((host, port)) == 0


def _inherited_env() -> dict[str, str]:
    """This process's environment without the settings rlstages chose for a flow's temporary Prefect server
    (a started server is a real one: automations on, task runs recorded as Prefect records them)."""
    return {k: v for k, v in os.environ.items() if TEMPORARY_SERVER_ENV.get(k) != v}


def _spawn(name: str, cmd: list[str], log: Path, env: dict[str, str], cwd: Path | None = None) -> tuple[int, int]:
    """Start `cmd` detached in its own session (so its whole process tree can be stopped by PID); its PID and
    where its output starts in `log` (appended to)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as fh:
        start = fh.tell()
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=fh,
            stderr=subprocess.STDOUT,
            env={**_inherited_env(), **env},
            cwd=cwd,
            start_new_session=True,
        )
    return proc.pid, start


def start_prefect(home: Path, port: int, host: str = "127.0.0.1", ui: bool = True) -> Server:
    """`prefect server start` with its SQLite database in `home` (PREFECT_HOME)."""
    home.mkdir(parents=True, exist_ok=True)
    env = {
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_UI_ENABLED": "true" if ui else "false",
        "PREFECT_SERVER_LOGGING_LEVEL": "WARNING",
        "PREFECT_SERVER_DATABASE_TIMEOUT": "30",  # SQLite waits for its lock instead of answering 503 when busy
        "PREFECT_UI_API_URL": f"http://{host}:{port}/api",  # else the UI calls the default port 4200
    }
    cmd = [str(_BIN / "prefect"), "server", "start", "--host", host, "--port", str(port)]
    log = home / "prefect-server.log"
    pid, log_from = _spawn("prefect", cmd, log, env)
    url = f"http://{host}:{port}"
    return Server("prefect", pid, url, f"{url}/api/health", str(log), log_from)


def start_mlflow(
    backend_uri: str, artifacts: Path, port: int, host: str = "127.0.0.1", log_dir: Path | None = None
) -> Server:
    """`mlflow server` on `backend_uri` (e.g. sqlite:///mlflow.db), proxying artifacts stored in `artifacts`."""
    artifacts.mkdir(parents=True, exist_ok=True)
    cmd = [
        str(_BIN / "mlflow"),
        "server",
        "--backend-store-uri",
        backend_uri,
        "--artifacts-destination",
        str(artifacts.resolve()),
        "--host",
        host,
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    log = (log_dir or artifacts.parent) / "mlflow-server.log"
    pid, log_from = _spawn("mlflow", cmd, log, {"MLFLOW_ENABLE_ASYNC_LOGGING": "false"})
    url = f"http://{host}:{port}"
    return Server("mlflow", pid, url, f"{url}/health", str(log), log_from)


def alive(pid: int) -> bool:
    """True while the process group led by `pid` has any member left."""
    try:
        os.killpg(pid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def wait_healthy(server: Server, timeout: float = 180.0) -> float:
    """Poll the health endpoint (bounded by `timeout`); returns the seconds it took, raises if it never answers or
    the server exits first (checked before each poll: a port another process listens on holds a poll its 5 s). A
    server that logged its port taken has failed at once: its process group is stopped rather than waited for (on a
    loaded 2-core machine its process group outlived its failed web server by over 35 s)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if not _leader_running(server.pid):
            raise RuntimeError(_start_failure(server))
        if _port_lost(server):
            stop(server.pid)
            raise RuntimeError(_start_failure(server))
        try:
            with urllib.request.urlopen(server.health, timeout=5) as resp:
                if resp.status == 200:
                    return time.monotonic() - start
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{server.name} server did not answer {server.health} within {timeout:.0f} s; see {server.log}")


def _start_failure(server: Server) -> str:
    """The line for a server that exited during start-up: its port taken where what this start logged says so (a
    port free when it was chosen can be another process's by the time the server binds it)."""
    if _port_lost(server):
        return f"{server.name} server exited during start-up: {server.url} is taken; see {server.log}"
    return f"{server.name} server exited during start-up; see {server.log}"


def _port_lost(server: Server) -> bool:
    """Whether what this start logged says its port is taken (uvicorn's bind error)."""
    try:
        with open(server.log, "rb") as fh:
            fh.seek(server.log_from)
            return b"address already in use" in fh.read().lower()
    except OSError:
        return False


def _leader_running(pid: int) -> bool:
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)  # reap our own child if it died
        if waited == pid:
            return False
    except ChildProcessError:
        pass
    return alive(pid)


def _ours(pgid: int, name: str) -> bool:
    """Some process of group `pgid` still runs our server command (a reused PID is left alone)."""
    import psutil

    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if os.getpgid(proc.pid) == pgid and name in " ".join(proc.info["cmdline"] or []):
                return True
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return False


def stop(pid: int, grace: float = 15.0) -> bool:
    """Stop the process group led by `pid`: SIGTERM, then SIGKILL after `grace` seconds. True when it is gone."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return True
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            _leader_running(pid)
            if not alive(pid):
                return True
            time.sleep(0.2)
    return not alive(pid)


def up(
    state_dir: Path,
    prefect_port: int = 4200,
    mlflow_port: int = 5000,
    mlflow_backend: str = "sqlite:///mlflow.db",
    host: str = "127.0.0.1",
    timeout: float = 180.0,
) -> dict[str, Server]:
    """Start both servers (concurrently), wait for their health endpoints, and write the state file."""
    state_dir.mkdir(parents=True, exist_ok=True)
    if (state_dir / STATE_FILE).is_file() and any(alive(s.pid) for s in read_state(state_dir).values()):
        raise RuntimeError(f"servers from {state_dir / STATE_FILE} are still running; `rlstages server down` first")
    for name, port in (("prefect", prefect_port), ("mlflow", mlflow_port)):
        if _port_taken(host, port):
            raise RuntimeError(f"{host}:{port} is taken; choose another --{name}-port")
    servers = {
        "prefect": start_prefect(state_dir / "prefect", prefect_port, host),
        "mlflow": start_mlflow(mlflow_backend, state_dir / "mlartifacts", mlflow_port, host, state_dir),
    }
    (state_dir / STATE_FILE).write_text(json.dumps({k: asdict(v) for k, v in servers.items()}, indent=2))
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda s: wait_healthy(s, timeout), servers.values()))
    except BaseException:
        down(state_dir)
        raise
    return servers


def read_state(state_dir: Path) -> dict[str, Server]:
    """The servers recorded by `up` in `state_dir` (empty when there is no state file)."""
    path = state_dir / STATE_FILE
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
        return {str(k): Server(**v) for k, v in raw.items()}
    except (OSError, UnicodeDecodeError, ValueError, TypeError, AttributeError) as exc:
        raise ValueError(
            f"{path}: damaged server state file ({type(exc).__name__}); stop the servers by the PIDs in their logs "
            "and remove the file"
        ) from None


def down(state_dir: Path) -> dict[str, bool]:
    """Stop the servers recorded in `state_dir` by PID; returns {name: stopped}."""
    result = {}
    for name, server in read_state(state_dir).items():
        result[name] = stop(server.pid) if _ours(server.pid, name) else True
    (state_dir / STATE_FILE).unlink(missing_ok=True)
    return result


def healthy(server: Server, timeout: float = 3.0) -> bool:
    """One bounded health request."""
    try:
        with urllib.request.urlopen(server.health, timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _fail(message: str, code: int) -> NoReturn:
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


server_app = typer.Typer(help="Local Prefect and MLflow servers (UIs on 127.0.0.1).", no_args_is_help=True)
StateDir = Annotated[Path, typer.Option("--dir", help="Where the servers keep their data, logs and PIDs.")]


@server_app.command("up")
def up_command(
    state_dir: StateDir = Path(".rlstages"),
    prefect_port: Annotated[int, typer.Option(help="Prefect API and UI port.")] = 4200,
    mlflow_port: Annotated[int, typer.Option(help="MLflow tracking server and UI port.")] = 5000,
    mlflow_backend: Annotated[
        str, typer.Option(help="MLflow backend store; the default is the one local runs write to.")
    ] = "sqlite:///mlflow.db",
    host: Annotated[str, typer.Option(help="Bind address.")] = "127.0.0.1",
) -> None:
    """Start a Prefect server and an MLflow server in the background and wait until both answer."""
    if not is_loopback(host):
        err.print(
            f"[yellow]warning:[/] --host {escape(host)} exposes Prefect and MLflow, which have no authentication "
            "here, to every machine that reaches it; put them behind an authenticating proxy (docs/production.md)",
            highlight=False,
            soft_wrap=True,
        )
    try:
        servers = up(state_dir, prefect_port, mlflow_port, mlflow_backend, host)
    except ValueError as exc:
        _fail(str(exc), 2)
    except (RuntimeError, TimeoutError) as exc:
        _fail(str(exc), 1)
    table = Table("server", "UI", "pid", "log")
    for s in servers.values():
        table.add_row(s.name, s.url, str(s.pid), s.log)
    out.print(table)
    out.print(f"export PREFECT_API_URL={servers['prefect'].api_url}", highlight=False, soft_wrap=True)
    out.print(f"export MLFLOW_TRACKING_URI={servers['mlflow'].api_url}", highlight=False, soft_wrap=True)
    out.print(f"runs log there with: tracking.tracking_uri={servers['mlflow'].api_url}", highlight=False)


@server_app.command("down")
def down_command(state_dir: StateDir = Path(".rlstages")) -> None:
    """Stop the servers `up` started (by their recorded PIDs)."""
    try:
        result = down(state_dir)
    except ValueError as exc:
        _fail(str(exc), 2)
    if not result:
        out.print(f"no servers recorded in {escape(str(state_dir))}")
    for name, stopped in result.items():
        out.print(f"{name}: {'stopped' if stopped else '[red]still running[/]'}")
    if not all(result.values()):
        raise typer.Exit(1)


@server_app.command("status")
def status_command(state_dir: StateDir = Path(".rlstages")) -> None:
    """Show whether the recorded servers run and answer."""
    try:
        servers = read_state(state_dir)
    except ValueError as exc:
        _fail(str(exc), 2)
    if not servers:
        out.print(f"no servers recorded in {escape(str(state_dir))}")
        return
    table = Table("server", "url", "pid", "process", "health")
    for s in servers.values():
        table.add_row(s.name, s.url, str(s.pid), "up" if alive(s.pid) else "gone", "ok" if healthy(s) else "no answer")
    out.print(table)
