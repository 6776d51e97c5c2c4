"""``mpistrat stage``: the environment packed once, unpacked on each node, so ranks start from there.

Every rank of a job imports Python, numpy, mpi4py and mpistrat at the same moment; from a shared
file system that is thousands of metadata calls per rank against one server. Staged, one task
per node unpacks one file into node-local memory and the ranks run the interpreter there: the
shared file system sees one read per node.

    mpistrat stage --pack -o env.tar --exclude 'scipy*'   # once (kept while current; .tar.gz: compressed)
    mpistrat stage --check env.tar                         # exit 0: still this environment's; 1: remake
    srun --ntasks-per-node=1 python -m mpistrat stage --unpack env.tar /dev/shm/env-$SLURM_JOB_ID
    srun /dev/shm/env-$SLURM_JOB_ID/venv/bin/python -m mpistrat bench   # jobs/: STAGE=1 does it all

It packs a virtual environment (run it with the venv's python). What names the environment's own
place is handled so that the unpacked copy reads nothing from the original:

- the interpreter: the base installation (``sys.base_prefix``: the executable, the standard
  library, libpython) is packed as ``base/`` unless it is the system's (``/usr``, on every node's
  own disk); the venv's ``bin/python`` links to it relatively, ``--unpack`` points
  ``pyvenv.cfg``'s ``home`` at it, and its binaries look for libpython beside them (``$ORIGIN``);
- editable installs (``pip install -e``): the packages they map are packed into site-packages,
  compiled, without the hook that points at the source tree;
- scripts in ``bin/``: their ``#!`` names the venv's python; packed, they run the python beside
  them (jobs run ``python -m`` anyway);
- ``.pth`` entries naming directories outside the environment are not packed: a warning names
  them, and their modules are read from there. So is ``PYTHONPATH``.

The pack holds ``venv/``, ``base/`` and, in ``venv/``, ``mpistrat-stage.json``: where it came from
and a fingerprint of the environment that ``--check`` compares (installs, removals, and edits of
editable sources change it). ``mpistrat info --startup`` reads that file to tell a staged rank.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import fnmatch
import hashlib
import importlib.util
import io
import json
import os
import py_compile
import shutil
import sys
import sysconfig
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["fingerprint", "main", "pack", "stale", "unpack"]

MANIFEST = "mpistrat-stage.json"
FORMAT = 1
# Parts of the standard library no job imports.
STDLIB_LEFT_OUT = (
    "test",
    "idlelib",
    "tkinter",
    "turtledemo",
    "ensurepip",
    "lib2to3",
    "site-packages",
    "config-*",
)
SYSTEM_PREFIXES = ("/usr", "/usr/local")  # an interpreter in the node's own image: nothing to stage
# A script that runs the python beside it, wherever the directory is: valid sh and valid Python.
TRAMPOLINE = b"#!/bin/sh\n'''exec' \"$(dirname -- \"$0\")/python\" \"$0\" \"$@\"\n' '''\n"


class StageError(Exception):
    """What keeps a pack from being made or unpacked, said to the user."""


def _site_packages() -> Path:
    return Path(sysconfig.get_path("purelib"))


def editable_sources() -> dict[str, str]:
    """The packages editable installs map to a source tree: name -> directory (setuptools' hooks)."""
    found = {}
    for finder in _site_packages().glob("__editable___*_finder.py"):
        tree = ast.parse(finder.read_text())
        for node in tree.body:
            if isinstance(node, ast.AnnAssign | ast.Assign) and "MAPPING" in ast.unparse(node).split("=")[0]:
                found.update(ast.literal_eval(node.value))  # type: ignore[arg-type]
    return found


def _outside_entries(prefix: Path) -> list[str]:
    """Directories ``.pth`` files add to the path that lie outside the environment (not packed)."""
    outside = []
    for pth in _site_packages().glob("*.pth"):
        for line in pth.read_text(errors="replace").splitlines():
            line = line.strip()
            entry = Path(line)
            if line and not line.startswith(("#", "import ")) and entry.is_absolute():
                outside += [] if entry.resolve().is_relative_to(prefix.resolve()) else [line]
    return outside


def _left_out(name: str, relative: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(name, p) or fnmatch.fnmatch(relative, p) for p in patterns)


def _walk(root: Path, patterns: list[str]) -> Iterator[Path]:
    """Every file, link and directory under ``root`` but those ``patterns`` leave out (fnmatch on the
    name or on the path relative to ``root``), in a stable order."""
    for folder, dirs, files in os.walk(root):
        here = Path(folder)
        relative = here.relative_to(root)
        dirs[:] = sorted(d for d in dirs if not _left_out(d, str(relative / d), patterns))
        for name in sorted(dirs) + sorted(files):
            if not _left_out(name, str(relative / name), patterns):
                yield here / name


def fingerprint(patterns: list[str] | None = None) -> str:
    """What ``--check`` compares: the interpreter; what site-packages holds (its names, and each
    installed distribution's ``RECORD``, rewritten by every install) and ``bin/``; every file of the
    editable sources; what the pack leaves out. Files only, by size and modification time: a
    directory changes whenever an import writes a ``__pycache__`` in it."""
    digest = hashlib.sha256(f"{sys.version}\n{sys.prefix}\n{sorted(patterns or [])}\n".encode())
    site = _site_packages()
    digest.update("\0".join(sorted(p.name for p in site.iterdir() if p.name != "__pycache__")).encode())
    files = [*site.glob("*.dist-info/RECORD"), *(Path(sys.prefix) / "bin").iterdir()]
    for source in editable_sources().values():
        files += [p for p in Path(source).rglob("*") if "__pycache__" not in p.parts and p.is_file()]
    for path in sorted(files):
        with contextlib.suppress(OSError):
            st = path.lstat()
            digest.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _base_staged(choice: str) -> bool:
    if choice != "auto":
        return choice == "yes"
    return not any(sys.base_prefix == p or sys.base_prefix.startswith(p + "/") for p in SYSTEM_PREFIXES)


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes, like: Path | None = None) -> None:
    info = tar.gettarinfo(str(like), name) if like is not None else tarfile.TarInfo(name)
    info.size, info.type = len(data), tarfile.REGTYPE
    if like is None:
        info.mode, info.mtime = 0o644, int(time.time())
    tar.addfile(info, io.BytesIO(data))


