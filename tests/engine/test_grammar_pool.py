"""The grammar pool's turns: no client compiles on more than its share of the workers, so one client's slow
schemas leave another's small one a worker; a compile that finds no worker free within its wait is GrammarBusy
(a GrammarTimeout: the API's 503), and none of it is lost: every waiting compile ends, cancelled or compiled."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest

from engine.grammar_limits import GrammarLimits
from engine.grammar_pool import GrammarBusy, GrammarCancelled, GrammarPool, GrammarTimeout, keyed

xgrammar = pytest.importorskip("xgrammar")
pytestmark = pytest.mark.timeout(120)
SMALL = '{"type": "object", "properties": {"a": {"type": "integer"}}}'


def _held_or_compiled(xgr: Any, compiler: Any, kind: str, text: str) -> Any:
    """In the child: a "held" compile sleeps `text` seconds (a slow schema, killed when cancelled), others
    compile their JSON schema."""
    if kind == "held":
        time.sleep(float(text))
        text = SMALL
    return compiler.compile_json_schema(text)


@pytest.fixture
def pool(checkpoint):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=512, stop_token_ids=[tokenizer.eos_token_id])
    made = GrammarPool(info, GrammarLimits(workers=2, compile_timeout_s=60), _held_or_compiled)
    yield made
    made.close()


def _wait_until(condition, what: str) -> None:
    for _ in range(1200):
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(what)


def _slow_client(pool: GrammarPool, count: int, key: str) -> tuple[list[threading.Thread], threading.Event, list]:
    cancelled, ends = threading.Event(), []

    def one() -> None:
        try:
            pool.compile("held", "60", cancelled, key=key)
            ends.append("compiled")
        except Exception as exc:
            ends.append(exc)

    threads = [threading.Thread(target=one) for _ in range(count)]
    for thread in threads:
        thread.start()
    return threads, cancelled, ends


def test_one_clients_slow_schemas_leave_another_client_a_worker(pool):
    assert pool.per_key == 1
    threads, cancelled, ends = _slow_client(pool, 8, "slow-client")
    _wait_until(lambda: pool.running() == {"slow-client": 1} and pool.waiting() == {"slow-client": 7},
                "the slow client to hold its share and queue the rest")
    compiled = keyed("small-client", pool.compile, "json_schema", SMALL)  # the key through GRAMMAR_KEY
    assert compiled is not None
    assert all(thread.is_alive() for thread in threads) and ends == []  # compiled while all 8 still wait or run
    cancelled.set()
    for thread in threads:
        thread.join(30)
    assert len(ends) == 8 and all(isinstance(end, GrammarCancelled) for end in ends)
    assert pool.running() == {} and pool.waiting() == {}
    assert pool.compile("json_schema", SMALL, key="slow-client") is not None  # its workers came back


def test_a_compile_that_finds_no_worker_within_its_wait_is_busy(pool):
    threads, cancelled, ends = _slow_client(pool, 2, "a")
    others, others_cancelled, others_ends = _slow_client(pool, 1, "b")
    _wait_until(lambda: pool.running() == {"a": 1, "b": 1}, "both workers to be taken")
    with pytest.raises(GrammarBusy, match=r"no grammar compiler was free within 0.2 s") as busy:
        pool.compile("json_schema", SMALL, key="c", wait_s=0.2)
    assert isinstance(busy.value, GrammarTimeout) and busy.value.limit == "compile_timeout_s"
    assert pool.waiting() == {"a": 1}  # the busy one left the queue
    cancelled.set()
    others_cancelled.set()
    for thread in threads + others:
        thread.join(30)
    assert all(isinstance(end, GrammarCancelled) for end in ends + others_ends) and len(ends + others_ends) == 3


def _niceness(xgr: Any, compiler: Any, kind: str, text: str) -> Any:
    """In the child: refuses every compile, naming the child's CPU niceness."""
    raise RuntimeError(f"niceness {os.nice(0)}")


def test_workers_compile_below_the_engines_cpu_priority(checkpoint):
    """A costly schema's compile is CPU work of one client: its worker runs niced (as the media box's children),
    so the engine's steps for everyone else go first on busy cores."""
    from transformers import AutoTokenizer

    from engine.grammar_pool import NICE

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=512, stop_token_ids=[tokenizer.eos_token_id])
    niced = GrammarPool(info, GrammarLimits(workers=1, compile_timeout_s=60), _niceness)
    try:
        with pytest.raises(Exception) as refused:
            niced.compile("json", SMALL, threading.Event(), key="k")
        assert f"niceness {min(19, os.nice(0) + NICE)}" in str(refused.value)
    finally:
        niced.close()
