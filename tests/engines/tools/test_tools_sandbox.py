"""The sandboxed Python executor on this machine: limits, kills, caps, empty environment, temp dir, no network."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from rlstages.configs.tools import EnvironmentSpec
from rlstages.engines.tools import ToolCall, build_environment, run_tool_call
from rlstages.engines.tools.sandbox import PythonSandbox, observation
from rlstages.engines.tools.sandbox_run import _LAUNCHER, SandboxLimits, SandboxRun, _rlimits, run_python


def _run(code: str, **limits) -> object:
    """Run in the sandbox; generous time limits unless the test is about them (the machine may be loaded)."""
    return asyncio.run(run_python(code, SandboxLimits(**{"timeout_s": 30.0, "cpu_s": 30, **limits})))


def _alive(pid: int) -> bool:
    """Running or sleeping (a zombie waiting for its reaper is dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _marked(mark: str) -> list[int]:
    """Host pids of live processes whose command line holds `mark` (pids printed inside a PID namespace differ)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and mark.encode() in (proc / "cmdline").read_bytes() and _alive(int(proc.name)):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def _spawner(mark: str, *, spin: bool, setsid: bool = False) -> str:
    """A program that starts a sleeping child marked `mark` (in its own session if `setsid`), then spins or ends."""
    return (
        "import subprocess, sys\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)  # {mark}'], "
        f"start_new_session={setsid}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "print('started', flush=True)\n" + ("while True:\n    pass\n" if spin else "import time\ntime.sleep(0.5)\n")
    )


def _run_watching(code: str, mark: str, **limits) -> tuple[object, list[int]]:
    """Run `code`; while it runs, note the marked child's host pid (proof that the child did start)."""

    async def go():
        task = asyncio.ensure_future(run_python(code, SandboxLimits(**limits)))
        seen: list[int] = []
        while not task.done():
            seen = seen or _marked(mark)
            await asyncio.sleep(0.05)
        return await task, seen

    return asyncio.run(go())


def _gone_soon(mark: str) -> bool:
    deadline = time.monotonic() + 2.0
    while _marked(mark) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _marked(mark)


def test_runs_a_program_and_returns_its_output() -> None:
    run = _run("import sys\nprint(6 * 7, flush=True)\nprint('oops', file=sys.stderr)")
    assert run.returncode == 0 and run.error is None and not run.timed_out
    assert run.output == "42\noops\n"


def test_environment_is_empty_and_temp_dir_is_removed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLSTAGES_TEST_SECRET", "hunter2")
    run = _run("import os, sys, json\nprint(json.dumps([dict(os.environ), os.getcwd(), sys.flags.isolated]))")
    env, cwd, isolated = json.loads(run.output)
    # Nothing of ours is passed; CPython's own C-locale coercion (PEP 538) may add LC_CTYPE, bwrap sets PWD.
    assert set(env) <= {"LC_CTYPE", "PWD"}, env
    assert isolated == 1 and cwd == "/scratch"  # a tmpfs inside the sandbox: nothing on the host to remove
    unisolated = _run("import os\nprint(os.getcwd())", require_isolation=False)
    cwd = unisolated.output.strip()
    assert Path(cwd).parent == Path(tempfile.gettempdir()) and Path(cwd).name.startswith("rlstages-sandbox-")
    assert not Path(cwd).exists()


def test_wall_clock_kill_takes_the_children_too() -> None:
    mark = f"mark-{uuid.uuid4().hex}"
    start = time.perf_counter()
    run, seen = _run_watching(_spawner(mark, spin=True), mark, timeout_s=3.0, cpu_s=30)
    elapsed = time.perf_counter() - start
    assert run.timed_out and run.error == "wall-clock limit reached; the process group was killed"
    assert run.output == "started\n" and seen, "the child never started"
    assert 2.9 < elapsed < 8.0, elapsed
    assert _gone_soon(mark)


@pytest.mark.parametrize("setsid", [False, True], ids=["same-group", "own-session"])
def test_children_do_not_outlive_a_finished_program(setsid: bool) -> None:
    mark = f"mark-{uuid.uuid4().hex}"
    run, seen = _run_watching(_spawner(mark, spin=False, setsid=setsid), mark, timeout_s=30.0)
    assert run.returncode == 0 and not run.timed_out and run.output == "started\n"
    assert seen, "the child was never seen running"
    if setsid and not run.pid_namespace:
        pytest.skip("no PID namespace here: a child in its own session escapes the group kill")
    assert _gone_soon(mark)


def test_cpu_limit_kills_a_busy_loop() -> None:
    start = time.perf_counter()
    run = _run("while True:\n    pass", timeout_s=20.0, cpu_s=1)
    assert not run.timed_out and run.error in ("CPU time limit reached", "killed (CPU or memory limit)")
    assert time.perf_counter() - start < 10.0


def test_memory_limit() -> None:
    run = _run("x = bytearray(1024 * 1024 * 1024)\nprint('allocated')", memory_mb=256)
    assert "allocated" not in run.output
    assert run.error == "memory limit reached (MemoryError)"
    ok = _run("x = bytearray(64 * 1024 * 1024)\nprint('allocated, no MemoryError')", memory_mb=256)
    assert ok.output == "allocated, no MemoryError\n" and ok.error is None


def test_file_size_limit() -> None:
    run = _run("open('big', 'wb').write(b'x' * (3 * 1024 * 1024))", max_file_mb=1)
    assert run.returncode != 0 and "File too large" in run.output


def test_output_cap() -> None:
    run = _run(
        "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 10000)\nprint('END')", max_output_bytes=1000
    )
    assert run.truncated and run.output == "x" * 1000 and run.returncode == 0
    result = asyncio.run(PythonSandbox(max_output_bytes=1000, timeout_s=30.0).call({"code": "print('y' * 5000)"}))
    assert result.truncated and result.text.startswith("y" * 1000) and "[output cut at 1000 bytes]" in result.text


def test_no_network_inside_the_sandbox() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=3)\nprint('connected')\n"
        control = _run(code, isolate_network=False)
        assert control.output == "connected\n"  # the listener is reachable from an unisolated process
        run = _run(code)
    if not run.network.startswith("on"):
        pytest.skip(f"this OS refuses network namespaces: {run.network}")
    assert run.network == "on (network namespace)" or run.network == "on (user + network namespace)"
    assert "connected" not in run.output and run.returncode != 0, run
    assert "Network is unreachable" in run.output or "Connection refused" in run.output, run
    assert run.pid_namespace


