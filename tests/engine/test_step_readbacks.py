"""Nothing in a step's forward reads a device value back to the host; sampling reads back once for the whole
batch. Counted on the CPU (where a read-back costs nothing, but the same calls would each wait for the device
on CUDA): the aten op behind `.item()`, `int()` and `bool()` of a tensor, ops whose output size depends on
values, and `.tolist()`/`.item()`/`.cpu()`/`.numpy()` calls."""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine import SamplingParams
from tests.engine.conftest import PROMPTS

SYNCING_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "repeat_interleave.Tensor")


class ReadBacks(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if any(op in name for op in SYNCING_OPS):
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def test_one_read_back_per_step_and_none_in_the_forward(make_engine, monkeypatch):
    engine = make_engine(max_num_batched_tokens=24, max_num_seqs=8)
    calls: Counter[str] = Counter()
    for method in ("tolist", "item", "cpu", "numpy"):
        original = getattr(torch.Tensor, method)

        def counted(self, *args, _name=method, _original=original, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, counted)
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    sampled = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, top_k=20, top_p=0.9, seed=3)
    engine.add_request(prompt=PROMPTS[0], sampling=greedy)
    engine.add_request(prompt="User: Say something long about buses.<end_of_utterance>\nAssistant:", sampling=sampled)
    steps = 0
    while engine.has_unfinished_requests():
        calls.clear()
        mode = ReadBacks()
        with mode:
            outputs = engine.step()
        steps += 1
        assert not mode.counts, f"step {steps}: {dict(mode.counts)}"
        assert calls == (Counter(tolist=1) if outputs else Counter()), f"step {steps}: {dict(calls)}"
    assert steps > 12  # prefill chunks, then decodes of both kinds
