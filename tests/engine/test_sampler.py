"""The sampler's distribution against transformers' own logits warpers (temperature, top_k, top_p): what it draws
from each row is what `generate` would sample from, on both paths (the CPU kernel's radix selection, torch's sort),
and, draw by draw, the token a float64 reference of `choose`'s rule gives for the same uniform draw."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import engine.sampling
from engine.cpu import build, ops
from engine.sampling import SamplingParams, choose, sample

VOCAB = 50
ROWS = 2000  # rows a call, each with its own generator
CALLS = 10
RUNNABLE = build.runnable_variants()


@pytest.fixture(params=["kernel", "torch"])
def path(request, monkeypatch):
    """`choose` by the CPU kernel (engine/csrc/sampling.c), or by torch's operations (a GPU's path)."""
    if request.param == "torch":
        monkeypatch.setattr(engine.sampling, "_kernel", lambda device: False)
    return request.param


def reference(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    warpers = LogitsProcessorList([TemperatureLogitsWarper(params.temperature)])
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    return torch.softmax(warpers(torch.zeros(1, 1, dtype=torch.long), logits[None].clone())[0], dim=-1)


TIED = torch.tensor([3.0, 1.0, 3.0, 2.0, 2.0, 2.0, 0.5, 3.0, 1.0, 2.0] * 5)  # ties across the top_k / top_p cuts


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.5, top_p=0.5),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.6),
], ids=["whole", "top_k", "top_p", "top_p_peaked", "top_k_top_p"])
@pytest.mark.parametrize("tied", [False, True], ids=["distinct", "tied"])
def test_draws_follow_transformers_warped_distribution(params, tied, path):
    """Tied logits too: where top_p's prefix ends inside a group of tied weights, transformers' sort keeps some of
    them (which ones, its sort's whim) and `choose` all of them: those rows follow `rule`'s kept weights."""
    logits = TIED.clone() if tied else torch.randn(VOCAB, generator=torch.Generator().manual_seed(7)) * 2
    expected = reference(logits, params)
    if tied and params.top_p < 1.0:
        kept = torch.from_numpy(rule(logits.numpy(), params, 0.5)[1]).float()
        expected = kept / kept.sum()
    counts = torch.zeros(VOCAB)
    for call in range(CALLS):
        generators = [torch.Generator().manual_seed(call * ROWS + row) for row in range(ROWS)]
        tokens, failed, _ = sample(logits.expand(ROWS, VOCAB).clone(), [params] * ROWS, generators)
        assert not any(failed)
        counts += torch.bincount(torch.tensor(tokens), minlength=VOCAB)
    drawn = counts / counts.sum()
    assert set(drawn.nonzero().flatten().tolist()) <= set(expected.nonzero().flatten().tolist())  # never cut ones
    assert 0.5 * (drawn - expected).abs().sum() < 0.02  # total variation, 20,000 draws


def rule(logits: np.ndarray, params: SamplingParams, u: float) -> tuple[int | None, np.ndarray, bool]:
    """`choose`'s rule in float64: the token drawn at u (None where a cut or the draw falls within 1e-6 of the
    total of a boundary, where float32 rounding may decide either way), the kept weights, and whether a cut is
    that close (a token just past it may then be kept)."""
    x = (logits.astype(np.float64) - logits.max()) / params.temperature
    w = np.where(x >= -87.0, np.exp(x), 0.0)
    keep = np.ones_like(w, dtype=bool)
    values = np.sort(w)[::-1]
    close = False
    if 0 < params.top_k < len(w):
        least = values[params.top_k - 1]
        keep = w >= least
        after = values[params.top_k] if params.top_k < len(w) else 0.0
        close |= after != least and abs(after - least) < 1e-6 * least
    if params.top_p < 1.0:
        kept = np.sort(w[keep])[::-1]
        total = kept.sum()
        before = np.cumsum(kept) - kept
        bound = params.top_p * total
        least = kept[(before < bound).sum() - 1]
        keep &= w >= least
        close |= bool(np.any(np.abs(before - bound) < 1e-6 * total))
    kept = np.where(keep, w, 0.0)
    running = np.cumsum(kept)
    target, margin = u * running[-1], 1e-6 * running[-1]
    last = int(np.flatnonzero(kept)[-1])
    token = min(int(np.searchsorted(running, target, side="right")), last)
    before = running[token - 1] if token else 0.0
    cut_close = close
    close |= (token != last and running[token] - target < margin) or (before > 0 and target - before < margin)
    return (None if close else token), kept, cut_close


def rows_of_every_kind(vocab: int) -> torch.Tensor:
    """Peaked, spread and flat rows; rows of many ties; one finite logit among -inf's; mostly masked; all equal;
    rising logits (each token the likeliest so far: a small top_k's buffer refills at every group)."""
    g = torch.Generator().manual_seed(vocab)
    rows = [torch.randn(vocab, generator=g) * scale for scale in (8.0, 3.0, 0.3)]
    rows.append(torch.sort(torch.randn(vocab, generator=g) * 3).values)
    rows.append(torch.round(torch.randn(vocab, generator=g) * 2) / 2)
    one = torch.full((vocab,), float("-inf"))
    one[vocab // 3] = 1.5
    masked = torch.randn(vocab, generator=g)
    masked[torch.rand(vocab, generator=g) < 0.9] = float("-inf")
    rows += [one, masked, torch.full((vocab,), 0.25)]
    return torch.stack(rows)


PARAMS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=40, top_p=0.9),
          SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.2, top_p=0.999),
          SamplingParams(temperature=0.5, top_p=0.01), SamplingParams(temperature=1.0, top_k=1),
          SamplingParams(temperature=2.0, top_k=7, top_p=0.3)]


