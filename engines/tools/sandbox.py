"""A sandboxed Python executor: each call runs in its own process, limited and killed as a group.

The program is written to `main.py` in a fresh temp directory (its working directory, removed afterwards) and
started through a tiny launcher (`python -I -S -c ...`) that, in the child only, enters a new network namespace
(`unshare(CLONE_NEWNET)`, or a user + network namespace when not privileged), sets resource limits (CPU
seconds, address space, file size, processes, open files, no core dumps) and then `execve`s `python -I main.py`
with an empty environment. The parent reads stdout+stderr up to a byte cap, kills the whole process group
(`start_new_session`) at the wall-clock limit or when the program exits (no background child outlives the
call) and also when the awaiting task is cancelled. Calls are asyncio subprocesses, so calls overlap.

No `preexec_fn` (unsafe in a process with threads, like a Ray worker): the launcher does the child-side work.
Where the OS refuses namespaces, the call still runs, its observation says network isolation is off, and
`require_network_isolation=True` refuses instead. Not isolated: the file system (the program can read what the
worker's user can), a child that calls `setsid()` escapes the group kill (it keeps the CPU/memory limits).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from rlstages.engines.tools.base import ToolResult

logger = logging.getLogger(__name__)

# Runs in the child before the program: namespaces, limits, then exec. Standard library only (run with -S).
_LAUNCHER = r"""
import ctypes, json, os, resource, sys
cfg = json.loads(sys.argv[1])
net = "off: not tried"
if cfg["isolate_network"]:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(0x40000000) == 0:  # CLONE_NEWNET
            net = "on (network namespace)"
        elif libc.unshare(0x10000000 | 0x40000000) == 0:  # CLONE_NEWUSER | CLONE_NEWNET
            net = "on (user + network namespace)"
        else:
            net = "off: unshare refused (" + os.strerror(ctypes.get_errno()) + ")"
    except Exception as exc:
        net = "off: " + type(exc).__name__ + ": " + str(exc)
for name, soft, hard in cfg["limits"]:
    resource.setrlimit(getattr(resource, name), (soft, hard))
os.write(cfg["status_fd"], net.encode())
os.close(cfg["status_fd"])
if cfg["require_network_isolation"] and not net.startswith("on"):
    os._exit(70)
os.execve(sys.executable, [sys.executable, "-I", "main.py"], {})
"""
_REFUSED_EXIT = 70


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed program (wall and CPU seconds, MiB of address space and file size, counts)."""

    timeout_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 1024
    max_file_mb: int = 16
    max_processes: int = 64
    max_open_files: int = 64
    max_output_bytes: int = 65536
    isolate_network: bool = True
    require_network_isolation: bool = False


@dataclass(frozen=True)
class SandboxRun:
    """What a sandboxed program did: output (stdout+stderr, capped), how it ended, and the isolation it had."""

    output: str
    returncode: int
    timed_out: bool
    truncated: bool
    network: str  # "on (...)" or "off: why"
    wall_s: float

    @property
    def error(self) -> str | None:
        """Why the run failed (None when it exited 0)."""
        if self.timed_out:
            return "wall-clock limit reached; the process group was killed"
        if self.returncode == _REFUSED_EXIT and not self.network.startswith("on"):
            return f"network isolation required but unavailable ({self.network})"
        if self.returncode in (-signal.SIGXCPU, -signal.SIGKILL) and not self.timed_out:
            return "CPU time limit reached" if self.returncode == -signal.SIGXCPU else "killed (CPU or memory limit)"
        if "MemoryError" in self.output:
            return "memory limit reached (MemoryError)"
        if self.returncode < 0:
            return f"killed by signal {signal.Signals(-self.returncode).name}"
        if self.returncode != 0:
            return f"exit status {self.returncode}"
        return None


def _rlimits(limits: SandboxLimits) -> list[tuple[str, int, int]]:
    mib = 1024 * 1024
    return [
        ("RLIMIT_CPU", limits.cpu_s, limits.cpu_s + 1),  # SIGXCPU at the soft limit, SIGKILL a second later
        ("RLIMIT_AS", limits.memory_mb * mib, limits.memory_mb * mib),
        ("RLIMIT_FSIZE", limits.max_file_mb * mib, limits.max_file_mb * mib),
        ("RLIMIT_NPROC", limits.max_processes, limits.max_processes),
        ("RLIMIT_NOFILE", limits.max_open_files, limits.max_open_files),
        ("RLIMIT_CORE", 0, 0),
    ]


async def _read_capped(stream: asyncio.StreamReader, max_bytes: int) -> tuple[bytes, bool]:
    """Everything the stream yields until EOF, keeping the first `max_bytes` (the rest is read and dropped)."""
    kept, size, dropped = [], 0, False
    while True:
        data = await stream.read(65536)
        if not data:
            return b"".join(kept), dropped
        room = max_bytes - size
        if room > 0:
            kept.append(data[:room])
            size += min(room, len(data))
        dropped = dropped or len(data) > room


