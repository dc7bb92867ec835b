"""The work pools (api/pools.py): a key that floods a pool waits behind its own work while another key's work
runs; the keys take turns; a deadline on the wait and on the run answers 503 `busy` and the thread of a run
past its deadline stays counted until it ends; the request's client key comes from the guard."""

from __future__ import annotations

import asyncio
import threading

import pytest

from api.pools import CLIENT_KEY, SERVER_KEY, PoolBusy, WorkPool, WorkPools


def blocker(release: threading.Event, started: list[str], name: str) -> str:
    started.append(name)
    assert release.wait(30), "never released"
    return name


@pytest.mark.timeout(60)
def test_a_flooding_key_waits_behind_itself_and_a_plain_call_gets_its_answer():
    pool = WorkPool("decode", threads=2, deadline_s=30, per_key=1)
    release, started = threading.Event(), []

    async def scenario() -> tuple[str, dict, dict, list[str]]:
        flood = [asyncio.create_task(pool.run(blocker, release, started, f"flood-{i}", key="flood"))
                 for i in range(6)]
        await asyncio.sleep(0.2)
        plain = await pool.run(lambda: "plain answer", key="plain")
        during = pool.stats()
        release.set()
        done = await asyncio.gather(*flood)
        return plain, during.running, during.waiting, done

    plain, running, waiting, done = asyncio.run(scenario())
    assert plain == "plain answer"
    assert running == {"flood": 1} and waiting == {"flood": 5}  # one thread of two at most, the rest queued
    assert done == [f"flood-{i}" for i in range(6)]
    assert pool.stats().running == {} and pool.stats().waiting == {}


@pytest.mark.timeout(60)
def test_keys_take_turns_on_a_busy_pool():
    pool = WorkPool("render", threads=1, deadline_s=30)
    order: list[str] = []
    gate = threading.Event()

    async def scenario() -> None:
        first = asyncio.create_task(pool.run(gate.wait, 30, key="a"))
        await asyncio.sleep(0.1)
        queued = [asyncio.create_task(pool.run(order.append, name, key=name[0])) for name in ("a1", "a2", "a3")]
        await asyncio.sleep(0.05)
        queued.append(asyncio.create_task(pool.run(order.append, "b1", key="b")))
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.gather(first, *queued)

    asyncio.run(scenario())
    assert order == ["b1", "a1", "a2", "a3"]  # b had no turn yet: it goes before a's second


@pytest.mark.timeout(60)
def test_deadlines_answer_busy_and_a_late_run_keeps_its_thread_until_it_ends():
    pool = WorkPool("summary", threads=1, deadline_s=30)
    release, started = threading.Event(), []

    async def scenario() -> tuple[PoolBusy, PoolBusy, dict, str]:
        with pytest.raises(PoolBusy) as late:
            await pool.run(blocker, release, started, "slow", key="a", deadline_s=0.3)
        with pytest.raises(PoolBusy) as waited:
            await pool.run(lambda: "never", key="b", deadline_s=0.3)
        held = pool.stats().running
        release.set()
        return late.value, waited.value, held, await pool.run(lambda: "after", key="b")

    late, waited, held, after = asyncio.run(scenario())
    assert (late.status, late.code) == (503, "busy") and "did not finish" in late.message
    assert (waited.status, waited.code) == (503, "busy") and "no free worker" in waited.message
    assert held == {"a": 1} and after == "after"
    assert pool.timed_out == 2


def test_a_cancelled_wait_gives_no_thread_away():
    pool = WorkPool("schema", threads=1, deadline_s=30)
    gate = threading.Event()

    async def scenario() -> str:
        holder = asyncio.create_task(pool.run(gate.wait, 30, key="a"))
        await asyncio.sleep(0.1)
        waiter = asyncio.create_task(pool.run(lambda: "cancelled", key="b"))
        await asyncio.sleep(0.05)
        waiter.cancel()
        gate.set()
        await holder
        return await pool.run(lambda: "next", key="c")

    assert asyncio.run(scenario()) == "next"
    assert pool.stats().running == {} and pool.stats().waiting == {}


def test_the_client_key_goes_with_the_call_and_bad_sizes_are_refused():
    pool = WorkPool("admission", threads=2, deadline_s=30)

    async def scenario() -> list[str | None]:
        seen = [await pool.run(CLIENT_KEY.get)]
        CLIENT_KEY.set("alice")
        seen.append(await pool.run(CLIENT_KEY.get))
        return seen

    assert asyncio.run(scenario()) == [None, "alice"]
    assert SERVER_KEY == "server"
    for bad, why in (({"threads": 0}, "thread"), ({"deadline_s": 0}, "deadline"), ({"per_key": 3}, "share")):
        with pytest.raises(ValueError, match=why):
            WorkPool("x", **{"threads": 2, "deadline_s": 1.0, **bad})
    with pytest.raises(ValueError, match="key_share"):
        WorkPools(10.0, 0.0)
    assert WorkPools(10.0, 0.5)["decode"].per_key >= 1


