"""Watching another rank's process on the same machine (``diagnostics/deaths.py``), without MPI:
which rank each rank watches, and a watch seeing a real process end."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from mpistrat.comm.devices import process_identity
from mpistrat.diagnostics import deaths

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="no pidfd_open (Linux 5.3+)")


def test_each_rank_watches_the_next_on_its_machine_and_nobody_watches_a_rank_alone():
    me = os.getpid()  # a live process to open: the ranks' own pids do not matter here
    processes = [("a", me), ("b", me), ("a", me), ("a", me), ("c", me)]
    watched = {r: getattr(deaths.watch(processes, r), "rank", None) for r in range(5)}
    assert watched == {0: 2, 2: 3, 3: 0, 1: None, 4: None}
    assert deaths.watch([("", me), ("", me)], 0) is None  # machines unknown: nothing watched


def test_a_watch_sees_the_process_end():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        watch = deaths.watch([process_identity(), (process_identity()[0], child.pid)], 0)
        assert watch is not None and watch.rank == 1 and not watch.ended()
        child.kill()
        child.wait()
        ends = time.monotonic() + 10
        while not watch.ended() and time.monotonic() < ends:
            time.sleep(0.01)
        assert watch.ended()
    finally:
        child.kill()
        child.wait()


def test_the_identity_tells_machines_by_boot_and_pid_namespace():
    machine, pid = process_identity()
    assert pid == os.getpid() and os.readlink("/proc/self/ns/pid") in machine
