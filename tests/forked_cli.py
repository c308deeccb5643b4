"""Real ``fsmtrain`` processes without paying, each time, for Python's start and torch's imports (about
3.5 s of CPU a process here: 2 s for ``import torch``, 1.5 s for ``torch._dynamo``, which the first
optimizer imports; the kill-and-resume tests start dozens): a zygote process imports the command line
once and forks one child per command, as Android's zygote and Chromium's do.

Each child is a real process of its own: its pid, working folder, environment, open files, signal
handlers and exit status; it is killed by real signals, and it runs ``python -m fsmtrain``'s own module
(``runpy``) with ``sys.path[0]`` its working folder, then ends through the interpreter's own shutdown
(atexit, the joins of non-daemon threads), as a fresh ``python -m fsmtrain`` does. What it does not
repeat: the interpreter's start and the imports the zygote made, and the hash seed, which every child
shares with the zygote. A launch's workers are forked too, from a zygote of the launch (:func:`_fork_workers`).
Tests of the start itself (the README's commands, ``test_cli.py``) keep launching ``python -m fsmtrain``, and
those that start ``torchrun`` themselves keep its fresh workers.

The zygote stays single-threaded (forking is safe only then) and never runs a tensor operation, so
no thread pool exists to be copied half-alive into a child."""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any, BinaryIO

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def _serve(requests: int = 0, replies: int = 1, *, orphans: bool = False) -> dict[str, Any]:
    """The zygote's loop: a request per line read from ``requests`` forks a child, and returns its request in the
    child; each child's pid and then its exit status go back on ``replies``, a JSON line each. An exited child
    stays a zombie until a ``{"reap": pid}`` request says its exit was seen, as a ``Popen`` child stays until
    ``poll`` or ``wait`` sees it: until then its pid and process group still take a signal (found: torch's agent
    ``killpg``s a worker its ``poll`` saw running, and the zygote had reaped it meanwhile: ESRCH). When
    ``requests`` ends, the children left are killed, or with ``orphans`` left to run as a dead agent's workers do
    (and waited for); then ``{}`` is returned."""
    live: set[int] = set()
    buffered = b""
    while True:
        ready, _, _ = select.select([requests], [], [], 0.02 if live else 1.0)
        if ready:
            chunk = os.read(requests, 1 << 16)
            if not chunk:  # the tests are done (or the launcher is gone): a child still alive is a leftover
                for pid in live if not orphans else ():
                    os.kill(pid, signal.SIGKILL)
                return {}
            buffered += chunk
            while b"\n" in buffered:
                line, buffered = buffered.split(b"\n", 1)
                request = json.loads(line)
                if "reap" in request:
                    with contextlib.suppress(ChildProcessError):  # asked twice: reaped the first time
                        os.waitpid(request["reap"], 0)
                    continue
                pid = os.fork()
                if pid == 0:
                    return dict(request)
                live.add(pid)
                _reply(replies, {"pid": pid})
        for pid in list(live):
            exit_ = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if exit_ is not None:
                live.discard(pid)
                code = exit_.si_status if exit_.si_code == os.CLD_EXITED else -exit_.si_status
                _reply(replies, {"exited": pid, "returncode": code})


def _reply(fd: int, said: dict[str, int]) -> None:
    with contextlib.suppress(BrokenPipeError):  # nobody listens any more (a killed launcher): the child runs on
        os.write(fd, (json.dumps(said) + "\n").encode())


def _imports() -> None:
    import torch  # what every command imports, paid once
    import torch._dynamo  # noqa: F401  # the first optimizer's import (Optimizer.add_param_group), 1.5 s of CPU

    import fsmtrain.callbacks
    import fsmtrain.cli  # noqa: F401


def _become(request: dict[str, Any]) -> None:
    """In the child: the request's folder, environment, files, signals and arguments, then the command."""
    import runpy

    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in _IGNORED_BY_ZYGOTES:  # a launch's zygote ignores them (see _fork_workers); a fresh process does not
        signal.signal(sig, signal.SIG_DFL)
    if request.get("session"):
        os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # read from TMPDIR again, as a fresh process does
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(target, fd)
        os.close(target)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    if _launches(request["args"]):
        _fork_workers(request["stdout"], request["stderr"])
    sys.argv = [str(REPO / "pipeline" / "__main__.py"), *request["args"]]
    sys.path[0] = os.getcwd()
    runpy.run_module("fsmtrain", run_name="__main__", alter_sys=True)


def _launches(args: list[str]) -> bool:
    """Whether ``fsmtrain *args``, run in this folder, may start workers: ``--nproc`` or ``--nnodes`` says so, or
    it resumes a run that ran on several processes (a resume starts as many as the run's newest segment had)."""
    if any(arg.partition("=")[0] in ("--nproc", "--nnodes") for arg in args):
        return True
    if args[:1] != ["resume"]:
        return False
    from fsmtrain.app.launch import recorded_world_size
    runs = [Path(arg) for arg in args[1:] if (Path(arg) / "events.jsonl").is_file()]
    return any(recorded_world_size(run) > 1 for run in runs)