def test_one_servers_pools_are_found_from_its_state_settings_and_limits() -> None:
    from types import SimpleNamespace

    from api.pools import work_pools
    from api.settings import ServerSettings

    settings = ServerSettings(work_deadline_s=7.0, key_share=1.0)
    state = SimpleNamespace(settings=settings)
    pools = work_pools(state)
    assert work_pools(settings) is pools and work_pools(settings.limits) is pools
    assert pools["decode"].deadline_s == 7.0 and pools["decode"].per_key == pools["decode"].threads
    other = ServerSettings()
    assert work_pools(other) is not pools
    pools.close()
    work_pools(other).close()


def test_a_grammar_compile_that_finds_no_worker_is_a_503_for_the_callers_key() -> None:
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from api.errors import APIError
    from api.grammars import compile_ahead
    from engine.grammar import GrammarSpec
    from engine.grammar_pool import GRAMMAR_KEY, GrammarBusy

    seen = []

    def compile(spec, cancelled):  # the engine's compiler, as busy as it gets
        seen.append(GRAMMAR_KEY.get())
        raise GrammarBusy("no grammar compiler was free within 1 s (compile_timeout_s)", 1.0)

    engine = SimpleNamespace(grammars=SimpleNamespace(compile=compile, executor=ThreadPoolExecutor(1)))
    pools = WorkPools(5.0, 0.5)

    async def scenario() -> None:
        for given in ({"key": "salt-1", "pools": pools}, {"key": "salt-2"}):
            with pytest.raises(APIError) as refused:
                await compile_ahead(engine, GrammarSpec(regex="[a-z]+"), "schema", **given)
            assert (refused.value.status, refused.value.code, refused.value.retry_after_s) == (503, "busy", 1.0)

    asyncio.run(scenario())
    assert seen == ["salt-1", "salt-2"]
    pools.close()
    engine.grammars.executor.shutdown()


@pytest.mark.timeout(60)
def test_queue_jobs_decode_by_their_cameras_key_and_an_alert_by_its_own(monkeypatch):
    """A camera whose jobs' images decode slowly holds its share of the decode pool (one thread of three) and its
    other jobs wait behind it; a fall alert's decode, under its own key, runs at once."""
    from types import SimpleNamespace

    from api.captioner import EngineCaptioner, job_key
    from api.settings import Limits
    from jobqueue.consumer import current_job
    from jobqueue.contract import Detection, Job

    limits = Limits()  # pools of its own (the defaults: decode has 3 threads, a key 1 of them)
    release = threading.Event()

    def decode(data: bytes, limits: Limits, param: str) -> SimpleNamespace:
        if not CLIENT_KEY.get().startswith("alert:"):
            assert release.wait(30), "never released"
        return SimpleNamespace(size=(8, 8))

    monkeypatch.setattr("api.captioner.decode_image", decode)
    engine = SimpleNamespace(single_input_options=None, tiling_options=lambda width, height: None)
    captioner = EngineCaptioner(SimpleNamespace(engine=engine), limits, 4)

    async def no_engine(*args) -> str:
        return f"caption for {CLIENT_KEY.get()}"

    captioner._caption = no_engine

    def job(camera: str, fall: bool = False) -> Job:
        return Job(camera_id=camera, frame_ts=0.0, prompt="?", image=b"jpeg", fall=fall,
                   detections=[Detection(0, 0, 1, 1, 0.9)])

    async def caption(of: Job) -> str:  # as the worker runs each job: in its own task, the job in its context
        current_job.set(of)
        return await captioner.caption(of.image, of.prompt, 10)

    async def scenario() -> tuple[str, dict, dict, list[str]]:
        slow = [asyncio.create_task(caption(job("busy"))) for _ in range(4)]
        await asyncio.sleep(0.2)
        alert = await caption(job("busy", fall=True))
        stats = captioner_pools.stats()
        release.set()
        return alert, stats.running, stats.waiting, await asyncio.gather(*slow)

    from api.pools import work_pools

    captioner_pools = work_pools(limits)["decode"]
    alert, running, waiting, slow = asyncio.run(scenario())
    assert alert == "caption for alert:busy"
    assert running == {"camera:busy": 1} and waiting == {"camera:busy": 3}
    assert slow == ["caption for camera:busy"] * 4
    assert job_key() is None and CLIENT_KEY.get() is None  # outside a job's task: no key set


@pytest.mark.timeout(60)
def test_the_grammar_compiler_is_built_in_the_schema_pool_not_on_the_event_loop():
    """Its first use takes about a second (xgrammar imported, the vocabulary read): never on the event loop."""
    from api.grammars import engine_grammars

    built_on: list[str] = []

    class Engine:
        @property
        def grammars(self) -> str:
            built_on.append(threading.current_thread().name)
            return "compiler"

    engine, pools = Engine(), WorkPools(deadline_s=30, key_share=0.5)

    async def scenario() -> list[str]:
        return [await engine_grammars(engine, pools), await engine_grammars(engine, pools)]

    assert asyncio.run(scenario()) == ["compiler", "compiler"]
    assert built_on[0].startswith("vlmcap-schema")  # the first, which builds it, in the pool
    assert built_on[1] == "MainThread"  # once built, read where it is needed
    pools.close()
