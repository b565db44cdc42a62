"""Running one Python program in a sandbox: its own process, limited and killed as a group (`run_python`); the
`python` tool (`sandbox.py`) calls it once per call.

By default (`require_isolation=True`) a call is a real boundary (`isolation.py`): bubblewrap, or where it is
not installed the launcher of `jail.py`, gives the program a fresh read-only root with the interpreter, a
tmpfs `/scratch` (its working dir, holding `main.py`) and `/tmp`, its own PID and network namespaces, uid
65534 with `no_new_privs`, a seccomp filter and rlimits. Where this machine cannot provide a layer the call is
refused, in one line naming what is missing (`SandboxRun.refused`); nothing runs.

With `require_isolation=False` (said in the config) the older launcher runs it: `main.py` in a fresh temp dir
(removed afterwards), `python -I -S -c _LAUNCHER` enters new network and PID namespaces (`unshare` via ctypes;
with a user namespace when not privileged), sets the rlimits, optionally drops to `user=` (when the worker is
root), and `execve`s `python -I main.py` with an empty environment; the file system is as its user sees it.

Either way the parent reads stdout+stderr up to a byte cap and kills the whole process group
(`start_new_session`) at the wall-clock limit, when the program exits, and when the awaiting task is
cancelled; in the PID namespace the program runs under an init, so its end takes every descendant with it, even
one that called `setsid()`. Calls are asyncio subprocesses, so calls overlap. No `preexec_fn` (unsafe in a
process with threads, like a Ray worker): launchers do the child-side work.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass

from rlstages.engines.tools import isolation

# Runs in the child before the program: namespaces, limits, privilege drop, then exec. Standard library only
# (run with -S). With a PID namespace it forks an init (PID 1, which reaps orphans; the kernel ignores the
# rlimit signals sent to a namespace's init, so the program must not be PID 1) that forks the program; when the
# program exits the init reports its wait status and exits, and the kernel kills whatever is left in the
# namespace, `setsid()` or not. The launcher exits as the program did (same code, same signal).
_LAUNCHER = r"""
import ctypes, json, os, resource, signal, sys
cfg = json.loads(sys.argv[1])
NEWNET, NEWUSER, NEWPID = 0x40000000, 0x10000000, 0x20000000
libc = ctypes.CDLL(None, use_errno=True)
net = "off: not asked" if not cfg["isolate_network"] else "off: unshare refused"
pidns = False
want = (NEWNET if cfg["isolate_network"] else 0) | NEWPID
tries = ((want, ""), (want | NEWUSER, "user + "), (want & ~NEWPID, ""), (want & ~NEWPID | NEWUSER, "user + "))
for flags, how in tries:
    if flags and libc.unshare(flags) == 0:
        pidns = bool(flags & NEWPID)
        if flags & NEWNET:
            net = "on (" + how + "network namespace)"
        break
else:
    if cfg["isolate_network"]:
        net = "off: unshare refused (" + os.strerror(ctypes.get_errno()) + ")"
for name, soft, hard in cfg["limits"]:
    resource.setrlimit(getattr(resource, name), (soft, hard))
os.write(cfg["status_fd"], json.dumps({"network": net, "pid_namespace": pidns}).encode())
os.close(cfg["status_fd"])
if cfg["require_network_isolation"] and not net.startswith("on"):
    os._exit(70)

def program():
    if cfg["uid"] is not None:
        os.setgroups([])
        os.setgid(cfg["gid"])
        os.setuid(cfg["uid"])
    os.execve(cfg["python"], [cfg["python"], "-I", "main.py"], {})

if not pidns:
    program()
report_r, report_w = os.pipe()
init = os.fork()
if init == 0:
    os.close(report_r)
    child = os.fork()
    if child == 0:
        os.close(report_w)
        program()
    while True:
        pid, status = os.wait()
        if pid == child:
            os.write(report_w, str(status).encode())
            os._exit(0)
os.close(report_w)
os.waitpid(init, 0)
status = int(os.read(report_r, 64) or b"9")
if os.WIFSIGNALED(status):
    sig = os.WTERMSIG(status)
    signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
