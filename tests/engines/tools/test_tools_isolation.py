"""The `python` tool as an isolation boundary, attacked with its default settings: each attack fails and the
host is unchanged. Runs as root, and (last test) the same file and test_tools_isolation_layers.py again as an
ordinary user (uid 65534)."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import isolation_support
import pytest
from isolation_support import ROOT, run_code

from rlstages.engines.tools.sandbox import PythonSandbox
from rlstages.engines.tools.sandbox_run import SandboxLimits, run_python

backend = isolation_support.backend  # the fixture: each case against bubblewrap and the launcher

LAYERS = Path(__file__).resolve().with_name("test_tools_isolation_layers.py")  # run as that user too


@pytest.fixture
def planted(tmp_path: Path) -> list[Path]:
    """Secret files outside the scratch dir: a run dir, /tmp, /root (as root), each removed afterwards."""
    secret = f"secret-{uuid.uuid4().hex}"
    paths = [tmp_path / "run" / "data" / "answers.txt", Path(tempfile.gettempdir()) / f"rlstages-plant-{secret}"]
    if ROOT:
        paths.append(Path("/root") / f".rlstages-plant-{secret}")
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(secret)
    yield paths
    for path in paths:
        path.unlink(missing_ok=True)


def test_ordinary_program_works_and_its_start_is_measured(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code = "import math, json\nopen('notes.txt', 'w').write(str(math.factorial(10)))\nprint(open('notes.txt').read())"
    starts = []
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # our mount points alone (other tests make theirs in /tmp)
    for _ in range(3):
        start = time.perf_counter()
        run = run_code(code)
        starts.append(time.perf_counter() - start)
        assert run.output == "3628800\n" and run.error is None and run.isolated, run
    print(f"{backend}: a call, start to exit: {min(starts):.3f} s (best of 3)")  # a report, not a timed assert
    assert not list(tmp_path.glob("rlstages-jail-*"))  # the launcher's mount point is gone


def test_never_root_no_new_privs_seccomp_on(backend: str) -> None:
    run = run_code(
        "import os\nst = dict(l.split(':\\t') for l in open('/proc/self/status').read().splitlines() if ':\\t' in l)\n"
        "print(os.getuid(), os.getgid(), os.geteuid(), st['NoNewPrivs'], st['Seccomp'], st['CapEff'], st['CapPrm'])"
    )
    assert run.output.split() == ["65534", "65534", "65534", "1", "2", "0000000000000000", "0000000000000000"], run


def test_reading_planted_files_fails(planted: list[Path], backend: str) -> None:
    code = "import sys\nfor p in sys.argv[1:] or %r:\n" % [str(p) for p in planted]
    code += (
        "    try:\n        print('LEAK', open(p).read())\n    except OSError as e:\n        print(type(e).__name__)\n"
    )
    run = run_code(code)
    assert "LEAK" not in run.output and "secret-" not in run.output, run
    assert run.output.split() == ["FileNotFoundError"] * len(planted), run
    assert all(p.read_text().startswith("secret-") for p in planted)


def test_writing_or_deleting_outside_scratch_fails(planted: list[Path], backend: str) -> None:
    run_dir = planted[0].parent
    code = f"import os\nfor p in {[str(p) for p in planted]!r}:\n"
    code += "    try:\n        os.remove(p)\n        print('DELETED', p)\n"
    code += "    except OSError as e:\n        print(type(e).__name__)\n"
    for target in (run_dir / "new.txt", Path("/usr/rlstages-new"), Path("/") / "rlstages-new"):
        code += f"try:\n    open({str(target)!r}, 'w').write('x')\n    print('WROTE')\n"
        code += "except OSError as e:\n    print(type(e).__name__)\n"
    run = run_code(code)
    assert "DELETED" not in run.output and "WROTE" not in run.output, run
    assert all(p.read_text().startswith("secret-") for p in planted)
    assert not (run_dir / "new.txt").exists() and not Path("/usr/rlstages-new").exists()
    assert not Path("/rlstages-new").exists()


def test_root_home_tmp_and_ray_are_not_there(backend: str) -> None:
    run = run_code(
        "import os, glob\nprint(sorted(os.listdir('/')))\n"
        "print(os.listdir('/tmp'), os.path.exists('/root/.pyenv/shims'))\n"
        "print(glob.glob('/tmp/ray*') + glob.glob('/home/*') + glob.glob('/etc/*') + glob.glob('/work*'))\n"
        "print(sorted(os.listdir('/dev')))"
    )
    lines = run.output.splitlines()
    assert set(eval(lines[0])) <= {
        "bin",
        "dev",
        "lib",
        "lib32",
        "lib64",
        "libx32",
        "proc",
        "root",
        "scratch",
        "tmp",
        "usr",
    }
    assert lines[1] == "[] False" and lines[2] == "[]", run  # private /tmp: no Ray session dir nor its token
    assert lines[3] == "['null', 'urandom', 'zero']"


def test_ray_token_is_out_of_reach(backend: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Ray's token auth: the token in the worker's environment and in a 0600 state file (as sim_cluster.sh
    keeps it); the program looks in its environment, every /proc/*/environ it can see and the file."""
    token = uuid.uuid4().hex
    monkeypatch.setenv("RAY_AUTH_TOKEN", token)
    state = tmp_path / "ray-state"
    state.mkdir()
    (state / "auth_token").write_text(token)
    (state / "auth_token").chmod(0o600)
    code = (
        "import os, glob\nprint(os.environ.get('RAY_AUTH_TOKEN'))\n"
        f"for path in glob.glob('/proc/*/environ') + [{str(state / 'auth_token')!r}]:\n"
        "    try:\n        print(open(path, 'rb').read())\n    except OSError as e:\n        print(type(e).__name__)"
    )
    run = run_code(code)
    assert token not in run.output and run.output.startswith("None\n"), run
    assert "FileNotFoundError" in run.output.splitlines()[-1], run