def test_sandbox_calls_overlap() -> None:
    async def four():
        code = "import time\nstart = time.time()\ntime.sleep(1.0)\nprint(start, time.time())"
        return await asyncio.gather(*(run_python(code, SandboxLimits(timeout_s=30.0)) for _ in range(4)))

    runs = asyncio.run(four())
    spans = [tuple(map(float, r.output.split())) for r in runs]
    assert len(spans) == 4 and all(end - start >= 1.0 for start, end in spans), spans
    assert max(start for start, _ in spans) < min(end for _, end in spans), spans  # all four asleep at once


def test_runner_timeout_cancels_the_sandbox_and_kills_its_group(tmp_path: Path, monkeypatch) -> None:
    """A tool call past its runner's timeout: the error says so, the sandbox's process group is gone, and the
    temporary directories it made are removed (this process's own temporary directory: another test's sandboxes
    may run beside it)."""
    own_tmp = tmp_path / "tmp"
    own_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(own_tmp))
    mark = f"mark-{uuid.uuid4().hex}"
    spec = EnvironmentSpec(tools=[{"name": "python", "kwargs": {"timeout_s": 60, "cpu_s": 60}, "timeout_s": 3.0}])
    env = build_environment(spec)
    call = ToolCall(name="python", raw_arguments="", arguments={"code": _spawner(mark, spin=True)}, parse_error=None)

    async def run():
        task = asyncio.ensure_future(run_tool_call(env, call, 30.0))
        seen: list[int] = []
        while not task.done():
            seen = seen or _marked(mark)
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # let the child watcher reap
        return await task, seen

    result, seen = asyncio.run(run())
    assert result.error == "tool 'python' timed out after 3 s" and seen
    assert os.listdir(own_tmp) == []
    assert _gone_soon(mark)


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.access("/usr/bin/python3", os.X_OK),
    reason="needs root and a system /usr/bin/python3 that the user nobody can run",
)
def test_runs_as_another_user_when_root() -> None:
    code = "import os\nprint(os.getuid())\nopen('out', 'w').write('x')\nos.listdir('/root')"
    run = _run(code, user="nobody", python="/usr/bin/python3", require_isolation=False)
    assert run.output.startswith("65534\n") and "PermissionError" in run.output  # can write its dir, not /root


