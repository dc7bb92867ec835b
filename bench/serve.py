"""`vlmcap bench serve`: a load generator for any OpenAI-compatible server (this one, or a peer such as
vLLM), after vLLM's serving benchmark.

Requests arrive as a Poisson process at `rate` per second (with `burstiness` != 1 the gaps are
gamma-distributed with the same mean); a share `image_fraction` of them are captioning requests that
carry a photo. Every request streams. Reported: TTFT (send to first streamed token), ITL (gaps between
streamed tokens, pooled over requests), TPOT ((end-to-end - TTFT) / (tokens - 1)), end-to-end latency,
request and token throughput, and goodput: the requests per second that meet every SLO given.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from api.percentiles import percentiles_ms
from bench.configs import ServeConfig
from bench.report import machine, pyplot, sample_images, save_figure, stream_lines

WORDS = "a person walks past the bus while two friends talk near the station entrance in the rain".split()


@dataclass
class RequestRecord:
    kind: str
    sent: float
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    output_tokens: int = 0
    error: str | None = None


def parse_slo(text: str | None) -> dict[str, float]:
    """`ttft=500,itl=100` -> {"ttft": 500.0, "itl": 100.0} (milliseconds)."""
    slo: dict[str, float] = {}
    for part in filter(None, (text or "").split(",")):
        name, _, value = part.partition("=")
        if name.strip() not in ("ttft", "itl", "tpot", "e2e") or not value:
            raise ValueError(f"SLO {part!r} is not NAME=MS with NAME one of ttft, itl, tpot, e2e")
        slo[name.strip()] = float(value)
    return slo


def arrival_gaps(cfg: ServeConfig, rng: np.random.Generator, count: int) -> list[float]:
    if cfg.rate <= 0:
        raise ValueError(f"rate must be positive, got {cfg.rate}")
    if cfg.rate == float("inf"):
        return [0.0] * count
    # Gamma with shape k and scale 1/(k*rate) has mean 1/rate; k = 1 is a Poisson process.
    return list(rng.gamma(cfg.burstiness, 1.0 / (cfg.burstiness * cfg.rate), size=count))


def _image_url() -> str:
    buf = io.BytesIO()
    sample_images()[0].save(buf, format="JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


async def _one(
    client: Any, cfg: ServeConfig, model: str, body_text: str, image: str | None, rec: RequestRecord
) -> None:
    content: Any = body_text
    if image is not None:
        content = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": body_text}]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": cfg.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": cfg.temperature,
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    last = rec.sent
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                rec.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            async for line in stream_lines(response):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    rec.output_tokens = chunk["usage"].get("completion_tokens", rec.output_tokens)
                if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    now = time.perf_counter()
                    if rec.ttft is None:
                        rec.ttft = now - rec.sent
                    else:
                        rec.itl.append(now - last)
                    last = now
        rec.e2e = time.perf_counter() - rec.sent
    except Exception as exc:  # the benchmark reports failures, it does not stop on them
        rec.error = f"{type(exc).__name__}: {exc}"


async def _run(cfg: ServeConfig) -> tuple[list[RequestRecord], float, str]:
    import httpx
    from tqdm import tqdm

    rng = np.random.default_rng(cfg.seed)
    words = random.Random(cfg.seed)
    count = cfg.num_requests or int(cfg.rate * (cfg.duration or 60.0) * 2 + 10)
    gaps = arrival_gaps(cfg, rng, count)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    image = _image_url() if cfg.image_fraction > 0 else None
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=cfg.url, headers=headers, timeout=cfg.timeout, limits=limits) as client:
        model = cfg.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        records: list[RequestRecord] = []
        tasks = []
        began = time.perf_counter()
        progress = tqdm(total=count if cfg.num_requests else None, unit="req", desc="requests")
        for gap in gaps:
            if cfg.duration is not None and time.perf_counter() - began >= cfg.duration:
                break
            await asyncio.sleep(gap)
            with_image = image is not None and rng.random() < cfg.image_fraction
            rec = RequestRecord(kind="image" if with_image else "chat", sent=time.perf_counter())
            records.append(rec)
            text = " ".join(words.choice(WORDS) for _ in range(cfg.prompt_words))
            task = asyncio.create_task(_one(client, cfg, model, text, image if with_image else None, rec))
            task.add_done_callback(lambda _: progress.update(1))
            tasks.append(task)
        await asyncio.gather(*tasks)
        progress.close()
        return records, time.perf_counter() - began, model


def _stats(values_s: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values_s) * 1000.0 if values_s else math.nan, **percentiles_ms(values_s)}


def _meets(rec: RequestRecord, tpot: float | None, slo: dict[str, float]) -> bool:
    checks = {
        "ttft": rec.ttft,
        "itl": max(rec.itl) if rec.itl else 0.0,
        "tpot": tpot,
        "e2e": rec.e2e,
    }
    return all(checks[name] is not None and checks[name] * 1000.0 <= limit for name, limit in slo.items())


def summarize(cfg: ServeConfig, records: list[RequestRecord], span: float, model: str) -> dict[str, Any]:
    done = [r for r in records if r.error is None and r.ttft is not None]
    tpots = {id(r): (r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1}
    good = [r for r in done if _meets(r, tpots.get(id(r)), cfg.slo)]
    return {
        "config": asdict(cfg) | {"model": model},
        "machine": machine(with_torch=False),
        "requests": {"sent": len(records), "completed": len(done), "failed": len(records) - len(done),
                     "image": sum(r.kind == "image" for r in records)},
        "errors": sorted({r.error for r in records if r.error})[:10],
        "duration_s": span,
        "request_throughput": len(done) / span,
        "output_token_throughput": sum(r.output_tokens for r in done) / span,
        "goodput": len(good) / span,
        "ttft_ms": _stats([r.ttft for r in done]),
        "itl_ms": _stats([gap for r in done for gap in r.itl]),
        "tpot_ms": _stats(list(tpots.values())),
        "e2e_ms": _stats([r.e2e for r in done]),
        "samples": {
            "ttft_ms": [r.ttft * 1000.0 for r in done],
            "itl_ms": [g * 1000.0 for r in done for g in r.itl],
            "e2e_ms": [r.e2e * 1000.0 for r in done],
        },
    }


def run_serve(cfg: ServeConfig) -> dict[str, Any]:
    if cfg.num_requests is None and cfg.duration is None:
        raise ValueError("give num_requests or duration")
    records, span, model = asyncio.run(_run(cfg))
    return summarize(cfg, records, span, model)


def summary(result: dict[str, Any]) -> str:
    req = result["requests"]
    lines = [
        f"requests: {req['completed']} completed, {req['failed']} failed, {req['image']} with an image, "
        f"in {result['duration_s']:.1f} s",
        f"throughput: {result['request_throughput']:.2f} req/s, {result['output_token_throughput']:.1f} output tok/s,"
        f" goodput {result['goodput']:.2f} req/s (SLO {result['config']['slo'] or 'none'})",
        f"{'metric (ms)':<14}{'mean':>10}{'p50':>10}{'p99':>10}{'max':>10}",
    ]
    for name in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        s = result[name]
        lines.append(f"{name[:-3].upper():<14}{s['mean']:>10.1f}{s['p50']:>10.1f}{s['p99']:>10.1f}{s['max']:>10.1f}")
    lines += [f"error: {e}" for e in result["errors"]]
    return "\n".join(lines)


def plot(result: dict[str, Any], png_path: str) -> None:
    """Distributions of TTFT, ITL and end-to-end latency."""
    plt = pyplot()
    samples = result["samples"]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
    for ax, name in zip(axes, ("ttft_ms", "itl_ms", "e2e_ms")):
        if samples[name]:
            ax.hist(samples[name], bins=30, color="tab:blue")
        ax.set_title(f"{name[:-3].upper()} (ms): p50 {result[name]['p50']:.0f}, p99 {result[name]['p99']:.0f}",
                     fontsize=9)
    save_figure(fig, png_path)