def test_proc_shows_only_the_call(backend: str) -> None:
    host_init = Path("/proc/1/cmdline").read_bytes() if os.access("/proc/1/cmdline", os.R_OK) else b""
    run = run_code(
        "import os\npids = [p for p in os.listdir('/proc') if p.isdigit()]\nprint(len(pids))\n"
        "print(open('/proc/1/cmdline', 'rb').read()[:200])\n"
        "try:\n    print(os.listdir('/proc/1/root'))\nexcept OSError as e:\n    print(type(e).__name__)"
    )
    count, init, root = run.output.splitlines()
    assert int(count) <= 3, run  # bwrap's init, (setpriv/prlimit exec'd into) the program
    assert host_init == b"" or repr(host_init[:200]) != init
    assert root == "PermissionError" or "scratch" in root, run  # never the host's root


def test_symlinks_and_proc_root_do_not_lead_out(planted: list[Path], backend: str) -> None:
    target = str(planted[0])
    code = (
        f"import os\nfor link, dest in [('a', {target!r}), ('b', '/proc/1/root' + {target!r}), "
        f"('c', '/proc/self/root/..' + {target!r})]:\n"
        "    os.symlink(dest, link)\n    try:\n        print('LEAK', open(link).read())\n"
        "    except OSError as e:\n        print(type(e).__name__)\n"
        "os.symlink('/', 'up')\nprint(sorted(os.listdir('up')) == sorted(os.listdir('/')))"
    )
    run = run_code(code)
    assert "LEAK" not in run.output and "secret-" not in run.output, run
    assert run.output.splitlines()[-1] == "True", run
    assert planted[0].read_text().startswith("secret-")