@pytest.mark.parametrize("vocab", [50, 1001, 49_159])
def test_each_draw_is_the_rule_s_token(vocab, path):
    """Every kind of row, with each set of parameters (the last one's top_k: its vocabulary less one) and draws
    from 0 to just below 1, gives the reference's token wherever rounding cannot decide (most of them)."""
    logits = rows_of_every_kind(vocab)
    draws = [0.0, 0.3, 0.5, 0.77, 1.0 - 1e-12]
    params = [*PARAMS, SamplingParams(temperature=1.0, top_k=vocab - 1)]
    checked = 0
    for p in params:
        for u in draws:
            got = choose(logits, torch.arange(len(logits)), logits.max(dim=-1).values, [p] * len(logits),
                         torch.full((len(logits),), u, dtype=torch.float64)).tolist()
            for row, token in zip(logits.numpy(), got):
                expected, kept, cut_close = rule(row, p, u)
                assert kept[token] > 0 or (cut_close and row[token] > -np.inf), (p, u, token)  # never a cut one
                if expected is not None:
                    assert token == expected, (p, u)
                    checked += 1
    assert checked > 0.8 * len(params) * len(draws) * len(logits)


@pytest.mark.parametrize("k", [40, 300], ids=["buffered", "by_histograms"])
def test_top_k_keeps_exactly_k_of_weights_a_few_ulps_apart(k, path):
    """600 logits 2e-6 apart (weights some 33 float32 ulps apart: 15 in a bin of the selection's first two levels)
    among low ones: the k largest and no more are kept, whichever way the kernel selects (a buffer for a small
    top_k, histograms past it). The first kept token in token order is drawn at u = 0, the last at u near 1."""
    vocab, start = 4099, 1000
    logits = torch.rand(1, vocab, generator=torch.Generator().manual_seed(k)) * 10 - 20
    logits[0, start : start + 600] = torch.arange(600) * 2e-6
    params = [SamplingParams(temperature=1.0, top_k=k)]
    first, last = (choose(logits, torch.tensor([0]), logits.max(dim=-1).values, params,
                          torch.tensor([u], dtype=torch.float64)).item() for u in (0.0, 1.0 - 1e-12))
    assert (first, last) == (start + 600 - k, start + 599)


