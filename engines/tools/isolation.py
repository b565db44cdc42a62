"""The `python` tool's isolation boundary: the command line that runs one program under bubblewrap.

Each call runs `bwrap` (Debian's `bubblewrap`) with new mount, PID, network, IPC and UTS namespaces: a fresh
root holding only `/usr` (and `/lib*`), the interpreter's prefix and the `ro_binds`, all read-only; a private
size-limited tmpfs `/scratch` (the working directory, holding `main.py`, the only writable place besides a
private size-limited `/tmp`); a `/proc` of the call's own PID namespace; `/dev` with only `null`, `zero` and
`urandom`; no environment. Identity: never root inside. A root worker keeps bwrap out of user namespaces (the
user namespace would map to host root, which `RLIMIT_NPROC` does not bind) and drops to `nobody` with util-linux
`setpriv` (CAP_SETUID/CAP_SETGID are the only capabilities bwrap leaves it, and they go with the switch); any
other worker gets a user namespace mapping uid/gid 65534 with further user namespaces disabled. `no_new_privs`
is set. A seccomp filter built with libseccomp (through `pyseccomp`) and loaded by bwrap (`--seccomp FD`)
refuses (EPERM) the calls a computation never needs: `ptrace`, `mount`, `unshare`, `setns`, `clone` with a
namespace flag, `bpf`, `perf_event_open`, `keyctl`, `kexec_load`, module loading and the rest of `BLOCKED`;
`clone3` gets ENOSYS so that the C library falls back to `clone`, whose flags the filter can see. Resource
limits are set by util-linux `prlimit` inside the namespaces (after bwrap made them, so the user namespace's
process count is the call's own), then it `exec`s the interpreter. No cgroup (none is delegated here).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

SCRATCH = "/scratch"
NOBODY = 65534
# Refused with EPERM (names libseccomp knows on x86-64 and arm64; ones a kernel lacks are skipped).
BLOCKED = (
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsmount",
    "fspick",
    "mount_setattr",
    "unshare",
    "setns",
    "kexec_load",
    "kexec_file_load",
    "bpf",
    "perf_event_open",
    "keyctl",
    "add_key",
    "request_key",
    "init_module",
    "finit_module",
    "delete_module",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "userfaultfd",
    "open_by_handle_at",
    "name_to_handle_at",
    "syslog",
    "iopl",
    "ioperm",
)
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME
NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x00000080)


@functools.cache
def seccomp_bpf() -> bytes:
    """The compiled filter (allow by default; BLOCKED and namespace-making `clone`s refused), as bwrap reads it."""
    import pyseccomp as sc

    flt = sc.SyscallFilter(sc.ALLOW)
    for name in BLOCKED:
        try:
            flt.add_rule(sc.ERRNO(errno.EPERM), name)
        except (ValueError, RuntimeError, OSError):
            continue  # a call this architecture lacks
    flt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")  # its flags sit in memory the filter cannot read
    for bit in NAMESPACE_FLAGS:
        flt.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, bit, bit))
    fd = os.memfd_create("rlstages-seccomp")
    try:
        with os.fdopen(os.dup(fd), "wb") as out:
            flt.export_bpf(out)
        os.lseek(fd, 0, os.SEEK_SET)
        return os.read(fd, 1 << 20)
    finally:
        os.close(fd)


def data_fd(data: bytes) -> int:
    """A memfd holding `data`, positioned at 0 (for bwrap's `--seccomp` and `--file`); the caller closes it."""
    fd = os.memfd_create("rlstages-sandbox")
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def interpreter(python: str | None) -> tuple[str, list[str]]:
    """(the interpreter to run, the directories to mount read-only for it). Default: the base interpreter of
    the worker's Python (a venv's `python` resolves to it: the standard library only); a `python` inside a
    venv given explicitly runs as that venv (its packages), the venv and its base both mounted."""
    if python is not None:
        path = os.path.abspath(python)
        venv = os.path.dirname(os.path.dirname(path))
        if os.path.isfile(os.path.join(venv, "pyvenv.cfg")):
            base = os.path.dirname(os.path.dirname(os.path.realpath(path)))
            return path, [venv, base]
    real = os.path.realpath(python or sys.executable)
    return real, [os.path.dirname(os.path.dirname(real))]


def system_layout() -> tuple[list[str], list[tuple[str, str]]]:
    """(directories to mount read-only, (path, target) symlinks) of the system part of the sandbox's root:
    `/usr`, and `/lib*` and `/bin` as the host has them (symlinks into `/usr` on a merged-/usr system)."""
    dirs, links = ["/usr"], []
    for top in ("/lib", "/lib64", "/lib32", "/libx32", "/bin"):
        if os.path.islink(top):
            links.append((top, os.readlink(top)))
        elif os.path.isdir(top):
            dirs.append(top)
    return dirs, links


def _system_binds() -> list[str]:
    dirs, links = system_layout()
    args = []
    for path in dirs:
        args += ["--ro-bind", path, path]
    for path, target in links:
        args += ["--symlink", target, path]
    return args


def _ro_bind(path: str) -> list[str]:
    """Mount `path` read-only at the same place; its parents are made traversable (bwrap would copy a 0700
    `/root` from the host, which `nobody` cannot pass)."""
    args: list[str] = []
    parent = os.path.dirname(path)
    parents = []
    while parent not in ("/", "", "/tmp", SCRATCH):  # those two are the sandbox's own tmpfs (mode 1777)
        parents.append(parent)
        parent = os.path.dirname(parent)
    for directory in reversed(parents):
        args += ["--perms", "0755", "--dir", directory]
    return [*args, "--ro-bind", path, path]


def bwrap_argv(
    python: str | None,
    rlimits: list[tuple[str, int, int]],
    ro_binds: tuple[str, ...],
    scratch_mb: int,
    seccomp_fd: int,
    code_fd: int,
    isolate_network: bool = True,
) -> list[str]:
    """The command line of one call: bwrap, (as root) setpriv to nobody, prlimit, then `python -I main.py`."""
    real, prefixes = interpreter(python)
    root = os.geteuid() == 0
    args = ["bwrap", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if isolate_network:
        args.append("--unshare-net")
    if not root:
        args += ["--unshare-user", "--disable-userns", "--uid", str(NOBODY), "--gid", str(NOBODY)]
    args += ["--die-with-parent", "--new-session", "--clearenv", "--hostname", "sandbox"]
    args += _system_binds()
    size = str(scratch_mb * 1024 * 1024)
    args += ["--perms", "1777", "--size", size, "--tmpfs", "/tmp"]
    args += ["--perms", "1777", "--size", size, "--tmpfs", SCRATCH]
    for path in [p for p in prefixes if not p.startswith("/usr/")] + list(ro_binds):  # after /tmp's tmpfs
        args += _ro_bind(path)
    args += ["--proc", "/proc", "--dir", "/dev"]
    for dev in ("/dev/null", "/dev/zero", "/dev/urandom"):
        args += ["--dev-bind", dev, dev]
    args += ["--perms", "0644", "--file", str(code_fd), f"{SCRATCH}/main.py", "--chdir", SCRATCH]
    args += ["--remount-ro", "/"]  # the root tmpfs (not recursive: /scratch and /tmp stay writable)
    args += ["--seccomp", str(seccomp_fd)]
    if root:
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--"]
        args += ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--no-new-privs"]
    else:
        args.append("--")
    args.append("prlimit")
    for name, soft, hard in rlimits:
        args.append(f"--{name.removeprefix('RLIMIT_').lower()}={soft}:{hard}")
    args += ["--", real, "-I", "main.py"]
    return args


BACKENDS = ("auto", "bwrap", "launcher")


def backend(choice: str = "auto") -> str:
    """The backend a call uses: `auto` is bwrap where it is on PATH, else the in-process launcher (`jail.py`)."""
    if choice != "auto":
        return choice
    return "bwrap" if shutil.which("bwrap") else "launcher"


def command(
    which: str,
    python: str | None,
    rlimits: list[tuple[str, int, int]],
    ro_binds: tuple[str, ...],
    scratch_mb: int,
    seccomp_fd: int,
    code_fd: int,
    isolate_network: bool,
    jail_root: str,
) -> list[str]:
    """The command line of one call under backend `which` (`jail_root`: an empty host dir, for the launcher)."""
    if which == "bwrap":
        return bwrap_argv(python, rlimits, ro_binds, scratch_mb, seccomp_fd, code_fd, isolate_network)
    from rlstages.engines.tools.jail import jail_argv

    real, prefixes = interpreter(python)
    dirs, links = system_layout()
    mounts = dirs + [p for p in prefixes if not p.startswith("/usr/")] + list(ro_binds)
    return jail_argv(real, mounts, links, rlimits, scratch_mb, jail_root, seccomp_fd, code_fd, isolate_network)


def _tool_missing(which: str) -> str | None:
    tools = (("bwrap", "bubblewrap"), ("setpriv", "util-linux"), ("prlimit", "util-linux")) if which == "bwrap" else ()
    for tool, package in tools:
        if shutil.which(tool) is None:
            return f"{tool} not found (install Debian's {package}: apt-get install -y {package})"
    try:
        seccomp_bpf()
    except Exception as exc:  # ImportError, or libseccomp.so.2 missing
        return f"seccomp filter unavailable ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    return None


@functools.cache
def probe(python: str | None = None, choice: str = "auto") -> dict[str, Any]:
    """`probe_now`, once per process, interpreter and backend (each call of the tool asks)."""
    return probe_now(python, choice)


def _try(which: str, python: str | None) -> str | None:
    """None when a program runs in the full sandbox as uid 65534, else one line saying what went wrong."""
    seccomp_fd, code_fd = data_fd(seccomp_bpf()), data_fd(b"import os\nprint(os.getuid())\n")
    jail_root = tempfile.mkdtemp(prefix="rlstages-jail-")
    try:
        argv = command(which, python, [("RLIMIT_CORE", 0, 0)], (), 1, seccomp_fd, code_fd, True, jail_root)
        done = subprocess.run(argv, pass_fds=(seccomp_fd, code_fd), capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{which} did not run ({exc})"
    finally:
        os.close(seccomp_fd)
        os.close(code_fd)
        with contextlib.suppress(OSError):
            os.rmdir(jail_root)
    lines = (done.stderr or done.stdout).strip().splitlines()
    if done.returncode != 0 or done.stdout.strip() != str(NOBODY):
        return f"{which} refused the sandbox ({lines[-1] if lines else f'exit {done.returncode}'})"
    return None


def probe_now(python: str | None = None, choice: str = "auto") -> dict[str, Any]:
    """Which layers this machine provides, found by running a program in the full sandbox (~0.2 s):
    {"backend", "missing": None or one line naming what is missing, "layers": {layer: how}}."""
    which = backend(choice)
    missing = _tool_missing(which) or _try(which, python)
    if missing is not None:
        if choice == "auto" and which == "launcher":
            missing = f"bwrap not found (install Debian's bubblewrap: apt-get install -y bubblewrap) and {missing}"
        return {"backend": which, "missing": missing, "layers": {}}
    root = os.geteuid() == 0
    if which == "bwrap":
        version = subprocess.run(["bwrap", "--version"], capture_output=True, text=True).stdout.strip()
        fs = f"{version}: fresh root, interpreter and /usr read-only, tmpfs /scratch and /tmp"
        who = "setpriv to nobody (the worker is root)" if root else "user namespace mapping uid 65534"
        limits = "rlimits (prlimit)"
    else:
        fs = "mount namespace (the launcher, jail.py): fresh root, interpreter and /usr read-only, tmpfs /scratch, /tmp"
        who = "setuid to nobody (the worker is root)" if root else "user namespace mapping uid 65534"
        limits = "rlimits (setrlimit)"
    return {
        "backend": which,
        "missing": None,
        "layers": {
            "file system": fs,
            "processes": "own PID namespace (/proc shows only the call's processes)",
            "network": "own network namespace",
            "identity": f"uid 65534, no_new_privs ({who})",
            "seccomp": f"libseccomp filter via pyseccomp ({len(BLOCKED)} calls and namespace clones refused)",
            "resources": f"{limits}; no cgroup",
        },
    }