@pytest.mark.parametrize(
    "call",
    [
        "libc.ptrace(16, 1, 0, 0)",  # PTRACE_ATTACH to the namespace's init
        "libc.mount(b'none', b'/scratch', b'tmpfs', 0, None)",
        "libc.unshare(0x10000000)",  # CLONE_NEWUSER
        "libc.unshare(0x00020000)",  # CLONE_NEWNS
        "libc.setns(0, 0)",
        "libc.syscall(321, 0, 0, 0)",  # bpf
        "libc.syscall(298, 0, 0, 0, 0, 0)",  # perf_event_open
        "libc.syscall(250, 0, 0, 0, 0, 0)",  # keyctl
        "libc.syscall(246, 0, 0, 0, 0)",  # kexec_load
        "libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0)",  # clone(CLONE_NEWUSER | SIGCHLD)
    ],
)
def test_forbidden_system_calls_are_refused(call: str, backend: str) -> None:
    if "syscall(" in call and os.uname().machine != "x86_64":
        pytest.skip("x86-64 system call numbers")
    run = run_code(f"import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nprint({call}, ctypes.get_errno())")
    assert run.output == "-1 1\n", run  # -1, EPERM


def test_unshare_command_and_nested_sandbox_fail(backend: str) -> None:
    run = run_code(
        "import subprocess\nfor argv in (['unshare', '-r', 'id'], ['bwrap', '--bind', '/', '/', 'id']):\n"
        "    try:\n        p = subprocess.run(argv, capture_output=True, text=True)\n"
        "        print(p.returncode, p.stdout)\n"
        "    except OSError as e:\n        print(type(e).__name__)"
    )
    assert "uid=0" not in run.output and all(line.split()[0] != "0" for line in run.output.splitlines()), run


def test_fork_bomb_is_bounded(backend: str) -> None:
    mark = f"mark-{uuid.uuid4().hex}"
    code = (
        "import os, time, sys\nn = 0\ntry:\n    while n < 500:\n        if os.fork() == 0:\n"
        f"            os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)  # {mark}'])\n"
        "        n += 1\nexcept OSError as e:\n    print(n, type(e).__name__)"
    )
    run = run_code(code, max_processes=16)
    n, err = run.output.split()
    assert int(n) < 16 and err == "BlockingIOError", run  # EAGAIN from RLIMIT_NPROC
    assert not _marked(mark)  # every child died with the call


def test_memory_bomb_is_bounded(backend: str) -> None:
    run = run_code("x = bytearray(8 * 1024 ** 3)\nprint('allocated')", memory_mb=512)
    assert "allocated" not in run.output and run.error == "memory limit reached (MemoryError)", run


def test_ten_gigabyte_write_is_bounded(backend: str) -> None:
    code = (
        "import os\nchunk = b'x' * (1 << 20)\nfor name in ['big%d' % i for i in range(640)]:\n    try:\n"
        "        with open(name, 'wb') as f:\n            for _ in range(16):\n                f.write(chunk)\n"
        "    except OSError as e:\n        print(name, e.strerror)\n        break\n"
        "print(sum(os.path.getsize(n) for n in os.listdir('.')) // (1 << 20))"
    )
    run = run_code(code, max_file_mb=16, scratch_mb=48)
    assert "No space left on device" in run.output or "File too large" in run.output, run
    assert int(run.output.split()[-1]) <= 48, run  # the tmpfs size, never the host's disk
    big = run_code("open('big', 'wb').write(b'x' * (20 << 20))", max_file_mb=4)
    assert "File too large" in big.output, big


