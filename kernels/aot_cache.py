"""A disk cache of ahead-of-time builds, shared by every process of a test run.

The course compiles the same kernel at the same size in many places: a chapter shows a table, its
tests assert no spills, the compiler page lists every ``compile_jobs()`` entry, and ``make test``
runs every notebook twice (two CPU configurations, two fresh processes). A compile costs seconds
(Triton's passes, ptxas, a fresh interpreter, cuobjdump), so :func:`kernels.inspect.compile_triton_many`
and :func:`kernels.inspect.compile_cuda` look here first and compile only what is missing.

An entry is keyed by everything its result depends on:

- the job itself (kernel name, signature, constexprs, specialisation attributes, launch options) and
  the target architecture;
- the toolchain (Triton's version, and the paths and sizes of ptxas, nvcc and cuobjdump:
  :func:`kernels.inspect.toolchain`);
- :func:`source_digest`: the text of the kernel's module **and of every module of the same package it
  imports, transitively**, so editing a helper that a kernel calls invalidates that kernel's entries
  and nothing else.

Entries live in ``_build/aot-cache/`` (``COURSE_AOT_CACHE`` overrides; ``off`` disables the cache),
one gzip-compressed JSON file each, written atomically so that concurrent processes never read half
an entry. Every compile and every hit is appended to ``_build/aot-log.jsonl`` (``COURSE_AOT_LOG``),
which the test run's end-of-run report sums.
"""
from __future__ import annotations

import ast
import gzip
import hashlib
import importlib.util
import json
import os
import time
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE_ENV, LOG_ENV = "COURSE_AOT_CACHE", "COURSE_AOT_LOG"


def cache_dir() -> Path | None:
    """Where entries live, or None when the cache is off (``COURSE_AOT_CACHE=off``)."""
    value = os.environ.get(CACHE_ENV, "")
    if value.lower() == "off":
        return None
    return Path(value) if value else ROOT / "_build" / "aot-cache"


def log_path() -> Path:
    return Path(os.environ.get(LOG_ENV) or ROOT / "_build" / "aot-log.jsonl")


# ----------------------------------------------------------------------------------------------
# Keys


@lru_cache(maxsize=None)
def _package_dir(top: str) -> Path | None:
    """The folder of a top-level package, or the file of a top-level module's parent folder."""
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.origin:
        return None
    origin = Path(spec.origin)
    return origin.parent if origin.name == "__init__.py" else None


def _module_file(name: str) -> Path | None:
    """The source file of a module, found on disk without importing it (importing a package runs its
    ``__init__``)."""
    top, _, rest = name.partition(".")
    folder = _package_dir(top)
    if folder is None:
        spec = importlib.util.find_spec(top) if not rest else None
        return Path(spec.origin) if spec and spec.origin and spec.origin.endswith(".py") else None
    base = folder.joinpath(*rest.split(".")) if rest else folder
    for candidate in (base.with_suffix(".py") if rest else None, base / "__init__.py"):
        if candidate is not None and candidate.is_file():
            return candidate
    return None


@lru_cache(maxsize=None)
def _imports_of(path: Path, module: str, stamp: tuple[int, int]) -> frozenset[str]:
    return frozenset(_imported_modules(path, module))


def _imported_modules(path: Path, module: str) -> set[str]:
    """Every module name that ``path`` (the source of ``module``) imports, anywhere in the file:
    top-level and function-level imports, absolute and relative, and ``from pkg import submodule``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)  # may name a submodule
    return found


def source_digest(module: str) -> str:
    """sha256 over the source of ``module`` and of every module of its own top-level package or of
    ``kernels`` that it imports, transitively (each module's name and bytes, in sorted order). A
    kernel defined in a test file that calls a ``kernels`` helper depends on that helper too."""
    followed = {module.split(".")[0], "kernels"}
    seen: dict[str, Path] = {}
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        path = _module_file(name)
        if path is None:
            continue
        seen[name] = path
        stat = path.stat()
        todo.extend(m for m in _imports_of(path, name, (stat.st_mtime_ns, stat.st_size)) if m.split(".")[0] in followed and m not in seen)
    h = hashlib.sha256()
    for name in sorted(seen):
        h.update(name.encode() + b"\0" + seen[name].read_bytes() + b"\0")
    return h.hexdigest()


def key(payload: dict) -> str:
    """The entry name for a build described by ``payload``: a JSON-able dict that names everything the
    build depends on (the caller's job, target, toolchain and source digests)."""
    text = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


# ----------------------------------------------------------------------------------------------
# Entries


def load(entry: str) -> dict | None:
    folder = cache_dir()
    if folder is None:
        return None
    path = folder / f"{entry}.json.gz"
    try:
        return json.loads(gzip.decompress(path.read_bytes()))
    except (FileNotFoundError, OSError, ValueError):
        return None


def store(entry: str, value: dict) -> None:
    folder = cache_dir()
    if folder is None:
        return
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{entry}.{os.getpid()}.tmp"
    tmp.write_bytes(gzip.compress(json.dumps(value).encode(), compresslevel=3))
    os.replace(tmp, folder / f"{entry}.json.gz")       # atomic: a reader sees all of it or nothing


def record(kind: str, what: str, arch: str, seconds: float, hit: bool) -> None:
    """Append one compile (or cache hit) to the run's log; a log that cannot be written is skipped."""
    line = json.dumps({"kind": kind, "what": what, "arch": arch, "seconds": round(seconds, 3), "hit": hit,
                       "pid": os.getpid(), "t": round(time.time(), 1)})
    try:
        path = log_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(line + "\n")
    except OSError:
        pass


def summary(path: Path | None = None) -> dict:
    """Totals of a run's log: builds compiled, cache hits, and the seconds the compiles took."""
    path = path or log_path()
    compiled = hits = 0
    seconds = 0.0
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("hit"):
                hits += 1
            else:
                compiled += 1
                seconds += rec.get("seconds", 0.0)
    return {"compiled": compiled, "hits": hits, "seconds": seconds}
