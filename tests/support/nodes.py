"""Virtual nodes on one machine: real multi-node MPI jobs for what depends on hosts.

Hydra, the ``mpiexec`` of MPICH and of Intel MPI, starts one proxy per host through a
launcher command (``-launcher ssh -launcher-exec CMD``); Open MPI's (PRRTE) starts one daemon per
host through its ssh agent (``--prtemca plm_ssh_agent CMD``, the hosts in a host file, ranks
placed ``--map-by ppr:N:node``). ``fake_ssh.sh`` is that command: it runs the proxy or daemon
here, inside a new UTS namespace named after the host. The job then has real
nodes as MPI sees them: ``COMM_TYPE_SHARED`` splits by host, ``MPI_Get_processor_name`` names
it, and messages between nodes take the library's network path (UCX in the MPICH wheel, OFI
in Intel MPI's), not shared memory. A node can be made slow: its proxy and ranks run in a
cgroup with a CPU quota.

It needs root (``unshare --uts`` needs CAP_SYS_ADMIN), ``unshare`` (util-linux) and a Hydra
launcher: :func:`unavailable` says which is missing, and the tests skip with that reason.

>>> import pathlib, tempfile
>>> machinefile({"nodea": 2, "nodeb": 1}, pathlib.Path(tempfile.mkdtemp())).read_text().split()
['nodea:2', 'nodeb:1']
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.launch import MPIEXEC, ROOT, is_open_mpi, job_environment

FAKE_SSH = Path(__file__).with_name("fake_ssh.sh")
TWO_NODES = {"nodea": 2, "nodeb": 2}  # the layout the node tests use: 2 nodes x 2 ranks
MARKER = "VNODE_JOB"  # set in every process of a job, to find any it leaves behind


@functools.cache
def unavailable() -> str | None:
    """Why virtual nodes cannot be made here, or None when they can."""
    if not MPIEXEC.exists():
        return f"no mpiexec next to {sys.executable}"
    if shutil.which("unshare") is None:
        return "no unshare command (util-linux)"
    if os.geteuid() != 0:
        return "not root: unshare --uts needs CAP_SYS_ADMIN"
    probe = subprocess.run(["unshare", "--uts", "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"unshare --uts fails here: {probe.stderr.strip()}"
    return None


needs_nodes = pytest.mark.skipif(unavailable() is not None, reason=f"virtual nodes: {unavailable()}")


def hydra_options(machinefile: Path) -> list[str]:
    """Hydra's options for the hosts of ``machinefile`` (``HOST:N`` lines, see :func:`machinefile`).

    A machine file, not ``-hosts a:2,b:2``: Intel MPI's Hydra reads counts there only.
    """
    return ["-machinefile", str(machinefile), "-launcher", "ssh", "-launcher-exec", str(FAKE_SSH)]


def prrte_options(layout: dict[str, int], directory: Path) -> list[str]:
    """PRRTE's options for the hosts of ``layout`` (as many ranks on each): a host file, the fake
    ssh agent, and ranks placed node by node (``--host a:2,b:2`` alone put them all on the first)."""
    counts = set(layout.values())
    assert len(counts) == 1, f"PRRTE places the same number of ranks on each host here; got {layout}"
    path = directory / "hostfile"
    path.write_text("".join(f"{host} slots={n}\n" for host, n in layout.items()))
    options = ["--oversubscribe", "--hostfile", str(path), "--prtemca", "plm_ssh_agent", str(FAKE_SSH)]
    options += ["--map-by", f"ppr:{counts.pop()}:node"]
    return options + (["--allow-run-as-root"] if os.geteuid() == 0 else [])


def machinefile(layout: dict[str, int], directory: Path) -> Path:
    """A Hydra machine file for ``layout`` (host name -> ranks on it; ranks fill host by host)."""
    path = directory / "machinefile"
    path.write_text("".join(f"{host}:{n}\n" for host, n in layout.items()))
    return path


def run_job(
    command: list[str],
    *,
    limit: float,
    layout: dict[str, int] | None = None,
    env: dict[str, str] | None = None,
    cgroups: dict[str, Path] | None = None,
    python: str = sys.executable,
    options: list[str] | None = None,
) -> tuple[int, str]:
    """Run ``command`` (a script and its arguments, or ``-m module ...``) with ``python`` under
    ``mpiexec`` on the virtual nodes of ``layout`` (default :data:`TWO_NODES`); return (exit
    code, stdout + stderr). ``cgroups`` puts a node's ranks in a cgroup (:func:`cpu_group`);
    ``env`` with ``VNODE_SHM=DIR`` gives each node a ``/dev/shm`` of its own (``fake_ssh.sh``);
    ``options`` go to ``mpiexec`` besides the hosts' (Open MPI's ``--with-ft ulfm``, ...).

    A job still running after ``limit`` seconds is killed with all its processes, and the test
    fails; so does a job that leaves a process behind (named in the failure).
    """
    layout = layout or TWO_NODES
    marker = uuid.uuid4().hex
    child = job_environment({**(env or {}), MARKER: marker})
    if cgroups:
        child["VNODE_CGROUPS"] = " ".join(f"{host}={path}" for host, path in cgroups.items())
    with tempfile.TemporaryDirectory() as directory:
        place = (
            prrte_options(layout, Path(directory))
            if is_open_mpi()
            else hydra_options(machinefile(layout, Path(directory)))
        )
        cmd = [str(MPIEXEC), *place, *(options or []), "-n", str(sum(layout.values())), python, *command]
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=child, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        return _finish(proc, marker, f"{command} on {layout}", limit)


def _finish(proc: subprocess.Popen[str], marker: str, what: str, limit: float) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        _kill(left_behind(marker))
        pytest.fail(f"{what} still running after {limit} s (hung); output:\n{out}")
    stray = left_behind(marker, wait=5.0)
    if stray:
        _kill(stray)
        pytest.fail(f"{what} left processes behind: {stray}; output:\n{out}")
    return proc.returncode, out


def left_behind(marker: str, wait: float = 0.0) -> dict[int, str]:
    """PID -> command line of every process that carries ``marker`` (after up to ``wait`` seconds)."""
    ends = time.monotonic() + wait
    while True:
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                if f"{MARKER}={marker}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                    found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        if not found or time.monotonic() >= ends:
            return found
        time.sleep(0.1)


def _kill(pids: dict[int, str]) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def cpu_group(quota: float | None = None, favoured: bool = False) -> Iterator[Path]:
    """A cgroup for a node's processes (cgroup v2, or v1's cpu controller); removed afterwards.

    ``quota``: together they get that share of one CPU (a slow node). ``favoured``: eight times the
    default CPU weight, so that other load on a shared machine does not slow a node meant to be
    healthy (not more: its ranks spinning in MPI would then starve the other node's). Skips the
    test where no cgroup can be made.
    """
    name = f"mpistrat-vnode-{uuid.uuid4().hex[:8]}"
    period = 100_000
    v2, v1 = Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/cpu")
    settings: dict[str, str] = {}
    if (v2 / "cgroup.controllers").exists() and "cpu" in (v2 / "cgroup.subtree_control").read_text():
        path = v2 / name
        if quota is not None:
            settings["cpu.max"] = f"{max(1000, int(quota * period))} {period}"
        if favoured:
            settings["cpu.weight"] = "800"
    elif (v1 / "cpu.cfs_quota_us").exists():
        path = v1 / name
        if quota is not None:
            settings["cpu.cfs_period_us"] = str(period)
            settings["cpu.cfs_quota_us"] = str(max(1000, int(quota * period)))
        if favoured:
            settings["cpu.shares"] = "8192"
    else:
        pytest.skip("no cgroup CPU controller to set a node's CPU with")
    try:
        path.mkdir()
        for key, value in settings.items():
            (path / key).write_text(value)
    except OSError as exc:
        pytest.skip(f"cannot make a cgroup to set a node's CPU with: {exc}")
    try:
        yield path
    finally:
        for _ in range(50):  # the job's processes leave the cgroup as they exit
            with contextlib.suppress(OSError):
                path.rmdir()
                break
            time.sleep(0.1)
