"""Each benchmark runs on a small setting and writes well-formed JSON and a PNG. No timings are
asserted: those belong to BENCHMARKS.md."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from cli.main import app
from engine.cpu import build


def invoke(args: list[str]) -> None:
    result = CliRunner().invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output


def is_png(path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_stall_writes_three_runs(tmp_path):
    out, png = tmp_path / "stall.json", tmp_path / "stall.png"
    invoke(["bench", "stall", "--model", "tiny", "--dtype", "float32", "--chats", "2", "--images", "1",
            "--budget", "16", "--after-steps", "2", "--no-prefix-caching", "--json", str(out), "--png", str(png)])
    result = json.loads(out.read_text())
    assert result["config"]["prefix_caching"] is False
    assert set(result["runs"]) == {"chunked", "unchunked", "chunked_no_encoder_budget"}
    for run in result["runs"].values():
        assert set(run["itl_ms"]) == {"p50", "p99", "max"}
        assert run["ttft_ms"] > 0 and run["throughput_tok_s"] > 0 and run["steps"] >= 1
    # One oversized step without chunking; several budget-sized steps with it.
    assert result["runs"]["unchunked"]["steps"] == 1
    assert result["runs"]["chunked"]["steps"] > 1
    assert result["runs"]["chunked"]["max_step_tokens"] <= 16 < result["runs"]["unchunked"]["max_step_tokens"]
    assert is_png(png)


def test_bench_peers_compares_three_systems(tmp_path):
    out, png = tmp_path / "peers.json", tmp_path / "peers.png"
    invoke(["bench", "peers", "--model", "tiny", "--dtype", "float32", "--requests", "3", "--input-len", "16",
            "--output-len", "4", "--hf-batch-size", "2", "--json", str(out), "--png", str(png)])
    result = json.loads(out.read_text())
    assert set(result["results"]) == {"engine", "hf_generate", "hf_generate_batch"}
    for peer in result["results"].values():
        assert peer["output_tok_s"] > 0
        assert 0 < peer["latency_ms"]["p50"] <= peer["latency_ms"]["p99"]
    assert set(result["ratios"]) == {"engine_vs_hf_generate", "engine_vs_hf_generate_batch"}
    roof = result["roofline"]
    assert roof["weight_bytes_per_decode_step"] > 0 and math.isfinite(roof["decode_step_floor_ms"])
    assert is_png(png)


def test_bench_prefix_runs_as_python_m_bench_without_fastapi_or_redis(tmp_path):
    """`python -m bench prefix` with fastapi and redis unimportable: with caching, turns 2-4 compute fewer
    tokens and run no vision tower; float32 tokens are those of the run without caching."""
    out, png = tmp_path / "prefix.json", tmp_path / "prefix.png"
    script = ("import runpy, sys\n"
              "sys.modules.update(fastapi=None, redis=None, uvicorn=None)\n"  # importing them now raises
              "runpy.run_module('bench', run_name='__main__')\n")
    argv = ["prefix", "--model", "tiny", "--dtype", "float32", "--max-tokens", "4", "--json", str(out),
            "--png", str(png)]
    done = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "TTFT" in done.stdout
    runs = json.loads(out.read_text())["runs"]
    on, off = runs["caching"], runs["no_caching"]
    assert len(on) == len(off) == 4
    assert [t["prompt_tokens"] for t in on] == [t["prompt_tokens"] for t in off]
    assert on[0]["cached_tokens"] == 0 and on[0]["encoder_inputs_run"] > 0
    for cached, plain in zip(on[1:], off[1:], strict=True):
        assert 0 < cached["computed_tokens"] < plain["computed_tokens"] == plain["prompt_tokens"]
        assert cached["encoder_inputs_run"] == 0 < plain["encoder_inputs_run"]
    assert all(t["same_tokens_as_no_caching"] for t in on)
    assert is_png(png)


def test_bench_pipeline_times_each_stage_on_real_redis(tmp_path, redis_url, people_fall_weights):
    out, png = tmp_path / "pipeline.json", tmp_path / "pipeline.png"
    invoke(["bench", "pipeline", "--detector", "people-fall", "--detector", "hog", "--redis-url", redis_url,
            "--token-model", "tiny", "--json", str(out), "--png", str(png)])
    results = json.loads(out.read_text())["results"]
    for result in results.values():
        assert result["frames"] == 60 and result["fps"] > 0
        assert set(result["stage_ms_per_frame"]) == {"capture", "detect", "gate", "enqueue"}
    hog, trained = results["hog"], results["people-fall"]
    assert hog["jobs"] >= 1  # the sample video has people, and HOG finds those of bus.jpg
    # The trained detector finds the people of the three scenes that have some (10 frames each, a new
    # track reported from its second frame) and the one lying on the ground.
    assert 27 <= trained["frames_with_people"] <= 30 and trained["falls"] == 1
    # Events: one per track of the 12 s video, each a few frames whose prompt expands to image tokens.
    assert trained["events"] >= 3 and trained["events_per_minute"] == trained["events"] * 5
    assert 1 <= trained["frames_per_event"] <= 6 and trained["image_tokens_per_event"] > 0
    assert is_png(png)


def test_bench_serve_loads_a_real_server_with_chats_and_captions(tmp_path):
    from api.background import BackgroundServer
    from api.server import create_app
    from api.settings import ServerSettings
    from engine import EngineConfig

    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    settings = ServerSettings(engine=EngineConfig(model="tiny", max_num_batched_tokens=256), api_key="bench-key")
    with BackgroundServer(create_app(settings)) as server:
        invoke(["bench", "serve", "--url", server.url, "--api-key", "bench-key", "--num-requests", "8",
                "--rate", "20", "--image-fraction", "0.5", "--max-tokens", "6", "--slo", "ttft=600000,itl=600000",
                "--json", str(out), "--png", str(png)])
    result = json.loads(out.read_text())
    assert result["requests"]["sent"] == result["requests"]["completed"] == 8, result["errors"]
    assert 0 < result["requests"]["image"] < 8
    assert result["goodput"] == result["request_throughput"] > 0  # SLOs no request can miss
    # ignore_eos is sent: every request streams exactly max_tokens tokens, whatever the random model picks.
    assert round(result["output_token_throughput"] * result["duration_s"]) == 8 * 6
    for metric in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        assert result[metric]["p50"] <= result[metric]["p99"]
    assert result["output_token_throughput"] > 0
    assert is_png(png)


def test_bench_serve_rejects_a_malformed_slo():
    from bench.serve import parse_slo

    assert parse_slo("ttft=500,itl=50") == {"ttft": 500.0, "itl": 50.0}
    with pytest.raises(ValueError, match="latency=5"):
        parse_slo("latency=5")


def test_bench_sampler_times_each_case_on_both_paths(tmp_path):
    out = tmp_path / "sampler.json"
    invoke(["bench", "sampler", "--rows", "3", "--vocab", "500", "--history", "20", "--calls", "2", "--threads", "1",
            "--json", str(out), "--png", str(tmp_path / "sampler.png")])
    result = json.loads(out.read_text())
    cases = {case["case"]: case for case in result["cases"]}
    assert list(cases)[:3] == ["greedy", "temperature 1", "Ollama's defaults"] and len(cases) == 6
    assert result["kernel_build"] is not None  # this machine compiles the kernels
    for case in cases.values():
        assert case["kernel_ms_median"] > 0 and case["torch_ms_median"] > 0 and len(case["kernel_ms"]) == 2
    nuclei = [cases[name]["nucleus"] for name in ("top_p 0.9, peaked", "top_p 0.9, spread", "top_p 0.9, flat")]
    assert 1 <= nuclei[0] < nuclei[1] < nuclei[2] <= 500
    assert (tmp_path / "sampler.png").stat().st_size > 0


def test_bench_host_splits_a_step_into_phases_and_counts_ops(tmp_path):
    out, png = tmp_path / "host.json", tmp_path / "host.png"
    invoke(["bench", "host", "--model", "tiny", "--decodes", "3", "--context", "24", "--later", "4", "--steps", "2",
            "--threads", "1", "--json", str(out), "--png", str(png)])
    result = json.loads(out.read_text())
    assert result["context_late"] >= result["context_early"] + 4
    for point in ("early", "late"):
        phases = result[point]["phases_ms_median"]
        assert set(phases) == {"schedule", "encode", "prepare", "forward", "sample", "detokenize", "rest"}
        assert phases["forward"] > 0 and phases["detokenize"] > 0 and phases["schedule"] > 0
    ops = result["ops"]
    assert ops["aten_ops_per_step"] > 10 and ops["top_ops_per_step"]
    assert ops["readbacks_per_step"] >= 1  # the sampled tokens are read back at least once a step
    assert result["bare_static_cache"]["early_ms_median"] > 0
    assert math.isfinite(result["ratios"]["engine_vs_bare_early"])
    floor = result["read_floor"]  # what a step must read: the text model's weights once, every context's keys
    assert floor["bandwidth_gb_s"] > 0.1 and floor["weights_mb"] > 0 and floor["kv_mb_late"] > floor["kv_mb_early"] > 0
    reads = floor["reads_gb_s"]  # the fastest of three reads, the engine's own kernel's among them
    assert set(reads) == {"sum", "row_product", "kernel"} and floor["bandwidth_gb_s"] == max(reads.values())
    assert result["ratios"]["engine_vs_floor_early"] > 0
    assert result["engine"]["cpu_kernels"] in build.VARIANTS
    assert result["engine"]["lean_layers"] == 2
    memory = result["memory"]  # on the CPU also what of it maps files (libraries' pages), and the ratio without it
    assert memory["weights_mb"] > 0 and memory["file_backed_mb"] >= 0
    assert memory["besides_kv_and_files_vs_weights"] * memory["weights_mb"] == pytest.approx(
        memory["besides_kv_mb"] - memory["file_backed_mb"])
    vision = result["vision"]  # the tiny SmolVLM's tower, one photo as one input, lean and stock
    assert vision["lean_layers"] == 2 and vision["input_rows"] > 0
    assert vision["engine_ms_per_input"] > 0 and vision["stock_ms_per_input"] > 0
    assert is_png(png)


def test_the_bare_forward_stays_at_its_position_for_more_steps_than_its_context():
    """transformers' bare forward takes every step at the one position it is given, however many steps: its
    StaticCache (whose layers count what they wrote) does not overflow after context + 1 of them."""
    from bench.host import bare_forward_ms
    from engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model="tiny", max_num_seqs=2))
    try:
        times = bare_forward_ms(engine, decodes=2, context=4, steps=8, warmup=1)
    finally:
        engine.close()
    assert len(times) == 8 and all(t > 0 for t in times)


def test_bench_stall_over_http_measures_a_real_server(tmp_path):
    from api.background import BackgroundServer
    from api.server import create_app
    from api.settings import ServerSettings
    from engine import EngineConfig

    out, png = tmp_path / "stall-http.json", tmp_path / "stall-http.png"
    settings = ServerSettings(engine=EngineConfig(model="tiny", max_num_batched_tokens=16, max_num_seqs=4),
                              api_key="bench-key")
    with BackgroundServer(create_app(settings)) as server:
        invoke(["bench", "stall", "--url", server.url, "--api-key", "bench-key", "--chats", "2", "--images", "1",
                "--after-steps", "3", "--json", str(out), "--png", str(png)])
    (run,) = json.loads(out.read_text())["runs"].values()
    # The image prompt (5 tiles of 16 tokens) takes several 16-token steps, and the chats stream meanwhile.
    assert run["ttft_ms"] > 0 and run["chat_tok_s_in_window"] > 0
    assert 0 < run["itl_ms"]["p50"] <= run["worst_gap_ms"] == run["itl_ms"]["max"]
    assert all(len(stream) >= 16 + 3 for stream in run["timeline"]["streams"])
    assert is_png(png)


def test_bench_overhead_runs_the_same_chats_directly_and_through_a_server_process(tmp_path):
    out, png = tmp_path / "overhead.json", tmp_path / "overhead.png"
    invoke(["bench", "overhead", "--model", "tiny", "--dtype", "float32", "--chats", "2", "--max-tokens", "5",
            "--threads", "1", "--json", str(out), "--png", str(png)])
    result = json.loads(out.read_text())
    # ignore_eos on both sides: the same number of tokens, whatever the random model picks.
    assert result["direct"]["tokens"] == result["http"]["tokens"] == 2 * 5
    for side in ("direct", "http"):
        assert result[side]["output_tok_s"] > 0 and result[side]["itl_ms"]["p50"] > 0
    assert math.isfinite(result["ratios"]["http_vs_direct_tok_s"])
    assert is_png(png)


@pytest.mark.timeout(600)
def test_bench_soak_short_run_holds(tmp_path):
    """A short soak with hostile inputs mixed in: no 5xx, good requests 2xx, every good job done and every
    bad one dead-lettered once, none lost or captioned twice. (Memory and ITL are reported, not asserted.)"""
    out, png = tmp_path / "soak.json", tmp_path / "soak.png"
    invoke(["bench", "soak", "--duration", "8", "--warmup", "2", "--chats", "2", "--caption-rate", "1",
            "--job-rate", "2", "--hostile-fraction", "0.4", "--max-tokens", "4", "--probe-rounds", "1",
            "--json", str(out), "--png", str(png)])
    result = json.loads(out.read_text())
    assert result["good_requests"] > 0 and result["hostile_requests"] > 0
    assert (result["good_not_2xx"], result["hostile_5xx"], result["no_answer"]) == (0, 0, 0), result["requests"]
    jobs = result["jobs"]
    assert jobs["good_jobs"] > 0 and jobs["good_done"] == jobs["good_jobs"]
    assert jobs["bad_dead"] == jobs["bad_failed"] == jobs["bad_jobs"]
    assert jobs["lost"] == jobs["captioned_twice"] == jobs["dead_lettered_twice"] == 0
    assert result["engine_step_failures"] == 0 and result["ready_after"] == 200
    assert result["memory_mib"]["start"] > 0 and result["chat_tokens"] > 0
    # A plain chat and a fall alert alone, then with the hostile burst in flight: every probe answered, the figures
    # reported (the times themselves are the benchmark's, not asserted); the burst's jobs ended, its answers counted.
    latency = result["latency"]
    assert latency["rounds"] == 1 and latency["rounds_not_drained"] == 0
    for probe in ("chat", "fall_alert"):
        figures = latency[probe]
        assert figures["unanswered"] == 0 and len(figures["hostile_s"]) == len(figures["alone_s"]) >= 1
        assert figures["ratio"] == figures["hostile_median_s"] / figures["alone_median_s"]
    assert jobs["heavy_jobs"] == jobs["heavy_ended"] == latency["burst"]["heavy_job"]
    assert {"hostile:burst_sdp_video", "hostile:burst_slow_client_headers"} <= set(result["requests"])
    assert is_png(png)


def test_bench_linear_int8_times_the_products_from_memory_and_from_the_cache():
    """`python -m bench.linear_int8` on the tiny preset: both weight dtypes, the pass from memory and the layers'
    pass with one layer's weights in every place (the arithmetic's own time)."""
    from bench import linear_int8

    result = linear_int8.main(["--preset", "tiny", "--rows", "2", "--threads", "1", "--repeats", "1"])
    for key in ("layers_ms", "layers_in_cache_ms"):
        assert set(result[key]) == {"bf16", "int8"} and all(ms > 0 for ms in result[key].values())
    assert result["int8_gmac_s_in_cache"] > 0 and 0 < result["layers_int8_floor_ms"] < result["int8_floor_ms"]


def test_bench_vision_parts_times_a_lean_vision_layer_part_by_part(tmp_path):
    """`python -m bench.vision_parts` on the tiny preset, bfloat16 and int8 weights: every part of a lean encoder
    layer timed, the tile's cost their sum over the lean layers, each product's rate, the JSON written; a tile count
    out of range is refused, naming it."""
    from bench import vision_parts

    for quantization in ([], ["--quantization", "int8"]):
        out = tmp_path / f"parts{len(quantization)}.json"
        result = vision_parts.main(["--model", "tiny", "--tiles", "1", "--threads", "1", "--repeats", "1",
                                    "--json", str(out), *quantization])
        assert set(result["parts_ms"]) == {"norm_qkv", "attention", "out_residual", "norm_fc1_gelu", "fc2_residual"}
        assert all(ms > 0 for ms in result["parts_ms"].values()) and result["lean_layers"] > 0
        assert result["tile_ms"] == pytest.approx(result["layer_ms"] * result["lean_layers"])
        assert set(result["product_gmac_s"]) == {"qkv", "out", "fc1", "fc2"}
        assert all(rate > 0 for rate in result["product_gmac_s"].values())
        assert json.loads(out.read_text())["quantization"] == (quantization[1] if quantization else None)
    with pytest.raises(ValueError, match="got 0 and 5"):
        vision_parts.main(["--model", "tiny", "--tiles", "0"])


def test_bench_linear_ab_times_this_trees_kernel_against_another_library():
    """`python -m bench.linear_ab OTHER.so`: here OTHER is this tree's own build (the same library), so each shape
    and row count has both times and their ratio; a shape that is not NxK is refused, naming it."""
    from bench import linear_ab
    from engine.cpu import build

    other = build.compile_variant(build.variant())
    results = linear_ab.main([str(other), "--shapes", "64x32,96x64", "--rows", "1,17", "--threads", "1"])
    assert [(r["n"], r["k"], r["rows"]) for r in results] == [(64, 32, 1), (64, 32, 17), (96, 64, 1), (96, 64, 17)]
    assert all(r["other_ms"] > 0 and r["this_ms"] > 0 and r["ratio"] == r["this_ms"] / r["other_ms"] for r in results)
    quantized = linear_ab.main([str(other), "--shapes", "64x64", "--rows", "2", "--threads", "1", "--int8"])
    assert len(quantized) == 1 and quantized[0]["this_ms"] > 0 and quantized[0]["other_ms"] > 0
    gated = linear_ab.main([str(other), "--shapes", "64x64", "--rows", "2", "--threads", "1", "--int8",
                            "--glu", "silu"])
    assert len(gated) == 1 and gated[0]["this_ms"] > 0
    with pytest.raises(ValueError, match="'64by32'"):
        linear_ab.parse_shapes("64by32")
    with pytest.raises(ValueError, match="an even n .* got \\[\\(63, 64\\)\\]"):
        linear_ab.main([str(other), "--shapes", "63x64", "--rows", "2", "--glu", "silu"])
    with pytest.raises(ValueError, match="glu is one of .* got 'relu'"):
        linear_ab.main([str(other), "--shapes", "64x64", "--rows", "2", "--glu", "relu"])


def test_bench_step_ab_times_a_decode_step_with_each_library():
    """`python -m bench.step_ab OTHER.so`: here OTHER is this tree's own build, so both engines' steps are timed
    and each round gives a ratio, and with `--tiles` a vision tile's encoding; a count out of range is refused,
    naming it."""
    from bench import step_ab
    from engine.cpu import build

    other = str(build.compile_variant(build.variant()))
    chosen = build.lib
    result = step_ab.main([other, "--model", "tiny", "--decodes", "2", "--context", "12", "--rounds", "3",
                           "--steps", "2", "--threads", "1"])
    assert result["this_ms"] > 0 and result["other_ms"] > 0 and result["rounds"] == 3
    assert 0 < result["ratio_q1"] <= result["ratio_median"] <= result["ratio_q3"]
    assert build.lib is chosen  # the process's kernels are its own again
    with pytest.raises(ValueError, match="rounds 0"):
        step_ab.main([other, "--model", "tiny", "--rounds", "0"])
    tiles = step_ab.main([other, "--model", "tiny", "--tiles", "2", "--rounds", "2", "--steps", "1", "--threads", "1"])
    assert tiles["this_ms"] > 0 and tiles["other_ms"] > 0 and tiles["rounds"] == 2  # a tile's encoding, each library
    assert build.lib is chosen
    with pytest.raises(ValueError, match="tiles -1"):
        step_ab.main([other, "--model", "tiny", "--tiles", "-1"])


def test_stream_lines_split_where_sse_ends_a_line_only():
    """A peer may leave NEL, LINE SEPARATOR and PARAGRAPH SEPARATOR as they are in its events' JSON: the bench's
    clients read each event whole (httpx's aiter_lines cuts it there), whatever chunks the body arrives in (a CRLF
    or a character's UTF-8 bytes split across two: chunks of 1 to 7 bytes)."""
    import asyncio

    import httpx

    from bench.report import stream_lines

    events = [{"choices": [{"delta": {"content": "a\u2028b\x85c\u2029d"}}]}, {"choices": []}]
    body = "".join(f"data: {json.dumps(e, ensure_ascii=False)}\r\n\r\n" for e in events).encode() + b"data: [DONE]"

    async def read(lines_of, size: int) -> list[str]:
        class Chunks(httpx.AsyncByteStream):  # the body `size` bytes at a time, as a network may deliver it
            async def __aiter__(self):
                for at in range(0, len(body), size):
                    yield body[at : at + size]

        transport = httpx.MockTransport(lambda request: httpx.Response(200, stream=Chunks()))
        async with httpx.AsyncClient(transport=transport) as client, client.stream("GET", "http://peer/") as response:
            return [line async for line in lines_of(response)]

    for size in range(1, 8):
        lines = asyncio.run(read(stream_lines, size))
        assert [json.loads(line[6:]) for line in lines if line.startswith("data: {")] == events, size
        assert lines[1] == lines[3] == "" and lines[4:] == ["data: [DONE]"], size  # each CRLF one line's end
    cut = asyncio.run(read(lambda response: response.aiter_lines(), 7))  # what the helper avoids
    assert len(cut) > len(lines) and cut[0].startswith("data: {") and not cut[0].endswith("}")


def test_side_by_side_summary_reads_each_servers_workloads_and_vllm_bench_tables(tmp_path):
    """bench/peers_side_by_side.sh's summary: a server per results file (the workloads' JSON or `vllm bench serve`'s
    table alone, as VBENCH_ONLY leaves), a row per workload some server ran, each vlmcap server over each peer."""
    from bench.side_by_side import main, summary

    def vbench(duration: float, mean: float, median: float, p99_itl: float) -> str:
        return "\n".join([
            "Namespace(seed=11, base_url='http://127.0.0.1:8799', random_mm_bucket_config={(256, 256, 1): 1.0})",
            "============ Serving Benchmark Result ============", "Successful requests:                     16",
            f"Benchmark duration (s):                  {duration}", f"Mean TTFT (ms):    {mean}",
            f"Median TTFT (ms):   {median}", f"P99 ITL (ms):   {p99_itl}", "=" * 50])

    (tmp_path / "vllm-chats8.json").write_text(json.dumps({"itl_ms": {"p50": 40.0}}))
    (tmp_path / "vlmcap-chats8.json").write_text(json.dumps({"itl_ms": {"p50": 20.0}}))
    (tmp_path / "vllm-vbench-random-mm.txt").write_text(vbench(100.0, 18000.0, 8000.0, 5000.0))
    (tmp_path / "vlmcap-itl1000-vbench-random-mm.txt").write_text(vbench(70.0, 19000.0, 18000.0, 600.0))
    table = summary(tmp_path).splitlines()
    assert table[0] == ("| workload | vllm | vlmcap | vlmcap-itl1000 | vlmcap / vllm | vlmcap-itl1000 / vllm |")
    assert table[2] == "| 8 chats: ITL p50 (ms) | 40.0 | 20.0 | nan | 0.50 | nan |"
    assert "| random-mm: duration (s) | 100.0 | nan | 70.0 | nan | 0.70 |" in table
    assert "| random-mm: median TTFT (s) | 8.0 | nan | 18.0 | nan | 2.25 |" in table
    assert "| random-mm: P99 ITL (ms) | 5000.0 | nan | 600.0 | nan | 0.12 |" in table
    assert not any("stall" in line or "text requests" in line for line in table)  # no server ran them
    main([str(tmp_path)])
    assert (tmp_path / "summary.md").read_text() == summary(tmp_path)


def test_listens_names_the_process_that_holds_a_port():
    """`bench.report.listens`: this process holds the listening socket it opened, another process does not, and
    nobody once it is closed."""
    import os
    import socket

    from bench.report import listens

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert listens(os.getpid(), port)
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            assert not listens(other.pid, port)
        finally:
            other.kill()
            other.wait()
    assert not listens(os.getpid(), port)


def test_the_soak_s_server_is_its_own_even_when_another_takes_its_port(tmp_path, monkeypatch):
    """The port the soak picks for its server can go to another process before the server binds it: a foreign
    HTTP server that answers /ready with 200 holds the first port picked; the soak does not take it for its own
    (its server, unable to bind, exits saying why) and starts it again on the next port, where it is its own."""
    import http.server
    import tempfile
    import threading

    import jobqueue.connection as connection
    from bench import soak
    from bench.configs import SoakConfig
    from bench.report import listens

    class Ready(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    foreign = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ready)
    threading.Thread(target=foreign.serve_forever, daemon=True).start()
    redis_server = connection.EmbeddedRedis()  # before the ports are fixed: it picks its own
    taken, free = foreign.server_address[1], connection.free_tcp_port()
    ports = iter([taken, free])
    monkeypatch.setattr(connection, "free_tcp_port", lambda: next(ports))
    log = tempfile.TemporaryFile("w+")
    server = None
    try:
        server, url = soak._start_server(SoakConfig(), redis_server.url, "http://127.0.0.1:9/alerts", log,
                                         str(tmp_path))
        assert url.endswith(f":{free}") and listens(server.pid, free)
        assert "address already in use" in soak._tail(log, 100_000).lower()
    finally:
        if server is not None:
            soak._stop(server)
        foreign.shutdown()
        redis_server.close()
        log.close()