os._exit(os.WEXITSTATUS(status))
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
    python: str | None = None  # the program's interpreter (default: this process's)
    user: str | None = None  # unisolated only, when the worker is root: run the program as this user
    require_isolation: bool = True  # bubblewrap + seccomp + nobody, or refuse; False: the launcher only
    ro_binds: tuple[str, ...] = ()  # isolated: host paths mounted read-only at the same place
    scratch_mb: int = 64  # isolated: size of the tmpfs /scratch (the working dir) and of the private /tmp
    isolation_backend: str = "auto"  # bwrap where installed, else the launcher (jail.py); or name one


@dataclass(frozen=True)
class SandboxRun:
    """What a sandboxed program did: output (stdout+stderr, capped), how it ended, and the isolation it had."""

    output: str
    returncode: int
    timed_out: bool
    truncated: bool
    network: str  # "on (...)" or "off: why"
    wall_s: float
    pid_namespace: bool = False  # the program ran in its own PID namespace (under a tiny init)
    isolated: bool = False  # ran under bubblewrap (file system, identity, seccomp)
    refused: str | None = None  # isolation required, and this layer is missing: not run

    @property
    def error(self) -> str | None:
        """Why the run failed (None when it exited 0)."""
        if self.refused is not None:
            return f"isolation required but unavailable: {self.refused}"
        if self.timed_out:
            return "wall-clock limit reached; the process group was killed"
        if self.returncode == _REFUSED_EXIT and not self.network.startswith("on"):
            return f"network isolation required but unavailable ({self.network})"
        if self.returncode in (-signal.SIGXCPU, -signal.SIGKILL) and not self.timed_out:
            return "CPU time limit reached" if self.returncode == -signal.SIGXCPU else "killed (CPU or memory limit)"
        if self.returncode < 0:
            try:
                return f"killed by signal {signal.Signals(-self.returncode).name}"
            except ValueError:
                return f"killed by signal {-self.returncode}"
        if self.returncode != 0 and "MemoryError" in self.output:
            return "memory limit reached (MemoryError)"
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
    kept: list[bytes] = []
    size, dropped = 0, False
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


def check_limits(limits: SandboxLimits) -> None:
    """Refuse (one-line ValueError) an interpreter that is not an executable file, or a `user` that does not
    exist or cannot be switched to (the worker is not root)."""
    python = limits.python or sys.executable
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise ValueError(f"python: {python!r} is not an executable file")
    if limits.user is not None:
        try:
            pwd.getpwnam(limits.user)
        except KeyError:
            raise ValueError(f"user: no such user {limits.user!r}") from None
        if os.geteuid() != 0:
            raise ValueError(f"user: switching to {limits.user!r} needs root; leave user unset")
        if limits.require_isolation:
            raise ValueError("user: only with require_isolation: false (the isolated sandbox always runs as nobody)")
    for path in limits.ro_binds:
        if not (isinstance(path, str) and os.path.isabs(path) and os.path.exists(path)):
            raise ValueError(f"ro_binds: {path!r} is not an existing absolute path")
        if os.path.normpath(path) in ("/", "/proc", "/dev", isolation.SCRATCH, "/tmp"):
            raise ValueError(f"ro_binds: {path!r} would hide or expose the sandbox's own mounts")
    if limits.isolation_backend not in isolation.BACKENDS:
        raise ValueError(
            f"isolation_backend: expected one of {', '.join(isolation.BACKENDS)}, got {limits.isolation_backend!r}"
        )
    if limits.scratch_mb < 1:
        raise ValueError(f"scratch_mb: expected at least 1, got {limits.scratch_mb}")


async def _supervise(
    argv: list[str], limits: SandboxLimits, cwd: str, pass_fds: tuple[int, ...]
) -> tuple[bytes, bool, int, bool]:
    """Start `argv` in its own session; read its output up to the cap; kill its group when it exits, at the
    wall-clock limit, or when cancelled. (output, output cut, return code, timed out)."""
    proc = None
    reader: asyncio.Future[tuple[bytes, bool]] | None = None
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            cwd=cwd,
            env={},
            start_new_session=True,
            pass_fds=pass_fds,
        )
        for fd in pass_fds:
            os.close(fd)
        pass_fds = ()
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
        return output, dropped, proc.returncode if proc.returncode is not None else -1, timed_out
    finally:
        if proc is not None and proc.returncode is None:  # cancelled (e.g. the runner's timeout): kill
            _kill_group(proc.pid)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()  # asyncio's child watcher reaps it
        if reader is not None and not reader.done():
            reader.cancel()
        for fd in pass_fds:
            with contextlib.suppress(OSError):
                os.close(fd)


