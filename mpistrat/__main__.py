"""The ``mpistrat`` command: ``info``, ``bench``, ``plot``, ``report``, ``timeline``, ``stage``,
``checkpoint``.

Each subcommand lives in its own module with a ``main(argv)``; this file only dispatches (``python -m
mpistrat`` runs it too).
Ctrl-C ends a command with one line and exit status 130, as a shell reports SIGINT; a reader
that stops reading (``mpistrat checkpoint inspect PATH | head``) ends it quietly with status 141,
as a shell reports SIGPIPE.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys

COMMANDS = {
    "info": ("mpistrat.tools.info", "what MPI, CUDA and transports this job sees (run it under mpiexec too)"),
    "bench": ("mpistrat.tools.bench", "benchmark collectives against raw mpi4py"),
    "plot": ("mpistrat.tools.plot", "plot benchmark results, or a timeline's heat map of imposed wait"),
    "report": (
        "mpistrat.tools.report",
        "tables, scaling efficiency and a regression gate from bench results",
    ),
    "timeline": (
        "mpistrat.tools.merge_timelines",
        "merge the ranks' MPISTRAT_TIMELINE files into one Chrome trace",
    ),
    "stage": (
        "mpistrat.tools.stage",
        "pack this environment once; unpack it on each node so ranks start from node-local memory",
    ),
    "checkpoint": (
        "mpistrat.tools.checkpoint_inspect",
        "inspect PATH: a checkpoint's entries, metadata and checksums",
    ),
}
INTERRUPTED = 130  # 128 + SIGINT
BROKEN_PIPE = 141  # 128 + SIGPIPE


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}} {about}" for name, (_, about) in COMMANDS.items()]
    return (
        "usage: mpistrat {" + ",".join(COMMANDS) + "} [options]   (mpistrat COMMAND --help for its options)\n"
        "       mpistrat --version\n\n" + "\n".join(lines)
    )


def _version() -> str:
    from mpistrat import __version__
    from mpistrat.tools.bench_meta import git_commit

    commit = git_commit()
    return f"mpistrat {__version__}" + (f" (git {commit[:12]})" if commit else "")


def _rank() -> int:
    """COMM_WORLD rank if MPI is up (so only rank 0 reports an interrupt), else 0."""
    mpi = sys.modules.get("mpi4py.MPI")
    try:
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            return int(mpi.COMM_WORLD.Get_rank())
    except Exception:
        pass
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(_version())
        return 0
    if argv[0] not in COMMANDS:
        close = difflib.get_close_matches(argv[0], list(COMMANDS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        print(f"mpistrat: unknown command {argv[0]!r}{hint}\n\n{_usage()}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(COMMANDS[argv[0]][0])
        return int(module.main(argv[1:]) or 0)
    except KeyboardInterrupt:
        if _rank() == 0:
            print(f"\nmpistrat {argv[0]}: interrupted", file=sys.stderr, flush=True)
        return INTERRUPTED
    except BrokenPipeError:
        # What is left in the buffer goes nowhere, or flushing it at exit would raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
