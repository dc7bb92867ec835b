"""`vlmcap bench overhead`: what serving over HTTP costs against the engine alone.

The same `chats` chats (the same messages, `max_tokens` tokens each with `ignore_eos`) run twice: through the
engine directly (`add_request`, then `step()` until all finish, in this process) and through `vlmcap serve`
started as its own process with the same engine settings, streamed by an HTTP client from this process.
Reported for each: output tokens per second (from the first request sent to the last token), the gaps between
a chat's text deltas, as a streaming client sees them (p50, p99; a token whose text is held back, such as
part of a multi-byte character, makes no delta on either side), and the ratios.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from typing import Any

from api.percentiles import percentiles_ms
from bench.configs import OverheadConfig
from bench.report import machine, pyplot, save_figure, stream_lines

CHAT = [{"role": "user", "content": "Tell me a long story about a bus driver in a rainy city."}]


def _engine_config(cfg: OverheadConfig):
    from engine import EngineConfig

    return EngineConfig(model=cfg.model, dtype=cfg.dtype, max_num_batched_tokens=cfg.budget,
                        max_num_seqs=max(cfg.chats, 1), num_threads=cfg.threads)


def _result(times: list[list[float]], tokens: int, began: float) -> dict[str, Any]:
    gaps = [b - a for stream in times for a, b in zip(stream, stream[1:])]
    end = max(stream[-1] for stream in times)
    return {"output_tok_s": tokens / (end - began), "itl_ms": percentiles_ms(gaps), "tokens": tokens,
            "span_s": end - began}


def run_direct(cfg: OverheadConfig, engine=None) -> dict[str, Any]:
    """The chats through `Engine.step` in this process."""
    from engine import Engine, SamplingParams

    engine = engine or Engine(_engine_config(cfg))
    params = SamplingParams(max_tokens=cfg.max_tokens, ignore_eos=True)
    began = time.perf_counter()
    ids = [engine.add_request(messages=CHAT, sampling=params) for _ in range(cfg.chats)]
    times: dict[str, list[float]] = {rid: [] for rid in ids}
    shown = dict.fromkeys(ids, 0)
    tokens = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            tokens += 1
            if len(out.text) > shown[out.request_id]:  # as a client sees it: when there is new text
                shown[out.request_id] = len(out.text)
                times[out.request_id].append(now)
    return _result(list(times.values()), tokens, began)


async def _stream(client: Any, model: str, max_tokens: int, times: list[float]) -> int:
    body = {"model": model, "messages": CHAT, "max_tokens": max_tokens, "stream": True, "temperature": 0.0,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    tokens = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in stream_lines(response):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                times.append(time.perf_counter())
    return tokens


async def _run_http(url: str, cfg: OverheadConfig) -> dict[str, Any]:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        times: list[list[float]] = [[] for _ in range(cfg.chats)]
        began = time.perf_counter()
        tokens = await asyncio.gather(*(_stream(client, model, cfg.max_tokens, t) for t in times))
    return _result(times, sum(tokens), began)


class ServerProcess:
    """`vlmcap serve` in its own process, with the engine settings of `cfg`, on a free local port."""

    def __init__(self, cfg: OverheadConfig) -> None:
        self.cfg = cfg
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        import httpx

        cfg = self.cfg
        args = ["serve", "--model", cfg.model, "--dtype", cfg.dtype, "--port", str(self.port), "--no-queue",
                "--max-num-batched-tokens", str(cfg.budget), "--max-num-seqs", str(max(cfg.chats, 1)),
                "--log-level", "warning"]
        if cfg.threads:
            args += ["--num-threads", str(cfg.threads)]
        env = {k: v for k, v in os.environ.items() if k not in ("VLMCAP_API_KEY", "REDIS_URL")}
        self.process = subprocess.Popen(
            [sys.executable, "-c", "from cli.main import app; app(prog_name='vlmcap')", *args], env=env
        )
        deadline = time.monotonic() + cfg.ready_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vlmcap serve exited with {self.process.returncode}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"vlmcap serve was not ready within {cfg.ready_timeout} s")

    def __exit__(self, *exc: Any) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def run_overhead(cfg: OverheadConfig) -> dict[str, Any]:
    from engine import Engine

    if cfg.chats < 1 or cfg.max_tokens < 2 or cfg.repeats < 1:
        raise ValueError(f"chats and repeats must be positive and max_tokens at least 2: {cfg}")
    direct_runs, http_runs = [], []
    engine = Engine(_engine_config(cfg))
    run_direct(cfg, engine)  # warm-up
    with ServerProcess(cfg) as server:
        asyncio.run(_run_http(server.url, cfg))  # warm-up
        for _ in range(cfg.repeats):
            direct_runs.append(run_direct(cfg, engine))
            http_runs.append(asyncio.run(_run_http(server.url, cfg)))
    direct = max(direct_runs, key=lambda r: r["output_tok_s"])
    http = max(http_runs, key=lambda r: r["output_tok_s"])
    return {
        "config": asdict(cfg),
        "machine": machine(),
        "direct": direct,
        "http": http,
        "runs": {"direct": direct_runs, "http": http_runs},
        "ratios": {
            "http_vs_direct_tok_s": http["output_tok_s"] / direct["output_tok_s"],
            "http_vs_direct_itl_p50": http["itl_ms"]["p50"] / direct["itl_ms"]["p50"],
        },
    }


def summary(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [f"{cfg['chats']} chats x {cfg['max_tokens']} tokens, {cfg['model']} {cfg['dtype']}",
             f"{'':<10}{'tok/s':>9}{'ITL p50':>10}{'p99':>9}"]
    for name in ("direct", "http"):
        run = result[name]
        lines.append(f"{name:<10}{run['output_tok_s']:>9.1f}{run['itl_ms']['p50']:>10.1f}{run['itl_ms']['p99']:>9.1f}")
    ratios = result["ratios"]
    lines.append(f"HTTP / direct: {ratios['http_vs_direct_tok_s']:.3f}x tokens/s, "
                 f"{ratios['http_vs_direct_itl_p50']:.3f}x ITL p50")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    names = ["direct", "http"]
    axes[0].bar(names, [result[n]["output_tok_s"] for n in names], color=["tab:blue", "tab:orange"])
    axes[0].set_title("output tokens/s", fontsize=9)
    axes[1].bar(names, [result[n]["itl_ms"]["p50"] for n in names], color=["tab:blue", "tab:orange"])
    axes[1].set_title("ITL p50 (ms)", fontsize=9)
    save_figure(fig, path)