_IGNORED_BY_ZYGOTES = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def _fork_workers(launcher_out: str, launcher_err: str) -> None:
    """In a launcher (``--nproc``), before it runs: the workers its elastic agent starts as ``python -m fsmtrain
    ...`` are forked instead, from a zygote of this launch, forked now while this process is still one thread.

    The agent gets, for each worker, an object with what it uses of ``subprocess.Popen`` (its pid, ``poll``,
    ``wait``), and signals the worker's session as it would a fresh one's (``os.killpg``). The worker runs in a
    session of its own, with the agent's environment and arguments, writing to the launcher's output, as a fresh
    worker does. What differs: its parent is the launch's zygote, not the agent, and its exit status reaches the
    agent through that zygote (within 20 ms). That zygote ignores the signals sent to the launcher's process
    group, and ends when the launcher is gone and its workers have ended: a worker outlives a killed agent, as
    a fresh one does. The hook is torch's own name for the ``Popen`` its ``SubprocessHandler`` calls."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    requests_r, requests_w = os.pipe()
    replies_r, replies_w = os.pipe()
    if os.fork() == 0:  # the launch's zygote
        os.close(requests_w)
        os.close(replies_r)
        for sig in (signal.SIGINT, *_IGNORED_BY_ZYGOTES):
            signal.signal(sig, signal.SIG_IGN)
        worker = _serve(requests_r, replies_w, orphans=True)
        if not worker:
            with contextlib.suppress(ChildProcessError):
                while True:
                    os.waitpid(-1, 0)
            os._exit(0)
        os.close(requests_r)
        os.close(replies_w)
        _become(worker)
        sys.exit(0)  # not back into the launcher's frames below
    os.close(requests_r)
    os.close(replies_w)
    workers = Zygote(open(requests_w, "wb"), open(replies_r, "rb"))  # noqa: SIM115
    fresh = subprocess.Popen
    command = (sys.executable, "-m", "fsmtrain")

    def popen(args: tuple[str, ...], env: dict[str, str], stdout: Any = None, stderr: Any = None,
              **kwargs: Any) -> Any:
        if tuple(args[:3]) != command:
            return fresh(args, env=env, stdout=stdout, stderr=stderr, **kwargs)
        return workers.start(list(args[3:]), Path.cwd(), dict(env), session=True,
                             outputs=(getattr(stdout, "name", None) or launcher_out,
                                      getattr(stderr, "name", None) or launcher_err))

    setattr(subprocess_handler, "Popen", popen)  # noqa: B010  # (not an attribute torch exports: see above)


class Zygote:
    """The test side: starts the zygote, sends it commands, and hears each child's exit."""

    def __init__(self, requests: IO[bytes], replies: IO[bytes], proc: subprocess.Popen[bytes] | None = None) -> None:
        self._requests, self._proc = requests, proc
        self._lock = threading.Condition()
        self._pids: list[int] = []
        self._codes: dict[int, int] = {}
        self._gone = False
        self._folders: list[Path] = []  # each child's output files, removed when the tests are done
        threading.Thread(target=self._listen, args=(replies,), daemon=True, name="zygote-listener").start()

    @classmethod
    def started(cls, env: dict[str, str]) -> Zygote:
        """A zygote process of its own (``env`` its environment)."""
        proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                cwd=tempfile.gettempdir())
        assert proc.stdin is not None and proc.stdout is not None
        return cls(proc.stdin, proc.stdout, proc)

    def _listen(self, replies: IO[bytes]) -> None:
        for line in replies:
            said = json.loads(line)
            with self._lock:
                if "pid" in said:
                    self._pids.append(said["pid"])
                else:
                    self._codes[said["exited"]] = said["returncode"]
                self._lock.notify_all()
        with self._lock:
            self._gone = True
            self._lock.notify_all()

    def start(self, args: list[str], cwd: Path, env: dict[str, str], session: bool = False,
              outputs: tuple[str, str] | None = None) -> ForkedProcess:
        """Fork ``fsmtrain *args`` (a command that launches workers forks them too: :func:`_fork_workers`), its
        output appended to ``outputs`` (else to two new files)."""
        if outputs is None:
            folder = Path(tempfile.mkdtemp(prefix="fsmtrain-child-"))
            self._folders.append(folder)
            out, err = folder / "stdout", folder / "stderr"
            out.touch()
            err.touch()
        else:
            out, err = map(Path, outputs)
        request = {"args": list(args), "cwd": str(cwd), "env": env, "stdout": str(out), "stderr": str(err),
                   "session": session}
        with self._lock:
            before = len(self._pids)
            self._requests.write((json.dumps(request) + "\n").encode())
            self._requests.flush()
            if not self._lock.wait_for(lambda: len(self._pids) > before or self._gone, timeout=60):
                raise RuntimeError("the zygote did not fork a child within 60 s")
            if self._gone:
                raise RuntimeError("the zygote is gone")
            pid = self._pids[before]
        return ForkedProcess(self, pid, out, err, list(args))

    def returncode(self, pid: int, timeout: float | None) -> int | None:
        """``pid``'s exit status once it has ended (within ``timeout``); the zygote may then reap it."""
        with self._lock:
            self._lock.wait_for(lambda: pid in self._codes or self._gone, timeout=timeout)
            code = self._codes.get(pid)
            if code is not None and not self._gone:
                with contextlib.suppress(OSError, ValueError):  # a zygote gone meanwhile has reaped it
                    self._requests.write((json.dumps({"reap": pid}) + "\n").encode())
                    self._requests.flush()
            return code

    def remove_outputs(self) -> None:
        """Remove the children's output folders (the tests are done with them)."""
        for folder in self._folders:
            shutil.rmtree(folder, ignore_errors=True)
        self._folders.clear()

    def close(self, wait: float = 30) -> bool:
        """Remove the outputs, then end the zygote: it kills its children left and exits once they have (within
        ``wait`` seconds, or on its own later: whether it is gone)."""
        self.remove_outputs()
        with contextlib.suppress(OSError):
            self._requests.close()
        if self._proc is None:
            return True
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=wait)
        return self._proc.poll() is not None


