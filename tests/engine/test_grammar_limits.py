"""Grammars that could crash or wedge a server: refused by their limits before anything compiles, and, past the
limits, compiled in a supervised child whose crash (SIGSEGV), overrun or cancellation ends only that child."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest

from engine.grammar import GrammarCompiler, GrammarSpec
from engine.grammar_limits import GrammarLimitError, GrammarLimits
from engine.grammar_pool import GrammarCancelled, GrammarTimeout

pytest.importorskip("xgrammar")

# Past every size limit: what a compiler with these limits runs is bounded only by its deadline.
UNLIMITED = dict(max_regex_depth=10**7, max_regex_chars=10**7, max_properties=10**6, max_schema_bytes=10**8,
                 max_repetition=10**7, max_total_repetition=10**9, max_schema_depth=10**6)
DEEP_PATTERN = {"type": "string", "pattern": "(" * 30_000 + "a" + ")" * 30_000}  # overflows xgrammar's C stack


def many_properties(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)


def compiler_with(tokenizer, **limits) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, 512, [tokenizer.eos_token_id], GrammarLimits(**limits))


@pytest.mark.parametrize("spec,limit", [
    (lambda: GrammarSpec.from_schema(DEEP_PATTERN), "max_regex_chars"),
    (lambda: GrammarSpec.from_schema({"type": "string", "pattern": "(" * 100 + "a" + ")" * 100}), "max_regex_depth"),
    (lambda: GrammarSpec(regex="[a]" + "(" * 40 + ")" * 40), "max_regex_depth"),
    (lambda: GrammarSpec(regex="a{1,8000}"), "max_repetition"),
    (lambda: GrammarSpec(regex="(a{1,100}){1,100}"), "max_repetition"),
    (lambda: GrammarSpec(regex="x" * 5000), "max_regex_chars"),
    (lambda: GrammarSpec.from_schema({"enum": [f"v{i}" for i in range(100_000)]}), "max_schema_bytes"),
    (lambda: GrammarSpec.from_schema({"enum": [f"v{i}" for i in range(1000)]}), "max_enum_values"),
    (lambda: GrammarSpec.from_schema(many_properties(2000)), "max_properties"),
    (lambda: GrammarSpec.from_schema({"type": "array", "items": {"type": "string", "pattern": "[a-z]{0,5000}"}}),
     "max_repetition"),
    (lambda: GrammarSpec(json_schema='{"items":' * 100 + "{}" + "}" * 100), "max_schema_depth"),
    # Each repetition within max_repetition, their sum not: 200 of a{0,1024} (each pattern, or one regex).
    (lambda: GrammarSpec.from_schema({"type": "object", "properties": {
        f"p{i}": {"type": "string", "pattern": "a{0,1024}"} for i in range(60)}}), "max_total_repetition"),
    (lambda: GrammarSpec.from_schema({"type": "array", "prefixItems": [
        {"type": "string", "pattern": "a{0,1024}"} for _ in range(200)]}), "max_total_repetition"),
    (lambda: GrammarSpec(regex="a{0,1024}" * 200), "max_total_repetition"),
])
def test_limits_refuse_before_any_compile(tokenizer, spec, limit):
    compiler = compiler_with(tokenizer)
    with pytest.raises(GrammarLimitError) as refused:
        compiler.compile(spec())
    assert refused.value.limit == limit and limit in str(refused.value)
    assert compiler.pool.started == 0  # nothing reached a compiler
    compiler.close()


@pytest.mark.parametrize("ref", ["file:///etc/passwd", "http://127.0.0.1:9/schema.json", "other.json#/a"])
def test_references_outside_the_schema_are_refused(tokenizer, ref):
    compiler = compiler_with(tokenizer)
    with pytest.raises(ValueError, match="points outside the schema"):
        compiler.compile(GrammarSpec.from_schema({"type": "object", "properties": {"a": {"$ref": ref}}}))
    local = {"$defs": {"n": {"type": "integer"}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}}
    assert compiler.compile(GrammarSpec.from_schema(local)) is not None
    compiler.close()


def test_a_compiler_crash_ends_its_child_only(tokenizer):
    compiler = compiler_with(tokenizer, **UNLIMITED)
    with pytest.raises(ValueError, match="crashed the compiler .signal SIGSEGV"):
        compiler.compile(GrammarSpec.from_schema(DEEP_PATTERN))
    assert compiler.pool.restarts == 1
    matcher = compiler.matcher(GrammarSpec(regex="[0-9]+"))  # a new child compiles the next one
    assert matcher.accept(tokenizer.encode("7", add_special_tokens=False)[0])
    compiler.close()


def test_a_compile_past_its_deadline_is_killed(tokenizer):
    compiler = compiler_with(tokenizer, **UNLIMITED, compile_timeout_s=0.5, workers=1)
    with pytest.raises(GrammarTimeout, match=r"longer than 0.5 s .*compile_timeout_s"):
        compiler.compile(GrammarSpec.from_schema(many_properties(1000)))  # tens of seconds
    assert compiler.pool.restarts == 1
    assert compiler.compile(GrammarSpec(regex="[a-z]+")) is not None  # the only worker was replaced
    compiler.close()


def test_a_cancelled_compile_frees_its_worker(tokenizer):
    compiler = compiler_with(tokenizer, **UNLIMITED, workers=1)
    cancelled = threading.Event()
    threading.Timer(0.3, cancelled.set).start()
    began = time.monotonic()
    with pytest.raises(GrammarCancelled):
        compiler.compile(GrammarSpec.from_schema(many_properties(1000)), cancelled)
    assert time.monotonic() - began < 5  # not the compile's tens of seconds
    assert compiler.compile(GrammarSpec(regex="[a-z]+")) is not None
    compiler.close()


def test_string_and_array_bounds_compile_in_constant_size(tokenizer):
    compiler = compiler_with(tokenizer)
    sizes = {compiler.compile(GrammarSpec.from_schema({"type": "string", "minLength": n})).memory_size_bytes
             for n in (10, 10**6)}
    assert len(sizes) == 1  # so they need no limit
    compiler.close()


def test_the_compiled_cache_is_bounded_in_bytes(tokenizer):
    compiler = compiler_with(tokenizer)
    first = compiler.compile(GrammarSpec(regex="[0-9]{1,8}"))
    size = first.memory_size_bytes
    compiler.close()
    compiler = compiler_with(tokenizer, max_cache_bytes=int(size * 2.5))
    for letter in "abcdefg":
        compiler.compile(GrammarSpec(regex=f"[0-9]{{1,8}}{letter}"))
        assert compiler.cache.bytes <= compiler.cache.max_bytes
    assert 1 <= len(compiler.cache) < 7
    compiler.close()


def test_children_end_with_close_and_with_a_killed_server(tokenizer, checkpoint):
    import subprocess
    import sys

    earlier = set(multiprocessing.active_children())  # other tests' engines may hold compilers of their own
    compiler = compiler_with(tokenizer)
    compiler.compile(GrammarSpec(regex="[0-9]+"))
    children = [p for p in multiprocessing.active_children() if p.name == "vlmcap-grammar" and p not in earlier]
    assert children
    compiler.close()
    assert not any(child.is_alive() for child in children)
    # A server killed outright (SIGKILL, no cleanup) leaves no compiler child behind: its pipe's end closes.
    script = (
        "import os, signal, sys\n"
        "from transformers import AutoTokenizer\n"
        "from engine.grammar import GrammarCompiler, GrammarSpec\n"
        f"tokenizer = AutoTokenizer.from_pretrained({checkpoint!r})\n"
        "compiler = GrammarCompiler(tokenizer, 512, [tokenizer.eos_token_id])\n"
        "compiler.compile(GrammarSpec(regex='[0-9]+'))\n"
        "import multiprocessing\n"
        "print(*[p.pid for p in multiprocessing.active_children()], flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    pids = [int(pid) for pid in done.stdout.split()]
    assert pids, done.stderr[-2000:]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"  # a zombie has ended (its parent, init, reaps it)
    except FileNotFoundError:
        return False


def test_repetition_within_the_total_compiles_beside_a_refused_sum(tokenizer):
    compiler = compiler_with(tokenizer)
    plain = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "a{0,1024}"} for i in range(4)}}
    assert compiler.compile(GrammarSpec.from_schema(plain)) is not None
    with pytest.raises(GrammarLimitError, match="max_total_repetition"):
        compiler.compile(GrammarSpec(regex="(b{0,1000})" * 9))
    compiler.close()