@pytest.mark.parametrize("name", RUNNABLE)
def test_each_build_draws_the_rule_s_token(monkeypatch, name):
    monkeypatch.setattr(build, "variant", lambda: name)
    logits = rows_of_every_kind(4099)
    for p in PARAMS:
        for u in (0.0, 0.41, 0.9):
            got = choose(logits, torch.arange(len(logits)), logits.max(dim=-1).values, [p] * len(logits),
                         torch.full((len(logits),), u, dtype=torch.float64)).tolist()
            for row, token in zip(logits.numpy(), got):
                expected, kept, cut_close = rule(row, p, u)
                assert (kept[token] > 0 or cut_close) and expected in (None, token), (name, p, u)


@pytest.mark.parametrize("name", RUNNABLE)
def test_a_bfloat16_head_s_logits_are_sampled_as_their_float32_copy(monkeypatch, name):
    """A bfloat16 model's logits go to `sample` as the head wrote them (engine/model_runner.py): each build's kernels
    read them in place and give the tokens, failures and log-probabilities of their float32 copy, drawing alike
    (every kind of row, a NaN row and a row of -inf's; greedy, sampled, cut and penalized rows)."""
    monkeypatch.setattr(build, "variant", lambda: name)
    vocab = 4099
    logits = torch.cat([rows_of_every_kind(vocab)] * 2).to(torch.bfloat16)  # 16 rows: every params' twice or so
    logits[1, 7] = float("nan")
    logits[2] = float("-inf")
    rows = len(logits)
    params = [SamplingParams(), *PARAMS, SamplingParams(temperature=1.0, repetition_penalty=1.3, logprobs=2)]
    params = [params[r % len(params)] for r in range(rows)]
    histories = [([3, 5, 7], [11, 13]) for _ in range(rows)]
    for penalized in (False, True):
        chosen = params if penalized else [p if not p.penalized else SamplingParams(logprobs=2) for p in params]
        got, wide = (sample(x.clone(), chosen, [torch.Generator().manual_seed(r) for r in range(rows)], histories)
                     for x in (logits, logits.float()))
        assert got[0] == wide[0] and got[1] == wide[1] and got[1][1] and got[1][2] and got[2]
        assert {r: (t.token_id, t.logprob, t.top) for r, t in got[2].items()} == {
            r: (t.token_id, t.logprob, t.top) for r, t in wide[2].items()}


def test_sample_rows_refuses_what_does_not_fit_naming_it():
    logits = torch.randn(2, 10)
    one = dict(index=torch.tensor([0]), top=torch.tensor([1.0]), inv_temperature=torch.tensor([1.0]),
               top_k=torch.tensor([0]), top_p=torch.tensor([1.0]), u=torch.tensor([0.5], dtype=torch.float64))
    with pytest.raises(ValueError, match="float32"):
        ops.sample_rows(logits.double(), **one)
    with pytest.raises(ValueError, match="float64"):
        ops.sample_rows(logits, **{**one, "u": torch.tensor([0.5])})
    with pytest.raises(ValueError, match=r"\[5\]"):
        ops.sample_rows(logits, **{**one, "index": torch.tensor([5])})
    assert ops.sample_rows(logits, **one).tolist() in ([i] for i in range(10))


def test_a_row_of_nan_or_without_a_finite_logit_fails_alone(path):
    logits = torch.randn(3, VOCAB)
    logits[0, 4] = float("nan")
    logits[1] = float("-inf")
    params = [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.5, top_k=3),
              SamplingParams(temperature=1.0)]
    tokens, failed, _ = sample(logits, params, [torch.Generator().manual_seed(i) for i in range(3)])
    assert failed == [True, True, False] and 0 <= tokens[2] < VOCAB


