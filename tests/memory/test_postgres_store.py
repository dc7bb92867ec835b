"""The event store on a real PostgreSQL server (Debian's postgresql-15 binaries: initdb and pg_ctl in a temporary
directory, run as the `postgres` user when the tests run as root), every case of memory_store_cases."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import memory_store_cases as store_cases
import pytest

from jobqueue.connection import free_tcp_port
from memory import open_store_at

PG_BIN = Path("/usr/lib/postgresql/15/bin")


def as_postgres(command: list[str]) -> list[str]:
    """Run as the postgres user when we are root (initdb refuses root)."""
    return ["runuser", "-u", "postgres", "--", *command] if os.geteuid() == 0 else command


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str]:
    assert (PG_BIN / "initdb").exists(), f"{PG_BIN} is missing: apt-get install postgresql-15"
    root = Path(tempfile.mkdtemp(prefix="vlmcap-pg-"))  # directly under /tmp: the postgres user can reach it
    data = root / "data"
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    port = free_tcp_port()

    def run(*args: str) -> None:
        done = subprocess.run(as_postgres(list(args)), capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{args[0]}: {done.stdout}{done.stderr}"
    run(str(PG_BIN / "initdb"), "-D", str(data), "-U", "vlmcap", "--auth=trust", "-E", "UTF8")
    run(str(PG_BIN / "pg_ctl"), "-D", str(data), "-l", str(root / "log"), "-w", "-t", "60", "-o",
        f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off", "start")
    try:
        yield f"postgresql://vlmcap@127.0.0.1:{port}/postgres"
    finally:
        run(str(PG_BIN / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def opener(postgres_url):
    import psycopg

    with psycopg.connect(postgres_url, autocommit=True) as conn:  # each test on empty tables
        conn.execute("DROP TABLE IF EXISTS vlmcap_event_frames, vlmcap_events")
    return lambda retention=None: open_store_at(postgres_url, retention)


@pytest.mark.parametrize("case", store_cases.CASES, ids=lambda case: case.__name__)
def test_store_case(case, opener):
    case(opener)


def test_retention(opener, caplog):
    store_cases.case_retention(opener, caplog)


def test_two_servers_share_one_store(opener):
    first, second = opener(), opener()
    assert first.add(store_cases.make_event(1))
    assert not second.add(store_cases.make_event(1))  # the same job from another server: kept once
    assert second.get("job-1").caption == first.get("job-1").caption
    first.close()
    second.close()
