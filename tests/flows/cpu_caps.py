"""Ray worker processes held to a fixed share of one CPU each (the cgroup `cpu` controller: v1's
`cpu.cfs_quota_us`, or v2's `cpu.max`), so that N workers on this machine's two cores act as N equal, slower
devices that do not slow each other down: a rollout:trainer split measured as a cluster would run it. Needs root
and a writable cpu controller (`CpuCaps.available`); every process is moved back and every group removed on exit.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path
from types import TracebackType

import psutil

V1 = Path("/sys/fs/cgroup/cpu")
V2 = Path("/sys/fs/cgroup")
PERIOD_US = 100_000


def _root() -> tuple[Path, bool] | None:
    """The cpu controller's root and whether it is v2; None where neither is there to write."""
    if (V1 / "cpu.cfs_quota_us").exists():
        return (V1, False) if os.access(V1, os.W_OK) else None
    controllers = V2 / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split() and os.access(V2, os.W_OK):
        return V2, True
    return None


class CpuCaps:
    """While open, each `ray::` process (a Ray worker: actors, idle pool workers) gets a cgroup of its own capped at
    `share` of a CPU; a thread looks for new ones every `poll_s` seconds."""

    def __init__(self, share: float, poll_s: float = 0.05) -> None:
        found = _root()
        if found is None:
            raise RuntimeError("no writable cgroup cpu controller (needs root)")
        self.root, self.v2 = found
        self.share, self.poll_s = share, poll_s
        self.base = self.root / f"rlstages-caps-{os.getpid()}"
        self.capped: set[int] = set()  # each in its own group, `base / pid`
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="cpu-caps", daemon=True)

    @staticmethod
    def available() -> bool:
        """Whether caps can be set here (a writable cgroup cpu controller)."""
        return _root() is not None

    def __enter__(self) -> CpuCaps:
        self.base.mkdir()
        if self.v2:
            (self.base / "cgroup.subtree_control").write_text("+cpu")
        self.thread.start()
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.stop.set()
        self.thread.join()
        for group in (self.base / str(pid) for pid in self.capped):
            self._remove(group)
        self.base.rmdir()

    def _remove(self, group: Path, wait_s: float = 10.0) -> None:
        """Move the group's processes back to the root and remove it; a process still exiting keeps a group busy
        (EBUSY) for a moment: try again for up to `wait_s` seconds."""
        deadline = time.monotonic() + wait_s
        while True:
            for pid in (group / "cgroup.procs").read_text().split():
                try:
                    (self.root / "cgroup.procs").write_text(pid)
                except OSError:  # gone meanwhile
                    pass
            try:
                group.rmdir()
                return
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise
            time.sleep(0.2)

    def _watch(self) -> None:
        while not self.stop.wait(self.poll_s):
            for proc in psutil.process_iter(["pid", "cmdline"]):
                cmdline = proc.info["cmdline"] or []
                if proc.info["pid"] in self.capped or not cmdline or not cmdline[0].startswith("ray::"):
                    continue
                self._cap(proc.info["pid"])

    def _cap(self, pid: int) -> None:
        group = self.base / str(pid)
        group.mkdir(exist_ok=True)
        quota = int(self.share * PERIOD_US)
        if self.v2:
            (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        else:
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(quota))
        self.capped.add(pid)
        try:
            (group / "cgroup.procs").write_text(str(pid))
        except OSError:  # it ended before it could be moved
            pass