def _add_compiled(tar: tarfile.TarFile, source: Path, name: str, patterns: list[str]) -> None:
    """A source package, its modules compiled beside them (``__pycache__``), as ``name``."""
    with tempfile.TemporaryDirectory() as work:
        for path in _walk(source, ["__pycache__", *patterns]):
            arcname = f"{name}/{path.relative_to(source)}"
            tar.add(path, arcname, recursive=False)
            if path.suffix == ".py" and path.is_file():
                compiled = Path(work) / "module.pyc"
                py_compile.compile(str(path), cfile=str(compiled), doraise=True)
                tar.add(compiled, importlib.util.cache_from_source(arcname), recursive=False)


def pack(output: str, patterns: list[str], base: str = "auto") -> dict[str, Any]:
    """Write the pack of this virtual environment to ``output`` (atomically); return its manifest."""
    if sys.prefix == sys.base_prefix:
        raise StageError(f"{sys.executable} is not a virtual environment's python: run the venv's own")
    prefix, site = Path(sys.prefix), _site_packages()
    editable = editable_sources()
    stage_base = _base_staged(base)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    base_exe = Path(os.path.realpath(getattr(sys, "_base_executable", sys.executable)))
    manifest = {
        "format": FORMAT,
        "prefix": str(prefix),
        "base_prefix": sys.base_prefix,
        "base_staged": stage_base,
        "python": sys.version.split()[0],
        "executable": base_exe.name,
        "editable": editable,
        "left_out": patterns,
        "not_staged": _outside_entries(prefix),
        "fingerprint": fingerprint(patterns),
        "packed": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    target = Path(output).resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}")
    try:
        compressed = output.endswith((".tar.gz", ".tgz"))
        with tarfile.open(partial, "w:gz") if compressed else tarfile.open(partial, "w") as tar:
            # first: --check and --unpack read it without reading the rest
            _add_bytes(tar, f"venv/{MANIFEST}", json.dumps(manifest, indent=1).encode())
            for path in _walk(prefix, patterns):
                relative = path.relative_to(prefix)
                arcname = f"venv/{relative}"
                if (site in path.parents and path.name.startswith("__editable__")) or path.name == MANIFEST:
                    continue  # an editable install's hook (its source is packed below), or a staged copy's
                if path.parent == prefix / "bin" and path.is_symlink() and stage_base:
                    real = Path(os.path.realpath(path))
                    if real == base_exe:  # python, python3, python3.X: the base interpreter, packed beside
                        info = tarfile.TarInfo(arcname)
                        info.type, info.linkname = tarfile.SYMTYPE, f"../../base/bin/{base_exe.name}"
                        tar.addfile(info)
                        continue
                if path.parent == prefix / "bin" and path.is_file() and not path.is_symlink():
                    head = path.read_bytes()[:256]
                    if head.startswith(b"#!") and str(prefix).encode() in head.split(b"\n", 1)[0]:
                        rest = path.read_bytes().split(b"\n", 1)[1]
                        _add_bytes(tar, arcname, TRAMPOLINE + rest, like=path)
                        continue
                tar.add(path, arcname, recursive=False)
            for name, source in editable.items():
                _add_compiled(tar, Path(source), f"venv/{site.relative_to(prefix)}/{name}", patterns)
            if stage_base:
                _pack_base(tar, base_exe, version)
        os.replace(partial, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
    return manifest


def _pack_base(tar: tarfile.TarFile, executable: Path, version: str) -> None:
    """The base interpreter as ``base/``: its executable, standard library and libpython, each binary's
    search path for libpython made relative (``_relocated``)."""
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    _add_relocated(tar, executable, f"base/bin/{executable.name}", libdir, "$ORIGIN/../lib")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in _walk(stdlib, list(STDLIB_LEFT_OUT)):
        arcname = f"base/lib/{version}/{path.relative_to(stdlib)}"
        if path.suffix == ".so" and path.parent.name == "lib-dynload":
            _add_relocated(tar, path, arcname, libdir, "$ORIGIN/../..")
        else:
            tar.add(path, arcname, recursive=False)
    library = sysconfig.get_config_var("INSTSONAME")
    if sysconfig.get_config_var("Py_ENABLE_SHARED") and library and (Path(libdir) / library).exists():
        _add_relocated(tar, Path(libdir) / library, f"base/lib/{library}", libdir, "$ORIGIN")


def _add_relocated(tar: tarfile.TarFile, path: Path, arcname: str, libdir: str, relative: str) -> None:
    """``path`` as ``arcname``, its library search path (RUNPATH) ``libdir`` replaced by ``relative``
    (``$ORIGIN/...``) where it is that one string: the unpacked binaries then find the unpacked
    libpython, and probe nothing in the original installation. The string is overwritten in place,
    padded with NULs (what conda does to relocate binaries); no other byte changes."""
    data = path.read_bytes()
    old = b"\0" + libdir.encode() + b"\0"
    new = relative.encode()
    if libdir and data.startswith(b"\x7fELF") and data.count(old) == 1 and len(new) <= len(libdir):
        _add_bytes(tar, arcname, data.replace(old, b"\0" + new.ljust(len(libdir) + 1, b"\0")), like=path)
    else:
        tar.add(path, arcname, recursive=False)


def unpack(archive: str, directory: str) -> Path:
    """Unpack ``archive`` into ``directory`` (once: a complete copy there is kept) and point the venv at
    its unpacked base; return the unpacked python."""
    target = Path(directory).resolve()
    python = target / "venv" / "bin" / "python"
    if (target / "venv" / MANIFEST).exists():
        return python
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        with tarfile.open(archive) as tar:
            if hasattr(tarfile, "tar_filter"):  # Python 3.10.12, 3.11.4 on: no path out of the directory
                tar.extractall(partial, filter="tar")
            else:
                tar.extractall(partial)
        manifest = json.loads((partial / "venv" / MANIFEST).read_text())
        if manifest["base_staged"]:
            config = partial / "venv" / "pyvenv.cfg"
            lines = [
                f"home = {target / 'base' / 'bin'}" if line.startswith("home") else line
                for line in config.read_text().splitlines()
            ]
            config.write_text("\n".join(lines) + "\n")
        manifest["unpacked"] = str(target)
        (partial / "venv" / MANIFEST).write_text(json.dumps(manifest, indent=1))
        os.replace(partial, target)
    except (OSError, tarfile.TarError, KeyError, ValueError) as exc:
        raise StageError(f"cannot unpack {archive} into {target}: {exc}") from None
    finally:
        if partial.exists():
            shutil.rmtree(partial, ignore_errors=True)
    return python


def stale(archive: str) -> str | None:
    """Why ``archive`` is not this environment as it is now (None: it is): no pack, another
    environment's, or one packed before an install, a removal or an edit of an editable source."""
    try:
        with tarfile.open(archive) as tar:
            first = tar.next()  # the manifest comes first
            member = tar.extractfile(first) if first and first.name == f"venv/{MANIFEST}" else None
            if member is None:
                return f"{archive} is no pack (it does not begin with venv/{MANIFEST})"
            manifest = json.loads(member.read())
    except (OSError, tarfile.TarError, KeyError, ValueError) as exc:
        return f"{archive} is no pack ({exc})"
    if manifest.get("prefix") != sys.prefix or manifest.get("fingerprint") != fingerprint(
        manifest["left_out"]
    ):
        return f"{archive} is not {sys.prefix} as it is now"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mpistrat stage",
        description="Pack this virtual environment once; unpack it on each node so ranks start from there.",
    )
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--pack", action="store_true", help="pack this environment (run it with the venv's python), unless "
        "the pack -o names is this environment as it is now (--force: again)",
    )  # fmt: skip
    what.add_argument(
        "--check", metavar="PACK", help="exit 0 if PACK is this environment as it is now, else 1"
    )
    what.add_argument(
        "--unpack", nargs=2, metavar=("PACK", "DIR"), help="unpack PACK into DIR; print its python"
    )
    parser.add_argument("-o", "--output", default="mpistrat-env.tar", help="the pack (.tar, or .tar.gz)")
    parser.add_argument("--force", action="store_true", help="with --pack: pack even if the pack is current")
    parser.add_argument(
        "--exclude", action="append", default=[], metavar="PATTERNS",
        help="leave out what matches (space-separated fnmatch patterns on a name, or a path in the venv), "
        "e.g. 'scipy* sklearn'; repeatable",
    )  # fmt: skip
    parser.add_argument(
        "--base", choices=("auto", "yes", "no"), default="auto",
        help="pack the base interpreter too (auto: unless it is the system's, under /usr)",
    )  # fmt: skip
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    patterns = [p for given in args.exclude for p in given.split()]
    try:
        if args.check:
            why = stale(args.check)
            if why:
                print(f"mpistrat stage: {why}: make it again with --pack", file=sys.stderr)
            return 1 if why else 0
        if args.unpack:
            print(unpack(*args.unpack), flush=True)
            return 0
        if not args.force and stale(args.output) is None:
            print(
                f"mpistrat stage: {args.output} is this environment as it is now: kept (--force packs again)"
            )
            return 0
        manifest = pack(args.output, patterns, args.base)
    except StageError as exc:
        print(f"mpistrat stage: {exc}", file=sys.stderr)
        return 2
    size = Path(args.output).stat().st_size
    base = f"with its base {manifest['base_prefix']}" if manifest["base_staged"] else "without its base"
    print(f"mpistrat stage: packed {manifest['prefix']} {base} into {args.output} ({size / 2**20:.0f} MiB)")
    for name, source in manifest["editable"].items():
        print(f"mpistrat stage: editable {name} packed from {source}, compiled")
    for entry in manifest["not_staged"]:
        print(
            f"mpistrat stage: warning: {entry} (a .pth entry outside the environment) is not packed",
            file=sys.stderr,
        )
    return 0
