"""Fork servers for the ranks of the harness's shared jobs (``tests.harness``).

A rank's interpreter spends seconds of CPU on imports before its body runs: torch with
``torch._dynamo`` (which ``torch.optim`` loads at the first optimizer), TensorFlow with Keras,
numba. On 2 cores, a 4-rank job paid that at every start. A zygote imports them once per
test session and forks each rank from there, so a rank starts in milliseconds:

    python -m tests.zygote SOCKET OWNER_PID     # a server: SOCKET appears when it is ready
    process = fork(SOCKET, ["tests.harness", "--serve", ...], env, cwd)   # Popen-like

There is one zygote per rank slot (rank r of every job forks from zygote r), so the ranks of
a job keep what separate interpreters have: their own hash seed (the order of a set of
strings differs between ranks, as in a real job) and their own random state (reseeded at
the fork). Nothing of Horovod, hvd_compress or the Keras 2 shim is imported before the fork:
each rank initialises those itself, as a new process does. A forked process lives in its own
session; it is killed when the connection that asked for it closes (the launcher that asked
was killed or ended), and every one of them when the zygote's owner, the test process, is
gone.
"""

import array
import atexit
import contextlib
import os
import pickle
import random
import runpy
import select
import signal
import socket
import struct
import sys
import time
import traceback

# What every rank would import before its first step, and the zygote imports once.
PRELOAD = ("numpy", "numba", "torch", "torch._dynamo", "tensorflow", "keras")
# How often a starting zygote is looked for, and how often a zygote looks at its owner
# (it wakes at once for a request, a closed connection or a child's exit).
TICK_SECONDS = 0.05
OWNER_SECONDS = 1.0
MAX_MESSAGE = 1 << 20
_STATUS = struct.Struct("!i")


def socket_path(directory, slot):
    return os.path.join(directory, f"zygote{slot}.sock")


class ForkedProcess:
    """A process forked by a zygote, with the part of ``subprocess.Popen``'s interface the
    launchers use: ``pid``, ``returncode``, ``poll``, ``wait``."""

    def __init__(self, connection, pid):
        self.connection, self.pid, self.returncode = connection, pid, None

    def poll(self):
        if self.returncode is None and select.select([self.connection], [], [], 0)[0]:
            self._read_status()
        return self.returncode

    def wait(self):
        if self.returncode is None:
            self._read_status()
        return self.returncode

    def _read_status(self):
        message = self.connection.recv(_STATUS.size)
        # A zygote that died with its processes (its owner gone) sends nothing.
        self.returncode = _STATUS.unpack(message)[0] if message else -signal.SIGKILL
        self.connection.close()


def fork(path, command, env, cwd):
    """Has the zygote at ``path`` fork ``python -m command[0] command[1:]`` with ``env`` and
    working directory ``cwd``, its stdout and stderr this process's; returns its handle."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    connection.connect(path)
    request = pickle.dumps((list(command), dict(env), cwd))
    socket.send_fds(connection, [request], [sys.stdout.fileno(), sys.stderr.fileno()])
    message = connection.recv(_STATUS.size)
    if not message:
        raise RuntimeError(f"the zygote at {path} refused to fork {command}")
    return ForkedProcess(connection, _STATUS.unpack(message)[0])


def start(directory, slots, env, cwd, log):
    """Starts a zygote for each slot in ``slots`` (their sockets in ``directory``) and waits
    until all of them are ready; returns their processes."""
    import subprocess

    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.zygote", socket_path(directory, slot), str(os.getpid())],
            cwd=cwd,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for slot in slots
    ]
    for slot, process in zip(slots, processes):
        while not os.path.exists(socket_path(directory, slot)):
            if process.poll() is not None:
                raise RuntimeError(
                    f"zygote {slot} exited with {process.returncode} (see {log.name})"
                )
            time.sleep(TICK_SECONDS)
    return processes


def _preload():
    for module in PRELOAD:
        __import__(module)
    # numba loads its CPU target's typing and lowering registries at its first compilation
    # or cache load, seconds of CPU that every rank running the kernels would pay again.
    import numba
    import numpy

    numba.njit(_sum)(numpy.ones(3, numpy.float32))


def _sum(values):
    total = 0.0
    for value in values:
        total += value
    return total


def _serve(path, owner):
    _preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    # Bound under another name and renamed once listening: the path appears when it is ready.
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)
    # A child's exit writes to this pipe, so that select wakes for it: an idle zygote sleeps.
    exited, exit_signal = os.pipe()
    os.set_blocking(exit_signal, False)
    signal.set_wakeup_fd(exit_signal)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children = {}  # pid -> the connection that asked for it
    while True:
        connections = list(children.values())
        readable, _, _ = select.select([listener, exited] + connections, [], [], OWNER_SECONDS)
        if exited in readable:
            os.read(exited, 4096)
        if listener in readable:
            connection, _ = listener.accept()
            pid = _fork_request(connection, [listener] + connections, [exited, exit_signal])
            if pid is None:
                connection.close()
            else:
                children[pid] = connection
                connection.send(_STATUS.pack(pid))
        for pid, connection in list(children.items()):
            # Readable now means closed: whoever asked for this process is gone.
            if connection in readable and not connection.recv(1):
                _kill_group(pid)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            connection = children.pop(pid, None)
            if connection is not None:
                with contextlib.suppress(OSError):
                    connection.send(_STATUS.pack(os.waitstatus_to_exitcode(status)))
                connection.close()
        if not alive(owner):
            for pid in children:
                _kill_group(pid)
            return


def _fork_request(connection, sockets, pipe):
    """Forks the process ``connection`` asks for; returns its pid (None for a bad request).
    ``sockets`` and ``pipe`` (the zygote's own), the child closes."""
    request, fds, _, _ = socket.recv_fds(connection, MAX_MESSAGE, 2)
    if len(fds) != 2:
        for fd in fds:
            os.close(fd)
        return None
    command, env, cwd = pickle.loads(request)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        return pid
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for sock in sockets + [connection]:
            sock.close()
        for fd in pipe:
            os.close(fd)
        _become(command, env, cwd, fds)
        code = _run_module(command)
    except BaseException:
        traceback.print_exc()
    finally:
        # As an interpreter's exit would: Horovod's shutdown is one of these, without which
        # the other ranks' background loops lose the connection mid-cycle and abort.
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _become(command, env, cwd, fds):
    """What a new interpreter running ``command`` would be: its own session, stdio, working
    directory, environment, arguments and random state."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in [null] + list(fds):
        os.close(fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = list(command)
    seed = array.array("Q", os.urandom(8))[0]
    random.seed(seed)
    import numpy

    numpy.random.seed(seed % 2**32)


def _run_module(command):
    """Runs ``command[0]`` as ``python -m`` would; returns the exit code."""
    try:
        runpy.run_module(command[0], run_name="__main__", alter_sys=True)
    except SystemExit as done:
        if done.code is None or isinstance(done.code, int):
            return done.code or 0
        print(done.code, file=sys.stderr)
        return 1
    return 0


def _kill_group(pid):
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]))
