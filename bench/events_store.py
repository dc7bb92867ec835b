"""`vlmcap bench events`: what the camera memory costs. A store filled with `events` synthetic events (captions
from a vocabulary, 16 cameras over 30 days, a structured caption on every third, one real thumbnail each, a unit
vector of the served model's hidden size near one of its camera's scenes), written one job at a time as the
server's writer does: the write cost per job (p50/p99 of `add`, early and once the store is full), then the latency
of each kind of search at that size (newest page, a camera's hour, one word, two words with a camera, falls,
similar by vector, similar within a camera, the second page of a word), and how many of the exact nearest events
each similar search found (recall: 1.0 for an exact scan; pgvector's HNSW index is approximate). With
`--embed-model` it also times the writer's other per-job work: the thumbnails, and a frame's embedding from that
model's vision tower (what the writer runs for a frame whose caption gave none: a tiled sighting, a clip's still; an
event's frames come with their caption's own).

SQLite by default (a temporary file, or `--store PATH`); `--store postgresql://...` measures the PostgreSQL
store the same way (with pgvector's index where the server has the extension, else its `real[]` scan: `vectors`
in the result says which)."""

from __future__ import annotations

import math
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

WORDS = ("person walks enters leaves gate door coat red blue black white jacket bag dog car bicycle stands sits "
         "falls ground runs left right middle corridor parking warehouse helmet umbrella phone talks waits two "
         "three group child adult carries box looks camera night light").split()