def test_bad_interpreter_or_user_is_refused_at_build() -> None:
    with pytest.raises(ValueError, match="python: '/no/such/python' is not an executable file"):
        PythonSandbox(python="/no/such/python")
    with pytest.raises(ValueError, match="user: no such user 'no-such-user-x'"):
        PythonSandbox(user="no-such-user-x")


def test_tool_reports_errors_and_isolation() -> None:
    tool = PythonSandbox(timeout_s=30.0)
    ok = asyncio.run(tool.call({"code": "print(2 ** 10)"}))
    assert ok.error is None and ok.text.startswith("1024\n")
    bad = asyncio.run(tool.call({"code": "raise SystemExit(3)"}))
    assert bad.error == "exit status 3" and bad.text.endswith("Error: exit status 3")
    assert asyncio.run(tool.call({"code": 5})).error == "code must be a string"
    unasked = asyncio.run(PythonSandbox(isolate_network=False, timeout_s=30.0).call({"code": "print(1)"}))
    assert unasked.text == "1\n"  # turned off on purpose: no note
    refused = SandboxRun("1\n", 0, False, False, "off: unshare refused (Operation not permitted)", 0.1)
    noted = observation(refused, SandboxLimits())
    assert noted.text == "1\n\n[sandbox: network isolation off: unshare refused (Operation not permitted)]"
    strict = SandboxRun("", 70, False, False, "off: unshare refused (Operation not permitted)", 0.1)
    assert observation(strict, SandboxLimits(require_network_isolation=True)).error == (
        "network isolation required but unavailable (off: unshare refused (Operation not permitted))"
    )


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv") or not os.access("/usr/bin/python3", os.X_OK),
    reason="needs root (to become nobody with setpriv) and a system /usr/bin/python3",
)
def test_unprivileged_launcher_isolates_through_a_user_namespace() -> None:
    """The path a non-root worker takes: the launcher itself run as nobody enters user + network + PID namespaces."""
    workdir = tempfile.mkdtemp(prefix="rlstages-sandbox-test-")
    status_r, status_w = os.pipe()
    try:
        os.chown(workdir, 65534, 65534)
        with socket.create_server(("127.0.0.1", 0)) as server:
            port = server.getsockname()[1]
            code = (
                f"import os, socket\nprint(os.getuid(), os.getpid())\nsocket.create_connection(('127.0.0.1', {port}))"
            )
            Path(workdir, "main.py").write_text(code)
            cfg = {
                "python": "/usr/bin/python3",
                "uid": None,
                "gid": None,
                "isolate_network": True,
                "require_network_isolation": True,
                "limits": _rlimits(SandboxLimits()),
                "status_fd": status_w,
            }
            as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
            done = subprocess.run(
                [*as_nobody, "/usr/bin/python3", "-I", "-S", "-c", _LAUNCHER, json.dumps(cfg)],
                cwd=workdir,
                env={},
                pass_fds=(status_w,),
                capture_output=True,
                text=True,
                timeout=30,
            )
        os.close(status_w)
        status_w = -1
        status = json.loads(os.read(status_r, 4096))
    finally:
        for fd in (status_r, status_w):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(workdir, ignore_errors=True)
    assert status == {"network": "on (user + network namespace)", "pid_namespace": True}, done.stderr
    uid, pid = done.stdout.split()
    assert pid == "2"  # PID 1 is the namespace's init
    assert uid == "65534" and "Network is unreachable" in done.stderr and done.returncode != 0


def test_sandbox_runs_from_an_event_loop_in_a_worker_thread() -> None:
    """The rollout runs its loop with asyncio.run in a thread pool; subprocesses must be reaped there too."""

    async def three():
        limits = SandboxLimits(timeout_s=30.0)
        return [r.output for r in await asyncio.gather(*(run_python("print(7)", limits) for _ in range(3)))]

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert pool.submit(asyncio.run, three()).result(timeout=60) == ["7\n"] * 3
        assert pool.submit(asyncio.run, three()).result(timeout=60) == ["7\n"] * 3  # a second loop, same thread