def test_a_seeded_row_draws_the_same_token_whatever_the_other_rows_ask(path):
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    mine = SamplingParams(temperature=1.0, top_p=0.9, seed=5)
    alone, _, _ = sample(logits[:1].clone(), [mine], [torch.Generator().manual_seed(5)])
    others = [SamplingParams(temperature=0.8, top_k=40), SamplingParams(temperature=1.0), SamplingParams()]
    batched, _, _ = sample(logits.clone(), [mine, *others], [torch.Generator().manual_seed(5)] + [
        torch.Generator().manual_seed(9), torch.Generator().manual_seed(10), None])
    assert batched[0] == alone[0]


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, seed=3),
                                    SamplingParams(temperature=1.0, top_k=40, seed=3),
                                    SamplingParams(temperature=0.8, top_p=0.9, seed=3),
                                    SamplingParams(temperature=0.7, top_k=5, top_p=0.5, seed=3)],
                         ids=["whole", "top_k", "top_p", "top_k_top_p"])
def test_a_forced_tokens_draws_are_those_of_sampling_it(params, path):
    """Jump-forward appends a token its grammar forces without sampling (engine/output_processor.py): it draws
    what sampling that token would have, so the request's next sampled token is the same either way."""
    from engine.sampling import draw_as_sampled

    vocab = 1000
    forced = torch.full((1, vocab), float("-inf"))
    forced[0, 17] = 3.0  # the grammar's mask leaves one token
    sampled, skipped = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert sample(forced, [params], [sampled])[0] == [17]
    draw_as_sampled(skipped, torch.device("cpu"))
    assert torch.equal(torch.rand(4, generator=sampled), torch.rand(4, generator=skipped))


def test_a_request_s_stream_draws_a_block_at_a_time_the_values_of_one_draw_a_token():
    """A CPU RandomStream (make_generator's) hands out, across its blocks and beside other streams, the values a
    plain generator of the same seed gives one `uniform_` a draw (the sampler's rule before the blocks), so a
    seeded request's tokens are what they were; a jump-forward's draw takes the stream's next value too."""
    from engine.sampling import DRAW_BLOCK, RandomStream, draw_as_sampled, draws, make_generator

    streams = [make_generator(SamplingParams(temperature=1.0, seed=seed), torch.device("cpu")) for seed in (7, 8)]
    plains = [torch.Generator().manual_seed(seed) for seed in (7, 8)]
    assert all(isinstance(g, RandomStream) for g in streams)
    for step in range(2 * DRAW_BLOCK + 5):
        if step % 9 == 4:  # a forced token's draw
            draw_as_sampled(streams[0], torch.device("cpu"))
            torch.empty(1, dtype=torch.float64).uniform_(generator=plains[0])
            continue
        expected = torch.empty(2, dtype=torch.float64)
        for row, plain in enumerate(plains):
            expected[row : row + 1].uniform_(generator=plain)
        got = draws(streams, torch.device("cpu"))
        assert got.dtype == torch.float64 and torch.equal(got, expected), step
    mixed = draws([streams[1], torch.Generator().manual_seed(1), None], torch.device("cpu"))
    assert mixed[0].item() == torch.empty(1, dtype=torch.float64).uniform_(generator=plains[1]).item()
    assert mixed[1].item() == torch.empty(1, dtype=torch.float64).uniform_(generator=torch.Generator().manual_seed(
        1)).item()


@pytest.mark.parametrize(("dtype", "build_name"), [(dtype, name) for name in build.runnable_variants()
                                                    for dtype in (torch.float32, torch.bfloat16)]
                         + [(torch.float32, None), (torch.bfloat16, None)])
