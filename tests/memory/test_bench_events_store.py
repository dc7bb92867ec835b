"""`vlmcap bench events` on a small store: every search kind and the write cost are reported, the store holds
what was written, an exact similar search has a recall of 1 (timings are the benchmark's, not checked here)."""

from __future__ import annotations

import json

from tests.bench.test_bench import invoke


def test_bench_events_reports_writes_and_every_search(tmp_path):
    out = tmp_path / "events.json"
    invoke(["bench", "events", "--events", "300", "--dim", "16", "--repeats", "2", "--store",
            str(tmp_path / "store.db"), "--json", str(out), "--png", str(tmp_path / "events.png")])
    result = json.loads(out.read_text())
    assert result["events"] == 300 and result["store"] == "SQLiteEventStore"
    assert set(result["search_ms"]) == {"newest page", "a camera's hour", "one word", "two words, one camera",
                                        "falls this week", "a word's second page", "similar", "similar, one camera",
                                        "similar, a camera's hour"}
    assert all(ms["p50"] > 0 for ms in result["search_ms"].values())
    assert result["write_ms"]["all"]["p50"] > 0 and result["file_bytes"] > 0
    # SQLite's similar search is exact: it finds every one of the exact nearest events
    assert result["vectors"] == "sqlite-vec scan"
    assert result["similar_recall"] == {"similar": 1.0, "similar, one camera": 1.0, "similar, a camera's hour": 1.0}
    assert (tmp_path / "events.png").stat().st_size > 0
