"""The ``mpistrat`` command: ``mpistrat info | bench | plot | timeline`` (also ``python -m mpistrat ...``).

Each subcommand lives in its own module with a ``main(argv)``; this file only dispatches.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "info": ("mpistrat.tools.info", "what MPI, CUDA and transports this job sees (run it under mpiexec too)"),
    "bench": ("mpistrat.tools.bench", "benchmark collectives against raw mpi4py"),
    "plot": ("mpistrat.tools.plot", "plot benchmark results, or a timeline's heat map of imposed wait"),
    "timeline": ("mpistrat.tools.timeline", "merge the ranks' MPISTRAT_TIMELINE files into one Chrome trace"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = [f"  {name:<8} {about}" for name, (_, about) in COMMANDS.items()]
        print("usage: mpistrat {" + ",".join(COMMANDS) + "} [options]\n\n" + "\n".join(lines))
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
