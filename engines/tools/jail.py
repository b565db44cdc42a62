"""The fallback of the `python` tool's isolation where bubblewrap is not installed: the same layers, made by a
small launcher (`python -I -S -c JAIL`, standard library and ctypes) in the child process.

It enters new mount, PID, network, IPC and UTS namespaces (plus a user namespace mapping uid/gid 65534 onto the
worker's ids when the worker is not root); builds a fresh root on a tmpfs with `/usr` (with `/lib*`), the
interpreter's directories and the `ro_binds` bound read-only, size-limited tmpfs `/scratch` (holding
`main.py`) and `/tmp`, and `/dev/null`, `/dev/zero`, `/dev/urandom` bound from the host; forks the PID
namespace's init, which mounts `/proc`, `pivot_root`s into the new root, detaches the old one and makes `/`
read-only, then forks the program: (as root) `setgroups([])`, `setgid`/`setuid` 65534, `no_new_privs`,
rlimits, the same seccomp filter as bwrap's (loaded with `prctl(PR_SET_SECCOMP)`), and `execve` of
`python -I main.py` with an empty environment. The init reports the program's wait status and exits, and the
kernel kills whatever is left in the namespace. A step the kernel refuses ends the launcher with exit status
71 and one line on stderr naming the step (the probe turns it into the refusal).
"""

from __future__ import annotations

import json
import os
import sys

SETUP_FAILED = 71

JAIL = r"""
import ctypes, json, os, resource, signal, sys
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
NEWNS, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET = 0x20000, 0x4000000, 0x8000000, 0x10000000, 0x20000000, 0x40000000

def fail(step):
    err = ctypes.get_errno()
    os.write(2, ("sandbox setup failed: " + step + ": " + os.strerror(err) + "\n").encode())
    os._exit(71)

def mount(src, dst, fstype, flags, data, step):
    if libc.mount(src and src.encode(), dst.encode(), fstype and fstype.encode(), flags, data and data.encode()):
        fail(step + " " + dst)

def makedirs(path):
    os.makedirs(path, mode=0o755, exist_ok=True)

def ro_bind(src, root):
    dst = root + src
    if os.path.isdir(src):
        makedirs(dst)
    else:
        makedirs(os.path.dirname(dst))
        open(dst, "a").close()
    mount(src, dst, None, BIND | REC, None, "bind")
    st = os.statvfs(src)
    keep = (NOSUID if st.f_flag & os.ST_NOSUID else 0) | (NODEV if st.f_flag & os.ST_NODEV else 0)
    keep |= NOEXEC if st.f_flag & os.ST_NOEXEC else 0
    mount(None, dst, None, REMOUNT | BIND | RDONLY | NOSUID | keep, None, "read-only remount")

uid, gid = os.getuid(), os.getgid()
flags = NEWNS | NEWPID | NEWIPC | NEWUTS | (NEWNET if cfg["isolate_network"] else 0)
if uid != 0:
    flags |= NEWUSER
if libc.unshare(flags):
    fail("unshare")
if uid != 0:
    for name, text in (("setgroups", "deny"), ("uid_map", "65534 %d 1" % uid), ("gid_map", "65534 %d 1" % gid)):
        with open("/proc/self/" + name, "w") as f:
            f.write(text)
mount(None, "/", None, REC | PRIVATE, None, "make private")
root = cfg["root"]
mount("tmpfs", root, "tmpfs", NOSUID | NODEV, "mode=755,size=1m", "tmpfs")
for link, target in cfg["symlinks"]:
    os.symlink(target, root + link)
size = "size=%d,mode=1777" % (cfg["scratch_mb"] * 1024 * 1024)
for path in ("/tmp", "/scratch"):
    makedirs(root + path)
    mount("tmpfs", root + path, "tmpfs", NOSUID | NODEV, size, "tmpfs")
for path in cfg["ro_binds"]:  # after /tmp's tmpfs, which would hide a bind below it
    ro_bind(path, root)
with open(root + "/scratch/main.py", "wb") as f:
    f.write(os.read(cfg["code_fd"], 1 << 30))
os.chmod(root + "/scratch/main.py", 0o644)
makedirs(root + "/dev")
for dev in ("/dev/null", "/dev/zero", "/dev/urandom"):
    open(root + dev, "a").close()
    mount(dev, root + dev, None, BIND, None, "bind")
makedirs(root + "/proc")
os.mkdir(root + "/.old")
bpf = os.read(cfg["seccomp_fd"], 1 << 20)
libc.sethostname(b"sandbox", 7)

def program():
    os.chdir("/scratch")
    if uid == 0:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
    if libc.prctl(38, 1, 0, 0, 0):  # PR_SET_NO_NEW_PRIVS
        fail("no_new_privs")
    for name, soft, hard in cfg["limits"]:
        resource.setrlimit(getattr(resource, name), (soft, hard))
    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    buf = ctypes.create_string_buffer(bpf, len(bpf))
    prog = Prog(len(bpf) // 8, ctypes.cast(buf, ctypes.c_void_p))
    if libc.prctl(22, 2, ctypes.byref(prog), 0, 0):  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        fail("seccomp")
    os.execve(cfg["python"], [cfg["python"], "-I", "main.py"], {})

report_r, report_w = os.pipe()
init = os.fork()
if init == 0:
    os.close(report_r)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: the launcher's death ends the namespace
    mount("proc", root + "/proc", "proc", NOSUID | NODEV | NOEXEC, None, "proc")
    os.chdir(root)
    if libc.syscall(cfg["pivot_root_nr"], b".", b".old"):
        fail("pivot_root")
    os.chdir("/")
    if libc.umount2(b"/.old", 2):  # MNT_DETACH
        fail("detach the old root")
    os.rmdir("/.old")
    mount(None, "/", None, REMOUNT | BIND | RDONLY | NOSUID | NODEV, None, "read-only root")
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
data = os.read(report_r, 64)
if not data:
    os._exit(71)
status = int(data)
if os.WIFSIGNALED(status):
    sig = os.WTERMSIG(status)
    if sig not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
os._exit(os.WEXITSTATUS(status))
"""

_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "arm64": 41}


def jail_argv(
    real_python: str,
    mounts: list[str],
    symlinks: list[tuple[str, str]],
    rlimits: list[tuple[str, int, int]],
    scratch_mb: int,
    root: str,
    seccomp_fd: int,
    code_fd: int,
    isolate_network: bool = True,
) -> list[str]:
    """The launcher's command line: `root` is an empty host directory to mount the new root on."""
    cfg = {
        "python": real_python,
        "ro_binds": mounts,
        "symlinks": symlinks,
        "limits": rlimits,
        "scratch_mb": scratch_mb,
        "root": root,
        "seccomp_fd": seccomp_fd,
        "code_fd": code_fd,
        "isolate_network": isolate_network,
        "pivot_root_nr": _PIVOT_ROOT.get(os.uname().machine, -1),
    }
    return [sys.executable, "-I", "-S", "-c", JAIL, json.dumps(cfg)]