def _marked(mark: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and mark.encode() in (proc / "cmdline").read_bytes():
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def test_setsid_and_double_fork_do_not_outlive_the_call(backend: str) -> None:
    mark = f"mark-{uuid.uuid4().hex}"
    code = (
        "import os, sys\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)  # {mark}'])\n"
        "    os._exit(0)\nimport time\ntime.sleep(0.5)\nprint('parent done')"
    )
    seen: list[int] = []

    async def go():
        task = asyncio.ensure_future(run_python(code, SandboxLimits(timeout_s=30.0, isolation_backend=backend)))
        while not task.done():
            seen.extend(seen or _marked(mark))
            await asyncio.sleep(0.05)
        return await task

    run = asyncio.run(go())
    assert run.output == "parent done\n" and seen, run
    deadline = time.monotonic() + 3.0
    while _marked(mark) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _marked(mark)


def test_host_loopback_is_unreachable(backend: str) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        run = run_code(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=3)\nprint('connected')")
    assert "connected" not in run.output and ("Connection refused" in run.output or "unreachable" in run.output), run


def test_ro_binds_are_readable_not_writable(tmp_path: Path, backend: str) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "input.txt").write_text("hello")
    data.chmod(0o755)
    tmp_path.chmod(0o755)
    code = (
        f"print(open({str(data / 'input.txt')!r}).read())\n"
        f"try:\n    open({str(data / 'input.txt')!r}, 'w')\nexcept OSError as e:\n    print(type(e).__name__)"
    )
    run = run_code(code, ro_binds=(str(data),))
    assert run.output.split() == ["hello", "OSError"] or run.output.split() == ["hello", "PermissionError"], run
    assert (data / "input.txt").read_text() == "hello"
    with pytest.raises(ValueError, match="ro_binds: '/no/such/dir' is not an existing absolute path"):
        PythonSandbox(ro_binds=["/no/such/dir"])


def _exposing(paths: list[str], scratch: str) -> str:
    """Shell lines (run in a private mount namespace) that let an ordinary user through 0700 parents of
    `paths` (the venv under /root): each top directory D that others cannot enter is covered by a 0755 tmpfs
    holding binds of just the needed children (held on the way in dirs under `scratch`)."""
    lines, holds = [], {}
    for path in paths:
        parts = Path(path).resolve().parts
        for i in range(2, len(parts)):
            top = Path(*parts[:i])
            if not os.stat(top).st_mode & 0o001:
                holds.setdefault(str(top), set()).add(parts[i])
                break
    for top, children in holds.items():
        hold = tempfile.mkdtemp(prefix="rlstages-hold-", dir=scratch)
        for child in children:
            lines.append(f"mkdir -p {hold}/{child} && mount --bind {top}/{child} {hold}/{child}")
        lines.append(f"mount -t tmpfs -o mode=755 tmpfs {top}")
        for child in children:
            lines.append(f"mkdir -p {top}/{child} && mount --move {hold}/{child} {top}/{child}")
    return "\n".join(lines)


@pytest.mark.skipif(not ROOT or not shutil.which("unshare"), reason="runs itself again as uid 65534 from root")
def test_as_ordinary_user() -> None:
    """This file and test_tools_isolation_layers.py again, as uid 65534 (a user namespace per call instead of
    setpriv): all of it passes."""
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "unshare", "--user", "true"]
    if subprocess.run(as_nobody, capture_output=True).returncode != 0:  # there, every call is refused in one line
        pytest.skip("this kernel gives an ordinary user no user namespaces")
    repo = Path(__file__).resolve().parents[3]
    pyroot = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    needed = [sys.base_prefix, sys.prefix, str(repo), *pyroot, *(str(Path(p).resolve()) for p in pyroot)]
    home = tempfile.mkdtemp(prefix="rlstages-user-")
    os.chown(home, 65534, 65534)
    env = f"HOME={home} PYTHONDONTWRITEBYTECODE=1 PATH=/usr/bin:/bin PYTHONPATH={os.pathsep.join(pyroot)}"
    script = (
        f"set -e\n{_exposing(needed, home)}\ncd {repo}\nexec setpriv --reuid=65534 --regid=65534 --clear-groups "
        f"env {env} {sys.executable} -m pytest -q -p no:cacheprovider --noconftest -x "
        f"{Path(__file__).resolve()} {LAYERS} "
        "-k 'not as_ordinary_user'"
    )
    try:
        done = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
            capture_output=True,
            text=True,
            timeout=240,
        )
    finally:
        shutil.rmtree(home, ignore_errors=True)
    assert done.returncode == 0 and "failed" not in done.stdout and "skipped" not in done.stdout, (
        done.stdout + done.stderr
    )
    passed = re.search(r"(\d+) passed", done.stdout)
    assert passed and int(passed.group(1)) >= 45, done.stdout  # every case (both backends) ran as that user
