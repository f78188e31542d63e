"""Review R44 findings on the store lock's fork safety (89da12b):

- R44-1 (older): a fork between the flock and the lock's registration in ``_HELD`` (another
  thread opening a store) left the child holding the flock, so the parent could not reopen
  the path while the child lived (135 of 150 forks).
- R44-2: ``_RELEASING`` was not reentrant: a signal handler that closed a store (or forked)
  while the interrupted thread held it waited for itself forever.
- A child forked while a lock was held keeps a copy of its descriptor until its at-fork
  handler closes it: a reacquire in that moment was refused ("in use by a process forked
  from this one"); it now waits ``FORK_GRACE_S`` for the copy to go.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from tiercache.data.nvme_lock import StoreLock
from tiercache.errors import UserError


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_no_fork_during_an_acquire_leaves_the_child_the_lock(tmp_path):
    folder = tmp_path / "d"
    folder.mkdir()
    stop, refused = threading.Event(), []

    def churn():
        while not stop.is_set():
            try:
                StoreLock.acquire(str(folder)).release()
            except UserError as exc:  # a child forked while the lock was held, not past its handler yet
                refused.append(exc)

    worker = threading.Thread(target=churn)
    worker.start()
    children = []
    try:
        for _ in range(40):
            pid = os.fork()
            if pid == 0:
                time.sleep(0.5)
                os._exit(0)
            children.append(pid)
            time.sleep(0.005)
    finally:
        stop.set()
        worker.join()
    try:
        StoreLock.acquire(str(folder)).release()  # no child kept it
    finally:
        for pid in children:
            os.waitpid(pid, 0)
    assert refused == []  # nor refused a reacquire in the moment before its at-fork handler ran


SIGNAL_SCRIPT = textwrap.dedent("""
    import os, signal, sys, tempfile
    from tiercache.data.nvme_lock import StoreLock
    base = tempfile.mkdtemp()
    main_dir, handler_dir = os.path.join(base, "m"), os.path.join(base, "h")
    os.mkdir(main_dir); os.mkdir(handler_dir)
    runs, busy = [0], [False]
    def handler(signum, frame):
        if busy[0]:  # a handler interrupted by the next signal: Python runs them nested
            return
        busy[0] = True
        StoreLock.acquire(handler_dir).release()
        busy[0] = False
        runs[0] += 1
    signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, 0.002, 0.002)
    for _ in range(3000):
        StoreLock.acquire(main_dir).release()
    signal.setitimer(signal.ITIMER_REAL, 0, 0)
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    print(runs[0])
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX signals")
def test_a_signal_handler_releasing_a_lock_during_a_release_does_not_hang():
    done = subprocess.run([sys.executable, "-c", SIGNAL_SCRIPT], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) > 0  # the handler ran, some of it inside a release
