"""Videos through the engine: greedy tokens equal transformers' `generate` on the same processor output for
Qwen2-VL's native video path (temporal patches, M-RoPE over time) and SmolVLM's timestamped frames, at
budgets that cut the video's span at odd offsets; a second turn over the same video reuses its cached
blocks without running the encoder again; files are sampled with OpenCV under their limits; a family
without a video path refuses videos by name."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.presets import PRESETS, build_checkpoint
from engine.video import Video, VideoLimitError, VideoSampling, frames_video, read_video
from tests.engine.conftest import DEVICE
from tests.video_support import clip_frames, write_mp4

VIDEO_FAMILIES = ["tiny", "tiny-qwen2-vl"]


@pytest.fixture(scope="session")
def video_checkpoints(tmp_path_factory) -> Callable[[str], str]:
    built: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in built:
            built[name] = str(build_checkpoint(PRESETS[name], tmp_path_factory.mktemp(f"video-{name}")))
        return built[name]

    return get


@pytest.fixture(scope="session")
def clip(photos) -> Video:
    """8 frames of 96x64 px at 2 fps: 4 temporal patches of 24 tokens for tiny-qwen2-vl, 8 frames of 16
    tokens for tiny SmolVLM; a clip whose positions and timestamps decide tokens (see the last test)."""
    return Video(np.stack(clip_frames(photos[0], count=8, size=(96, 64))), fps=2.0)


def video_oracle(checkpoint: str) -> Callable[[str, Video | list[Video], int], list[int]]:
    """transformers' `generate` on the processor's own output for a prompt with one video (or several, in order)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(checkpoint)
    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).to(DEVICE).eval()

    def generate(prompt: str, video: Video | list[Video], max_tokens: int) -> list[int]:
        videos = video if isinstance(video, list) else [video]
        inputs = processor(text=[prompt], videos=[[v.frames for v in videos]],
                           video_metadata=[[v.metadata() for v in videos]], do_sample_frames=False,
                           return_tensors="pt").to(DEVICE)  # nested: one prompt's videos, as every version reads
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
        return out[0, inputs["input_ids"].shape[1] :].tolist()

    return generate


def user_turn(text: str, video: bool = True) -> dict:
    return {"role": "user", "content": [{"type": "video"}] * video + [{"type": "text", "text": text}]}


def engine_for(checkpoint: str, **settings) -> Engine:
    return Engine(EngineConfig(model=checkpoint, device=DEVICE, dtype="float32", **settings))


def run(engine: Engine, requests: list[dict]) -> dict[str, list[int]]:
    """Add the requests (keyword arguments of `add_request`), the second one step after the first, and step
    until all finish; returns each one's tokens and the prompt positions computed after each step."""
    ids = []
    tokens: dict[str, list[int]] = {}
    pending = list(requests)
    while pending or engine.has_unfinished_requests():
        if pending:
            ids.append(engine.add_request(**pending.pop(0)))
        for out in engine.step():
            tokens[out.request_id] = out.token_ids
    return {rid: tokens[rid] for rid in ids}


# (step budget, encoder settings): at 13 the encoder runs one input of 16 rows a step, SmolVLM's frames two
# slices of the tower a step (Qwen2-VL's tower runs whole).
BUDGETS = [(7, {}), (13, {"max_encoder_tokens_per_step": 16, "encoder_slices_per_step": 2}), (64, {})]