@dataclass
class EventsBenchConfig:
    """`vlmcap bench events`: the event store's write cost and search latency.

    events: events in the store when searches are timed.
    dim: values of each event's vector (the model's hidden size; 576 for SmolVLM-256M).
    repeats: times each search runs (p50/p99 over them).
    store: the store to fill: a SQLite file (it must not exist) or a postgresql:// URL of an empty database
        (default: a temporary SQLite file).
    embed_model: also time a job's thumbnails and embedding on this model ('tiny', a checkpoint, dummy:<preset>).
    seed: the synthetic events' random seed.
    """

    events: int = 100_000
    dim: int = 576
    repeats: int = 20
    store: str | None = None
    embed_model: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("events", "dim", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")


def _thumbnail() -> bytes:
    from PIL import Image

    from bench.report import photo_paths
    from memory.jobs import thumbnail

    path = photo_paths()[0]
    return thumbnail(path.read_bytes(), 320) if path.exists() else Image.new("RGB", (8, 8)).tobytes()


# Frames cluster: a camera sees a few scenes, and each event's vector lies near one of its camera's (a cosine of
# about 0.8 with the scene's center at 576 values), not at an independent random point, where no neighbourhoods
# exist and no graph index (pgvector's HNSW) can find the exact nearest.
CAMERAS = 16
SCENES = 8  # scenes per camera
SPREAD = 0.03  # each value's noise around a scene's unit center


def _vector(rng: Any, dim: int, center: Any = None) -> list[float]:
    values = rng.standard_normal(dim) if center is None else center + SPREAD * rng.standard_normal(dim)
    return (values / math.sqrt(float(values @ values))).tolist()


def _scenes(cfg: EventsBenchConfig) -> Any:
    """[CAMERAS * SCENES, dim]: each camera's scenes' unit centers, camera c's at rows c * SCENES on."""
    import numpy as np

    rng = np.random.default_rng(cfg.seed + 2)
    return np.asarray([_vector(rng, cfg.dim) for _ in range(CAMERAS * SCENES)])


def _events(cfg: EventsBenchConfig, jpeg: bytes, now: float, scenes: Any):
    import numpy as np

    from memory import Event, EventFrame

    rng, vectors = random.Random(cfg.seed), np.random.default_rng(cfg.seed)
    span = 30 * 86400.0
    for index in range(cfg.events):
        start = now - span + span * index / cfg.events
        fall = index % 50 == 49
        structured = ({"clothing": rng.choice(WORDS), "action": rng.choice(WORDS), "threat_level": rng.randint(0, 2)}
                      if index % 3 == 0 else None)
        camera = index % CAMERAS
        scene = scenes[camera * SCENES + rng.randrange(SCENES)]
        yield Event(id=f"bench-{index}", camera_id=f"cam-{camera}", kind="fall" if fall else
                    rng.choice(("sighting", "event")), start_ts=start, end_ts=start + rng.uniform(0, 30),
                    finished_at=start + 31, caption=" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 24))),
                    structured=structured, fall=fall, track_id=index % 100, person_count=rng.randint(1, 4),
                    frames=[EventFrame(jpeg, start)], embedding=_vector(vectors, cfg.dim, scene))


def _timed(run: Any, repeats: int) -> tuple[list[float], Any]:
    seconds, result = [], None
    for _ in range(repeats):
        began = time.perf_counter()
        result = run()
        seconds.append(time.perf_counter() - began)
    return seconds, result


def _embed_cost(cfg: EventsBenchConfig, jpeg: bytes) -> dict[str, Any]:
    """The writer's per-job work besides the write: thumbnails of an event's frames and their embedding."""
    from api.percentiles import percentiles_ms
    from bench.report import photo_paths
    from engine import Engine, EngineConfig
    from memory.jobs import thumbnail

    engine = Engine(EngineConfig(model=cfg.embed_model))
    try:
        photo = photo_paths()[0].read_bytes()
        thumbs, _ = _timed(lambda: thumbnail(photo, 320), cfg.repeats)
        embeds, vector = _timed(lambda: engine.embed(images=[jpeg]), cfg.repeats)
        return {"model": cfg.embed_model, "thumbnail_ms": percentiles_ms(thumbs), "embed_frame_ms":
                percentiles_ms(embeds), "dim": len(vector[0])}
    finally:
        engine.close()


class _Exact:
    """The exact answer of a similar search over the events written: each one's cosine with the probe, camera and
    span, kept as they are written (a float each, not the vectors)."""

    def __init__(self, probe: Any) -> None:
        self.probe = probe
        self.rows: list[tuple[float, str, str, float, float]] = []

    def add(self, event: Any) -> None:
        import numpy as np

        score = float(self.probe @ np.asarray(event.embedding))
        self.rows.append((score, event.id, event.camera_id, event.start_ts, event.end_ts))

    def recall(self, query: Any, found: list[str]) -> float:
        """The share of the query's `limit` exact nearest events (its cameras and span) that `found` has."""
        kept = [(-score, event_id) for score, event_id, camera, start, end in self.rows
                if (not query.cameras or camera in query.cameras) and (query.since is None or end >= query.since)
                and (query.until is None or start <= query.until)]
        best = {event_id for _, event_id in sorted(kept)[: query.limit]}
        return len(best & set(found)) / len(best) if best else 1.0


def run_events_bench(cfg: EventsBenchConfig) -> dict[str, Any]:
    from api.percentiles import percentiles_ms
    from bench.report import machine
    from memory import EventQuery, Retention, open_store_at

    folder = tempfile.TemporaryDirectory(prefix="vlmcap-bench-events-") if cfg.store is None else None
    location = cfg.store or str(Path(folder.name) / "events.db")
    if not location.startswith(("postgresql://", "postgres://")) and Path(location).exists():
        raise ValueError(f"the store {location} exists: the benchmark fills a new one")
    store = open_store_at(location, Retention(max_age_s=365 * 86400.0, max_bytes=2**62))
    try:
        import numpy as np

        jpeg = _thumbnail()
        now = time.time()
        # A new frame of camera 7's first scene: its nearest events are that scene's, of every camera's hour.
        scenes = _scenes(cfg)
        probe = _vector(np.random.default_rng(cfg.seed + 1), cfg.dim, scenes[7 * SCENES])
        exact = _Exact(np.asarray(probe))
        adds: list[float] = []
        began = time.perf_counter()
        for event in _events(cfg, jpeg, now, scenes):
            start = time.perf_counter()
            store.add(event)
            adds.append(time.perf_counter() - start)
            exact.add(event)
        fill_s = time.perf_counter() - began
        word, other = WORDS[3], WORDS[7]
        first_page = store.search(EventQuery(q=word, limit=50))
        queries = {
            "newest page": EventQuery(limit=50),
            "a camera's hour": EventQuery(cameras=("cam-3",), since=now - 86400, until=now - 86400 + 3600),
            "one word": EventQuery(q=word, limit=50),
            "two words, one camera": EventQuery(q=f"{word} {other}", cameras=("cam-5",), limit=50),
            "falls this week": EventQuery(fall=True, since=now - 7 * 86400, limit=50),
            "a word's second page": EventQuery(q=word, limit=50, cursor=first_page.next_cursor),
        }
        searches = {name: percentiles_ms(_timed(lambda q=q: store.search(q), cfg.repeats)[0])
                    for name, q in queries.items()}
        recall = {}
        for name, query in {"similar": EventQuery(limit=10),
                            "similar, one camera": EventQuery(cameras=("cam-7",), limit=10),
                            "similar, a camera's hour": EventQuery(cameras=("cam-3",), since=now - 86400,
                                                                   until=now - 86400 + 3600, limit=10)}.items():
            seconds, found = _timed(lambda q=query: store.similar(probe, q), cfg.repeats)
            searches[name] = percentiles_ms(seconds)
            recall[name] = exact.recall(query, [event.id for event, _ in found])
        early = adds[: min(2000, len(adds))]
        late = adds[-min(2000, len(adds)):]
        result: dict[str, Any] = {
            "benchmark": "events",
            "config": asdict(cfg),
            "machine": machine(with_torch=cfg.embed_model is not None),
            "store": type(store).__name__,
            "vectors": {True: "pgvector HNSW", False: "real[] scan"}.get(getattr(store, "pgvector", None),
                                                                         "sqlite-vec scan"),
            "events": store.count(),
            "fill_s": fill_s,
            "write_ms": {"first": percentiles_ms(early), "last": percentiles_ms(late), "all": percentiles_ms(adds)},
            "search_ms": searches,
            "similar_recall": recall,
            "file_bytes": (sum(p.stat().st_size for p in Path(location).parent.glob(Path(location).name + "*"))
                           if not location.startswith("postgres") else None),
        }
        if cfg.embed_model:
            result["embedding"] = _embed_cost(cfg, jpeg)
        return result
    finally:
        store.close()
        if folder is not None:
            folder.cleanup()


def summary(result: dict[str, Any]) -> str:
    write = result["write_ms"]
    lines = [f"events: {result['store']} ({result.get('vectors')}) with {result['events']:,} events, filled in "
             f"{result['fill_s']:.1f} s",
             f"  write per job: p50 {write['all']['p50']:.2f} ms, p99 {write['all']['p99']:.2f} ms "
             f"(first 2,000: p50 {write['first']['p50']:.2f}; last 2,000: p50 {write['last']['p50']:.2f})"]
    for name, ms in result["search_ms"].items():
        recall = result.get("similar_recall", {}).get(name)
        lines.append(f"  {name:<24} p50 {ms['p50']:8.2f} ms  p99 {ms['p99']:8.2f} ms"
                     + (f"  recall {recall:.2f}" if recall is not None else ""))
    if result.get("file_bytes"):
        lines.append(f"  file: {result['file_bytes'] / 2**20:.0f} MiB")
    if "embedding" in result:
        embed = result["embedding"]
        lines.append(f"  per job on {embed['model']}: thumbnail p50 {embed['thumbnail_ms']['p50']:.1f} ms, embedding a "
                     f"frame p50 {embed['embed_frame_ms']['p50']:.1f} ms ({embed['dim']} values)")
    return "\n".join(lines)


def plot(result: dict[str, Any], png_path: str) -> None:
    from bench.report import pyplot, save_figure

    plt = pyplot()
    names = list(result["search_ms"])
    fig, ax = plt.subplots(figsize=(9, 4))
    positions = range(len(names))
    ax.barh([p - 0.2 for p in positions], [result["search_ms"][n]["p50"] for n in names], height=0.4, label="p50")
    ax.barh([p + 0.2 for p in positions], [result["search_ms"][n]["p99"] for n in names], height=0.4, label="p99")
    ax.set_yticks(list(positions), names)
    ax.set_xscale("log")
    ax.set_xlabel("ms")
    ax.set_title(f"{result['store']}: search at {result['events']:,} events "
                 f"(write p50 {result['write_ms']['all']['p50']:.2f} ms a job)")
    ax.legend()
    save_figure(fig, png_path)