async def _exited(proc: asyncio.subprocess.Process, timeout_s: float) -> bool:
    """True once the program's own process has exited, False at the timeout. Polls the return code, because
    on Python 3.11 `proc.wait()` also waits for the pipes, which a background child may hold open."""
    deadline = time.monotonic() + timeout_s
    while proc.returncode is None:
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.01)
    return True


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


async def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxRun:
    """Run `code` as `python -I main.py` in the sandbox; returns how it went (never the program's exceptions)."""
    limits = limits or SandboxLimits()
    workdir = tempfile.mkdtemp(prefix="rlstages-sandbox-")
    status_r, status_w = os.pipe()
    proc = None
    reader: asyncio.Future[tuple[bytes, bool]] | None = None
    start = time.perf_counter()
    timed_out = False
    try:
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        cfg = {
            "isolate_network": limits.isolate_network,
            "require_network_isolation": limits.require_network_isolation,
            "limits": _rlimits(limits),
            "status_fd": status_w,
        }
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-I",
            "-S",
            "-c",
            _LAUNCHER,
            json.dumps(cfg),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            cwd=workdir,
            env={},
            start_new_session=True,
            pass_fds=(status_w,),
        )
        os.close(status_w)
        status_w = -1
        assert proc.stdout is not None
        reader = asyncio.ensure_future(_read_capped(proc.stdout, limits.max_output_bytes))
        timed_out = not await _exited(proc, limits.timeout_s)
        _kill_group(proc.pid)  # the program's leftover children too
        await proc.wait()
        try:
            output, dropped = await asyncio.wait_for(reader, 1.0)
        except TimeoutError:  # a child outside the group still holds the pipe
            reader.cancel()
            output, dropped = b"", True
        os.set_blocking(status_r, False)
        try:
            network = os.read(status_r, 512).decode() or "off: the launcher did not start"
        except BlockingIOError:
            network = "off: the launcher did not report"
        return SandboxRun(
            output=output.decode("utf-8", errors="replace"),
            returncode=proc.returncode if proc.returncode is not None else -1,
            timed_out=timed_out,
            truncated=dropped,
            network=network,
            wall_s=time.perf_counter() - start,
        )
    finally:
        if proc is not None and proc.returncode is None:  # cancelled (e.g. the runner's timeout): kill
            _kill_group(proc.pid)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()  # asyncio's child watcher reaps it
        if reader is not None and not reader.done():
            reader.cancel()
        for fd in (status_r, status_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        shutil.rmtree(workdir, ignore_errors=True)


class PythonSandbox:
    """The `python` tool: `{"code": "print(6 * 7)"}` -> its stdout/stderr; stateless (each call a fresh process)."""

    name = "python"
    stateful = False

    def __init__(
        self,
        timeout_s: float = 5.0,
        cpu_s: int = 5,
        memory_mb: int = 1024,
        max_file_mb: int = 16,
        max_processes: int = 64,
        max_open_files: int = 64,
        max_output_bytes: int = 65536,
        isolate_network: bool = True,
        require_network_isolation: bool = False,
    ) -> None:
        """Limits of each call (see `SandboxLimits`); keep `timeout_s` below the tool's configured timeout."""
        self.limits = SandboxLimits(
            timeout_s=timeout_s,
            cpu_s=cpu_s,
            memory_mb=memory_mb,
            max_file_mb=max_file_mb,
            max_processes=max_processes,
            max_open_files=max_open_files,
            max_output_bytes=max_output_bytes,
            isolate_network=isolate_network,
            require_network_isolation=require_network_isolation,
        )

    def schema(self) -> dict[str, Any]:
        """OpenAI-style function schema."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": (
                    "Run a Python 3 program in a sandbox (no network, limited time and memory); "
                    "returns what it prints (stdout and stderr)."
                ),
                "parameters": {
                    "type": "object",
                    "properties": {"code": {"type": "string", "description": "the program; print the result"}},
                    "required": ["code"],
                },
            },
        }

    async def call(self, arguments: dict[str, Any]) -> ToolResult:
        """Run `arguments["code"]`; limits hit and non-zero exits come back as error results with the output."""
        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolResult(text="Error: code must be a string", error="code must be a string")
        return observation(await run_python(code, self.limits), self.limits)


_warned_network = False


def observation(run: SandboxRun, limits: SandboxLimits) -> ToolResult:
    """The tool's result for a run: its output, then notes (cut output, isolation asked for but off, the error)."""
    global _warned_network
    text = run.output
    if run.truncated:
        text += f"\n[output cut at {limits.max_output_bytes} bytes]"
    if limits.isolate_network and not run.network.startswith("on"):
        text += f"\n[sandbox: network isolation {run.network}]"
        if not _warned_network:
            logger.warning("python sandbox: network isolation %s", run.network)
            _warned_network = True
    error = run.error
    if error is not None:
        text += f"\nError: {error}"
    return ToolResult(text=text, error=error, truncated=run.truncated)