@pytest.mark.parametrize(("budget", "encoder"), BUDGETS, ids=[str(b) for b, _ in BUDGETS])
@pytest.mark.parametrize("name", VIDEO_FAMILIES)
def test_video_tokens_equal_generate_at_budgets_that_cut_the_video(video_checkpoints, clip, name, budget, encoder):
    checkpoint = video_checkpoints(name)
    engine = engine_for(checkpoint, max_num_batched_tokens=budget, max_num_seqs=4, **encoder)
    video_turn = [user_turn("What happens in the clip?")]
    prompt = engine.adapter.render_messages(video_turn)
    rid = engine.add_request(messages=video_turn, videos=[clip], sampling=SamplingParams(max_tokens=10))
    chat = engine.add_request(messages=[user_turn("Say something short.", video=False)],
                              sampling=SamplingParams(max_tokens=6))
    request = engine.requests[rid]
    mm = request.mm
    placeholders = set(mm.placeholder_positions)
    cuts, tokens, slices = [], {}, [0]
    while engine.has_unfinished_requests():
        outputs = engine.step()
        tokens.update({o.request_id: o.token_ids for o in outputs})
        if request.num_computed_tokens < request.num_prompt_tokens:
            cuts.append(request.num_computed_tokens)
        assert engine.stats().last_step_num_tokens <= budget
        slices.append(engine.stats().encoder_slices_run)
    assert tokens[rid] == video_oracle(checkpoint)(prompt, clip, 10), f"{name} at budget {budget}"
    assert len(tokens[chat]) == 6
    # The video's span was cut inside an encoder input's rows (odd budgets) or between two of them.
    inside = [c for c in cuts if c in placeholders and c - 1 in placeholders]
    assert inside or budget == 64
    frames_per_input = 2 if name == "tiny-qwen2-vl" else 1  # a temporal patch, or one frame
    assert mm.num_inputs == -(-clip.num_frames // frames_per_input)
    assert engine.stats().encoder_inputs_encoded == mm.num_inputs
    if encoder and name == "tiny":  # each frame's tower ran two slices a step, over several steps
        assert max(b - a for a, b in zip(slices, slices[1:])) < mm.encoder_slices
    assert engine.stats().kv_blocks_used == 0


@pytest.mark.parametrize(("slices", "lean"), [(None, None), (1, None), (None, False)])
@pytest.mark.parametrize("name", ["tiny-qwen2.5-vl", "tiny-llava-onevision"])
def test_the_other_video_families_equal_generate(video_checkpoints, clip, name, slices, lean):
    """Qwen2.5-VL (windowed tower, temporal positions spaced by the frame rate) and LLaVA-OneVision (the whole clip
    one encoder input: pooled frames, then the newline row; its tower also a slice a step), at a budget that cuts
    the clip's span; also with stock layers, whose tower runs whole through transformers' own feature methods (as
    on a GPU)."""
    checkpoint = video_checkpoints(name)
    engine = engine_for(checkpoint, max_num_batched_tokens=11, max_num_seqs=4, encoder_slices_per_step=slices,
                        lean_layers=lean)
    turn = [user_turn("What happens in the clip?")]
    tokens = run(engine, [dict(messages=turn, videos=[clip], sampling=SamplingParams(max_tokens=10))])
    assert list(tokens.values()) == [video_oracle(checkpoint)(engine.adapter.render_messages(turn), clip, 10)]
    assert engine.stats().encoder_inputs_encoded == (1 if name == "tiny-llava-onevision" else clip.num_frames // 2)


@pytest.mark.parametrize("name", VIDEO_FAMILIES)
def test_two_videos_in_one_prompt_equal_generate(video_checkpoints, clip, photos, name):
    """Two videos of different lengths in one turn (the documented limit): each video's own frames fill its span
    (the processor pads the shorter one with frames transformers drops), at a budget that cuts the spans."""
    checkpoint = video_checkpoints(name)
    other = Video(np.stack(clip_frames(photos[1], count=4, size=(96, 64))), fps=1.0)
    engine = engine_for(checkpoint, max_num_batched_tokens=13, max_num_seqs=4)
    turn = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "and"}, {"type": "video"},
                                         {"type": "text", "text": "What changed between the clips?"}]}]
    prompt = engine.adapter.render_messages(turn)
    tokens = run(engine, [dict(messages=turn, videos=[clip, other], sampling=SamplingParams(max_tokens=10))])
    assert list(tokens.values()) == [video_oracle(checkpoint)(prompt, [clip, other], 10)]
    frames_per_input = 2 if name == "tiny-qwen2-vl" else 1
    assert engine.stats().encoder_inputs_encoded == (clip.num_frames + other.num_frames) // frames_per_input
    # The order matters: the videos swapped give another prompt, which the engine follows as generate does.
    swapped = run(engine, [dict(messages=turn, videos=[other, clip], sampling=SamplingParams(max_tokens=10))])
    assert list(swapped.values()) == [video_oracle(checkpoint)(prompt, [other, clip], 10)]