def test_row_max_is_torch_s_amax_and_argmax_ties_nan_and_infinities_too(monkeypatch, dtype, build_name):
    """`engine.sampling.row_max` (float32 or bfloat16 on the CPU: each kernel build's; else, and with the kernels
    off, `max`) gives torch.amax's values (as float32) and what torch.argmax picks: the first of equal maxima however
    far apart in a 49,152-token row, a NaN over any number (one in a vector's tail too), +inf, a row of -inf's first;
    a width that ends in a partial vector."""
    if build_name is not None:
        monkeypatch.setattr(build, "variant", lambda: build_name)
    else:
        monkeypatch.setattr(engine.sampling, "_kernel", lambda device: False)  # torch's max
    torch.manual_seed(0)
    rows = torch.randn(9, 49152).to(dtype)
    rows[0, [5, 30000, 49151]] = 50.0  # ties far apart
    rows[1, [40000, 49000]] = 50.0
    rows[2, 777] = float("nan")
    rows[2, 12] = float("inf")
    rows[3] = float("-inf")
    rows[4, [100, 200]] = float("inf")
    rows[5] = 0.0
    rows[6, 49151] = 50.0  # the last column
    values, got = engine.sampling.row_max(rows)
    torch.testing.assert_close(values, rows.amax(dim=-1).float(), equal_nan=True, rtol=0, atol=0)
    assert torch.equal(got, rows.argmax(dim=-1))
    assert got[:7].tolist() == [5, 40000, 777, 0, 100, 0, 49151]
    narrow = torch.randn(5, 37).to(dtype)  # two vectors and a tail of 5
    narrow[1, 35] = float("nan")
    narrow[2, [3, 36]] = 9.0
    values, got = engine.sampling.row_max(narrow)
    torch.testing.assert_close(values, narrow.amax(dim=-1).float(), equal_nan=True, rtol=0, atol=0)
    assert torch.equal(got, narrow.argmax(dim=-1)) and got[1:3].tolist() == [35, 3]


@pytest.mark.parametrize("build_name", RUNNABLE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_max_s_threads_split_the_columns_and_the_first_part_with_the_answer_wins(monkeypatch, dtype, build_name):
    """The kernel's threads each scan a contiguous part of every row's columns, the parts then taken in order: for 1
    to 5 threads (parts that end mid-vector) and one row or many, the same values
    and indices as torch, where the answer lies in a later part than an equal value (ties across parts), a NaN lies
    in a later part than the largest number or in two parts, a part holds only -inf, or a row's parts are all
    -inf."""
    monkeypatch.setattr(build, "variant", lambda: build_name)
    torch.manual_seed(1)
    vocab = 49_157  # parts of 49,157 / T columns: boundaries inside vectors
    rows = torch.randn(8, vocab).to(dtype)
    rows[0, [10, 30_000]] = 60.0  # a tie across parts: the first
    rows[1, 10] = 60.0
    rows[1, 40_000] = float("nan")  # a NaN after the largest number: the NaN
    rows[2, [45_000, 20_000]] = float("nan")  # NaNs in two parts: the first
    rows[3, : vocab // 2] = float("-inf")  # the first part(s) only -inf
    rows[4] = float("-inf")  # all -inf: index 0
    rows[5, vocab - 1] = 70.0  # the last column
    rows[6, [vocab // 2, vocab // 2 + 1]] = 80.0  # about a boundary
    lib = build.load_variant(build_name)
    for threads in (1, 2, 3, 4, 5):
        for batch in (rows, rows[5:6]):
            top, at = torch.empty(batch.shape[0]), torch.empty(batch.shape[0], dtype=torch.int64)
            assert lib.row_max(batch.data_ptr(), ops.DTYPE_CODES[dtype], batch.shape[0], vocab, top.data_ptr(),
                               at.data_ptr(), threads) == 0
            torch.testing.assert_close(top, batch.amax(dim=-1).float(), equal_nan=True, rtol=0, atol=0)
            assert torch.equal(at, batch.argmax(dim=-1)), (threads, at.tolist(), batch.argmax(dim=-1).tolist())
    assert at.tolist() == [vocab - 1]
