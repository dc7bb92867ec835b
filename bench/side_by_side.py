"""The summary table of one `bench/peers_side_by_side.sh` invocation (`python -m bench.side_by_side OUT`): a row a
workload, a column a server, then each vlmcap server's value over each peer's. A server is one whose results are
in OUT: the workloads' JSON (`<server>-chats8.json`, ...), `vllm bench serve`'s table (`<server>-vbench-random-mm.txt`)
or both; a workload no server ran has no row. Written to OUT/summary.md and printed."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

PEERS = ("vllm", "llama-bf16", "llama-q8_0")
VBENCH = "vbench"  # the workload name of `vllm bench serve`'s random-mm table

ROWS: list[tuple[str, str, Callable[[Any], float]]] = [
    ("8 chats: ITL p50 (ms)", "chats8", lambda r: r["itl_ms"]["p50"]),
    ("stall: worst chat gap (ms)", "stall", lambda r: next(iter(r["runs"].values()))["worst_gap_ms"]),
    ("stall: image TTFT (s)", "stall", lambda r: next(iter(r["runs"].values()))["ttft_ms"] / 1000),
    ("stall: chat tok/s in window", "stall", lambda r: next(iter(r["runs"].values()))["chat_tok_s_in_window"]),
    ("32 text requests: output tok/s", "text32", lambda r: r["output_token_throughput"]),
    ("24 at 1/s: TTFT p50 (ms)", "mixed24", lambda r: r["ttft_ms"]["p50"]),
    ("24 at 1/s: e2e p50 (s)", "mixed24", lambda r: r["e2e_ms"]["p50"] / 1000),
    ("random-mm: duration (s)", VBENCH, lambda r: r["Benchmark duration (s)"]),
    ("random-mm: mean TTFT (s)", VBENCH, lambda r: r["Mean TTFT (ms)"] / 1000),
    ("random-mm: median TTFT (s)", VBENCH, lambda r: r["Median TTFT (ms)"] / 1000),
    ("random-mm: P99 ITL (ms)", VBENCH, lambda r: r["P99 ITL (ms)"]),
]


def vbench_table(text: str) -> dict[str, float]:
    """`vllm bench serve`'s result lines ("Mean TTFT (ms):   18218.17") as label -> value; other lines skipped."""
    found = {}
    for line in text.splitlines():
        label, _, value = line.rpartition(":")
        try:
            found[label.strip()] = float(value)
        except ValueError:
            continue
    return found


def load(out: Path, server: str, workload: str) -> Any:
    """`server`'s result of `workload` in `out`, or None where it did not run."""
    if workload == VBENCH:
        path = out / f"{server}-vbench-random-mm.txt"
        return vbench_table(path.read_text()) if path.exists() else None
    path = out / f"{server}-{workload}.json"
    return json.loads(path.read_text()) if path.exists() else None


def servers(out: Path) -> tuple[list[str], list[str]]:
    """The peers and the vlmcap servers (by name, `VLMCAP_NAME`) whose results are in `out`."""
    ran = {p.name.removesuffix("-chats8.json") for p in out.glob("*-chats8.json")}
    ran |= {p.name.removesuffix("-vbench-random-mm.txt") for p in out.glob("*-vbench-random-mm.txt")}
    return [n for n in PEERS if n in ran], sorted(n for n in ran if n.startswith("vlmcap"))


def summary(out: Path) -> str:
    """The table (markdown) of the results in `out`."""
    peers, ours = servers(out)
    columns = peers + ours
    lines = [f"| workload | {' | '.join(columns)} | " + " | ".join(f"{o} / {p}" for o in ours for p in peers) + " |",
             "| --- " * (1 + len(columns) + len(ours) * len(peers)) + "|"]
    for label, workload, get in ROWS:
        results = {n: load(out, n, workload) for n in columns}
        if not any(results.values()):
            continue
        values = {n: get(r) if r else math.nan for n, r in results.items()}
        lines.append(f"| {label} | " + " | ".join(f"{values[n]:.1f}" for n in columns) + " | "
                     + " | ".join(f"{values[o] / values[p]:.2f}" for o in ours for p in peers) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    out = Path((argv if argv is not None else sys.argv[1:])[0])
    table = summary(out)
    (out / "summary.md").write_text(table)
    print(table, end="")


if __name__ == "__main__":
    main()