@pytest.mark.parametrize("name", VIDEO_FAMILIES)
def test_video_prompts_equal_generate_under_preemption(video_checkpoints, clip, photos, name):
    """Two video prompts and a chat in a KV cache too small for all three to grow: one is preempted and
    recomputed (its video encoded again or taken from the encoder cache), and every one equals generate."""
    checkpoint = video_checkpoints(name)
    other = Video(np.stack(clip_frames(photos[1], count=8, size=(96, 64))), fps=2.0)
    turn = [user_turn("What happens in the clip?")]
    probe = engine_for(checkpoint)
    prompt = probe.adapter.render_messages(turn)
    longest = max(len(probe.adapter.process(prompt, [], [video])[0]) for video in (clip, other))
    num_blocks = 2 * -(-longest // 16) + 1  # room for both prompts, not for both to grow by 40 tokens
    engine = engine_for(checkpoint, max_num_batched_tokens=13, max_num_seqs=4, num_kv_blocks=num_blocks, block_size=16)
    requests = [dict(messages=turn, videos=[video], sampling=SamplingParams(max_tokens=40)) for video in (clip, other)]
    requests.append(dict(messages=[user_turn("Say something short.", video=False)],
                         sampling=SamplingParams(max_tokens=40)))
    tokens = list(run(engine, requests).values())
    assert engine.stats().num_preemptions > 0
    oracle = video_oracle(checkpoint)
    assert tokens[:2] == [oracle(prompt, clip, 40), oracle(prompt, other, 40)]
    assert engine.stats().kv_blocks_used == 0


def test_a_frame_rate_sets_qwen2_5_vl_positions_and_is_part_of_the_cache_key(video_checkpoints, clip):
    """Qwen2.5-VL spaces a video's temporal positions by its frame rate: the same frames at another rate are
    another prompt (no cached block of the video reused), each equal to generate, also where the temporal
    positions run past the text after the video (0.5 fps)."""
    checkpoint = video_checkpoints("tiny-qwen2.5-vl")
    engine = engine_for(checkpoint, max_num_batched_tokens=32, max_num_seqs=4, block_size=16)
    turn = [user_turn("What happens in the clip?")]
    prompt = engine.adapter.render_messages(turn)
    first_video_block = engine.adapter.process(prompt, [], [clip])[1].placeholder_positions[0] // 16
    for fps in (2.0, 0.5, 2.0):
        video = Video(clip.frames, fps)
        rid = engine.add_request(messages=turn, videos=[video], sampling=SamplingParams(max_tokens=10))
        outputs = {}
        while engine.has_unfinished_requests():
            outputs.update({o.request_id: o for o in engine.step()})
        assert outputs[rid].token_ids == video_oracle(checkpoint)(prompt, video, 10), f"{fps} fps"
        if fps == 0.5:  # only the text before the video came from the cache
            assert outputs[rid].num_cached_tokens <= first_video_block * 16
    assert outputs[rid].num_cached_tokens > first_video_block * 16 + 16  # 2 fps again: its blocks are found


@pytest.mark.parametrize("name", VIDEO_FAMILIES)
def test_a_second_turn_over_the_same_video_reuses_its_blocks_without_encoding_again(video_checkpoints, clip, name):
    checkpoint = video_checkpoints(name)
    engine = engine_for(checkpoint, max_num_batched_tokens=32, max_num_seqs=4, block_size=16)
    first = [user_turn("What happens in the clip?")]
    answer = run(engine, [dict(messages=first, videos=[clip], sampling=SamplingParams(max_tokens=6))])
    encoded = engine.stats().encoder_inputs_encoded
    reply = engine.tokenizer.decode(next(iter(answer.values())), skip_special_tokens=True)
    second = [*first, {"role": "assistant", "content": [{"type": "text", "text": reply}]},
              user_turn("And then?", video=False)]
    rid = engine.add_request(messages=second, videos=[clip], sampling=SamplingParams(max_tokens=6))
    request = engine.requests[rid]
    last_placeholder = request.mm.placeholder_positions[-1]
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step()})
    assert engine.stats().encoder_inputs_encoded == encoded  # nothing of the video was encoded again
    # Every full block up to the video's last placeholder came from the prefix cache.
    assert outputs[rid].num_cached_tokens >= (last_placeholder // 16) * 16 > 0
    prompt = engine.adapter.render_messages(second)
    assert outputs[rid].token_ids == video_oracle(checkpoint)(prompt, clip, 6)


@pytest.mark.parametrize("name", VIDEO_FAMILIES)
def test_the_comparison_can_fail_positions_and_timestamps_decide_tokens(video_checkpoints, clip, name, monkeypatch):
    """With token-index positions instead of M-RoPE over time (Qwen2-VL), or the frames' timestamps of
    another frame rate (SmolVLM), the tokens differ from those the tests above compare with `generate`."""
    checkpoint = video_checkpoints(name)
    engine = engine_for(checkpoint, enable_prefix_caching=False)
    turn = [user_turn("What happens in the clip?")]
    expected = video_oracle(checkpoint)(engine.adapter.render_messages(turn), clip, 10)
    sampling = SamplingParams(max_tokens=10)
    assert list(run(engine, [dict(messages=turn, videos=[clip], sampling=sampling)]).values()) == [expected]
    if name == "tiny-qwen2-vl":
        monkeypatch.setattr(engine.adapter, "rope_positions", lambda request, start, end: [range(start, end)] * 3)
        changed = clip
    else:
        changed = Video(clip.frames, fps=1.0)
    assert list(run(engine, [dict(messages=turn, videos=[changed], sampling=sampling)]).values()) != [expected]


def test_a_file_is_sampled_evenly_with_opencv_and_gives_the_frames_tokens(video_checkpoints, photos, tmp_path):
    frames = clip_frames(photos[1], count=12)
    path = write_mp4(tmp_path / "clip.mp4", frames, fps=4.0)
    video = read_video(open(path, "rb"), VideoSampling(num_frames=4))
    assert video.frames_indices == [0, 4, 7, 11] and video.fps == pytest.approx(4.0)
    assert video.frames.shape == (4, 48, 64, 3) and video.timestamps == [0.0, 1.0, 1.75, 2.75]
    by_fps = read_video(open(path, "rb"), VideoSampling(fps=1.0))
    assert by_fps.frames_indices == [0, 4, 8]
    capped = read_video(open(path, "rb"), VideoSampling(num_frames=6, fps=4.0, max_frames=6))
    assert capped.num_frames == 6 and capped.frames_indices[-1] == 11

    engine = engine_for(video_checkpoints("tiny-qwen2-vl"))
    turn = [user_turn("Describe.")]
    sampling = SamplingParams(max_tokens=6)
    from_path = run(engine, [dict(messages=turn, videos=[path], sampling=sampling)])
    decoded = read_video(open(path, "rb"), VideoSampling())
    from_frames = run(engine, [dict(messages=turn, videos=[decoded], sampling=sampling)])
    from_bytes = run(engine, [dict(messages=turn, videos=[open(path, "rb").read()], sampling=sampling)])
    assert list(from_path.values()) == list(from_frames.values()) == list(from_bytes.values())
    assert decoded.num_frames == VideoSampling().num_frames


def test_files_over_their_limits_or_unreadable_are_refused_naming_why(photos, tmp_path):
    path = write_mp4(tmp_path / "clip.mp4", clip_frames(photos[0], count=10), fps=2.0)
    with pytest.raises(VideoLimitError, match="lasts 5.0 s, over the limit of 3 s") as too_long:
        read_video(open(path, "rb"), VideoSampling(max_seconds=3))
    assert too_long.value.limit == "max_video_seconds"
    with pytest.raises(VideoLimitError, match="64x48 = 3072 pixels, over the limit of 3000") as too_big:
        read_video(open(path, "rb"), VideoSampling(max_frame_pixels=3000))
    assert too_big.value.limit == "max_video_frame_pixels"
    with pytest.raises(VideoLimitError, match="num_frames 40 is over the limit of 32"):
        VideoSampling(num_frames=40)
    data = open(path, "rb").read()
    for broken in (b"not a video at all" * 50, data[: len(data) // 2]):
        with pytest.raises(ValueError, match="not a readable video"):
            import io

            read_video(io.BytesIO(broken), VideoSampling())


def test_families_without_video_or_mismatched_prompts_are_refused(video_checkpoints, clip):
    llava = engine_for(video_checkpoints("tiny-llava"))
    with pytest.raises(ValueError, match="LlavaForConditionalGeneration has no video input"):
        llava.add_request(prompt="USER: Describe the clip. ASSISTANT:", videos=[clip])
    smolvlm = engine_for(video_checkpoints("tiny"))
    with pytest.raises(ValueError, match="1 <video> marker.*but 2 video"):
        smolvlm.add_request(messages=[user_turn("Describe.")], videos=[clip, clip])
    both = [{"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "Compare."}]}]
    from PIL import Image

    with pytest.raises(ValueError, match="images or videos in one prompt, not both"):
        smolvlm.add_request(messages=both, images=[Image.fromarray(clip.frames[0])], videos=[clip])
    with pytest.raises(ValueError, match="frames of different sizes"):
        frames_video([clip.frames[0], clip.frames[0][:20]], "video 0")
    with pytest.raises(ValueError, match="fps must be a positive number, got 0"):
        Video(clip.frames, fps=0)
    with pytest.raises(ValueError, match=r"uint8 array \[frames, height, width, 3\], got \(8, 64, 96\)"):
        Video(clip.frames[..., 0], fps=2.0)
    assert not smolvlm.has_unfinished_requests()