async def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxRun:
    """Run `code` as `python -I main.py` in the sandbox; returns how it went (never the program's exceptions).
    With `require_isolation` (the default) under bubblewrap (`isolation.py`), refused where a layer is missing;
    without, through the launcher (network and PID namespaces and rlimits only)."""
    limits = limits or SandboxLimits()
    if limits.require_isolation:
        return await _run_isolated(code, limits)
    return await _run_unisolated(code, limits)


async def _run_isolated(code: str, limits: SandboxLimits) -> SandboxRun:
    start = time.perf_counter()
    found = await asyncio.to_thread(isolation.probe, limits.python, limits.isolation_backend)
    if found["missing"] is not None:
        return SandboxRun("", _REFUSED_EXIT, False, False, "off", time.perf_counter() - start, refused=found["missing"])
    seccomp_fd = isolation.data_fd(isolation.seccomp_bpf())
    code_fd = isolation.data_fd(code.encode("utf-8"))
    launcher = found["backend"] == "launcher"
    jail_root = tempfile.mkdtemp(prefix="rlstages-jail-") if launcher else ""  # its mount point, empty on the host
    try:
        argv = isolation.command(
            found["backend"],
            limits.python,
            _rlimits(limits),
            limits.ro_binds,
            limits.scratch_mb,
            seccomp_fd,
            code_fd,
            limits.isolate_network,
            jail_root,
        )
        output, dropped, returncode, timed_out = await _supervise(argv, limits, "/", (seccomp_fd, code_fd))
    finally:
        if jail_root:
            with contextlib.suppress(OSError):
                os.rmdir(jail_root)
    if found["backend"] == "bwrap" and returncode > 128:  # bwrap exits 128 + N when the program died of signal N
        returncode = -(returncode - 128)
    return SandboxRun(
        output=output.decode("utf-8", errors="replace"),
        returncode=returncode,
        timed_out=timed_out,
        truncated=dropped,
        network="on (network namespace)" if limits.isolate_network else "off: not asked",
        wall_s=time.perf_counter() - start,
        pid_namespace=True,
        isolated=True,
    )


async def _run_unisolated(code: str, limits: SandboxLimits) -> SandboxRun:
    owner = pwd.getpwnam(limits.user) if limits.user is not None else None
    workdir = tempfile.mkdtemp(prefix="rlstages-sandbox-")
    status_r, status_w = os.pipe()
    start = time.perf_counter()
    try:
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        if owner is not None:
            for path in (workdir, os.path.join(workdir, "main.py")):
                os.chown(path, owner.pw_uid, owner.pw_gid)
        cfg = {
            "python": limits.python or sys.executable,
            "uid": owner.pw_uid if owner else None,
            "gid": owner.pw_gid if owner else None,
            "isolate_network": limits.isolate_network,
            "require_network_isolation": limits.require_network_isolation,
            "limits": _rlimits(limits),
            "status_fd": status_w,
        }
        argv = [sys.executable, "-I", "-S", "-c", _LAUNCHER, json.dumps(cfg)]
        fds, status_w = (status_w,), -1  # _supervise closes it
        output, dropped, returncode, timed_out = await _supervise(argv, limits, workdir, fds)
        os.set_blocking(status_r, False)
        try:
            status = json.loads(os.read(status_r, 4096).decode() or "{}")
        except (BlockingIOError, ValueError):
            status = {}
        network = status.get("network", "off: the launcher did not report")
        return SandboxRun(
            output=output.decode("utf-8", errors="replace"),
            returncode=returncode,
            timed_out=timed_out,
            truncated=dropped,
            network=network,
            wall_s=time.perf_counter() - start,
            pid_namespace=bool(status.get("pid_namespace")),
        )
    finally:
        for fd in (status_r, status_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        shutil.rmtree(workdir, ignore_errors=True)
