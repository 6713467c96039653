"""A warm process that forks CPU ranks for `refimpl.launch.run` (python -m refimpl.lab.runtime.zygote).

Importing torch costs ~2 s of CPU in every fresh interpreter; a 4-rank launch on a 2-core machine
paid ~4 s before any rank computed, and a test suite or a notebook launches hundreds of times. This
process imports torch once (with OMP_NUM_THREADS=1 already in its environment, so the ranks it
forks get one thread each, as `launch` promises) and then forks one child per rank on request. A
child becomes exactly what `python -m refimpl._rank` would have been: its own session (so the
launcher can kill its whole process group), stdout/stderr in the launcher's files, the launcher's
environment and working directory, and then `refimpl._rank.main()`. refimpl's layers up to the
training loop are imported here too (~0.1 s a rank otherwise, since every layer imports its own
dependencies up front); the launcher restarts the zygote when a refimpl source file changes, so an
edit still takes effect at the next launch.

Protocol, one line each way (JSON requests on stdin; replies on stdout):
    {"env": {...}, "cwd": "...", "stdout": "path", "stderr": "path"}  ->  "pid <pid>"
    and, whenever a child exits:                                      ->  "exit <pid> <code>"
    {"kill": <pid>}: SIGKILL to that child's process group, if the zygote has not reaped it yet
(the launcher must not kill by pid itself: once the zygote has reaped a child, the kernel may give
its pid to another process -- pid_max is 32768 here, and a test suite forks tens of thousands --
and the launcher, which hears of the exit a moment later, would kill a stranger's session.)
(<code> as subprocess reports it: the exit status, or minus the signal that killed it.)
The launcher's half (refimpl/lab/runtime/zygote_client.py) starts it, asks it for ranks and reads their exits.
The zygote never runs a torch operation and never touches CUDA, so forking it is safe; it exits
when the launcher closes its stdin or dies (its end of the pipe closes; the ranks then die
with the zygote, by PR_SET_PDEATHSIG).
"""
import gc
import json
import os
import select
import signal
import sys


def _child(request: dict) -> None:
    os.setsid()                          # its own process group: the launcher kills it whole
    from refimpl._rank import _die_with_parent, main

    _die_with_parent()                   # the zygote dies with the launcher, the rank with it
    devnull = os.open(os.devnull, os.O_RDONLY)
    out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for fd, target in ((devnull, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    main()                               # ends in os._exit


def _exit_code(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def warm_imports() -> None:
    """The expensive imports, paid once for every rank forked: torch (~2 s of CPU), and the parts
    a rank pulls in lazily, of which torch._dynamo (imported by the first optimizer) is another
    ~2.5 s. Nothing here runs an operation, starts a thread pool or touches a GPU: a process that
    has initialised CUDA cannot fork a child that uses CUDA, nor one that has only asked how many
    GPUs there are (`torch.cuda.is_available()` calls cudaGetDeviceCount, which initialises the
    driver), and gloo ranks on a GPU machine are forked from here. tests/test_cuda_setup.py runs
    this function with CUDA's entry points watched."""
    import cloudpickle  # noqa: F401
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    import torch.optim  # noqa: F401
    import torch.profiler  # noqa: F401

    import refimpl.train  # noqa: F401  (the launcher restarts us when refimpl's sources change)


def serve() -> None:
    # No PR_SET_PDEATHSIG here: Linux sends it when the *thread* that started us exits, and the
    # launcher may start us from a short-lived thread (a progress bar's worker). We leave when the
    # launcher's end of our stdin closes instead, which happens however the launcher dies.
    warm_imports()
    import torch

    if torch.cuda.is_initialized():
        # Never fork from here then: the launcher hears no "ready" and starts fresh interpreters.
        sys.exit("the rank zygote initialised CUDA while importing; it must not fork")
    # Everything imported so far lives as long as the ranks do: out of the collector's sight, a
    # rank's gc.collect() (before it leaves its process group) scans only what the rank made,
    # ~0.17 s less per rank (and no copy-on-write of the frozen pages when the collector runs).
    gc.freeze()

    reply = sys.stdout
    reply.write("ready\n")
    reply.flush()
    children: set[int] = set()
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.02)
        if readable:
            chunk = os.read(0, 65536)
            if not chunk:                    # the launcher closed the pipe: done
                break
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                if "kill" in request:        # only a child not yet reaped: its pid is still ours
                    if request["kill"] in children:
                        try:
                            os.killpg(request["kill"], signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    continue
                pid = os.fork()
                if pid == 0:
                    try:
                        _child(request)
                    finally:
                        os._exit(1)
                children.add(pid)
                reply.write(f"pid {pid}\n")
                reply.flush()
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                reply.write(f"exit {pid} {_exit_code(status)}\n")
                reply.flush()
    os._exit(0)


if __name__ == "__main__":
    serve()