class ForkedProcess:
    """One child, as much of ``subprocess.Popen`` as the tests use (its output goes to two files)."""

    def __init__(self, zygote: Zygote, pid: int, stdout: Path, stderr: Path, args: list[str]) -> None:
        self._zygote, self.pid, self.args = zygote, pid, args
        self.stdout_path, self.stderr_path = stdout, stderr
        self.returncode: Any = None  # as Popen's: an int once it ended

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.returncode(self.pid, timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._zygote.returncode(self.pid, timeout=timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def output(self) -> tuple[str, str]:
        return (self.stdout_path.read_text(errors="replace"), self.stderr_path.read_text(errors="replace"))

    def communicate(self, timeout: float | None = None) -> tuple[bytes, bytes]:
        """As ``Popen.communicate`` of a process started with both outputs piped, in bytes."""
        self.wait(timeout)
        return self.stdout_path.read_bytes(), self.stderr_path.read_bytes()

    @property
    def stderr(self) -> BinaryIO:
        return self.stderr_path.open("rb")

    def run(self, timeout: float, stop: int = signal.SIGKILL) -> subprocess.CompletedProcess[str]:
        """Wait for the end and collect its output. Past ``timeout`` the child gets ``stop`` (SIGKILL, as
        ``subprocess.run`` sends; SIGTERM lets an elastic agent end the workers it started), then SIGKILL
        60 s later, and the timeout is raised."""
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.send_signal(stop)
            try:
                self.wait(60)
            except subprocess.TimeoutExpired:
                self.kill()
                self.wait(30)
            raise
        out, err = self.output()
        return subprocess.CompletedProcess(self.args, self.wait(), out, err)


_ZYGOTES: dict[tuple[tuple[str, str], ...], Zygote] = {}


def zygote(env: dict[str, str]) -> Zygote:
    """One zygote per environment it was started with, for the test process's life."""
    key = tuple(sorted((k, v) for k, v in env.items() if k in ("PYTHONPATH", "OMP_NUM_THREADS", "WANDB_MODE")))
    if key not in _ZYGOTES:
        _ZYGOTES[key] = Zygote.started(env)
    return _ZYGOTES[key]


_CLOSING_S = 3.0  # how long the test process waits for its zygotes' ends, all together


def close_all() -> None:
    """Close the zygotes this process started, every one's outputs removed first, all of them told at once and
    waited for together for at most ``_CLOSING_S``. conftest calls it as the session finishes, before an xdist
    worker says it has finished: from then on the worker has 5 s to end, after which execnet sends it a SIGINT
    whose ``KeyboardInterrupt`` lands wherever the worker is. Closed later (``atexit``, ``pytest_unconfigure``),
    they took part of those 5 s: a zygote's end takes about 0.6 s of CPU (an interpreter with torch imported), a
    worker holds one per environment (5 in a full run here), and freeing the worker's own objects takes 2 s more.
    With ``atexit``, or a zygote's wait before the next one's folders went, hundreds of folders were left behind.
    One still ending after the wait ends on its own (its children killed, as it exits); nothing of it is on disk."""
    zygotes = list(_ZYGOTES.values())
    _ZYGOTES.clear()
    for zygote_ in zygotes:
        zygote_.remove_outputs()
    for zygote_ in zygotes:
        zygote_.close(wait=0)
    deadline = time.monotonic() + _CLOSING_S
    for zygote_ in zygotes:
        zygote_.close(wait=max(0.0, deadline - time.monotonic()))


def run(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 300,
        stop: int = signal.SIGKILL) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([python, -m, fsmtrain, *args], capture_output=True, text=True)``, forked (``stop``: as
    :meth:`ForkedProcess.run`)."""
    return zygote(env).start(args, cwd, env).run(timeout, stop)


if __name__ == "__main__":
    _imports()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C to the test session ends the children, not this
    _request = _serve()
    if not _request:
        while True:  # reap what is left, then go
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                break
        sys.exit(0)
    _become(_request)
