"""The model's rotary cos and sin made once for positions 0..rows-1 and read by position (the lean layers' decode
steps, engine/lean_layers.py).

A rotary embedding module makes a step's cos and sin from the step's positions: some ten small torch operators,
about 0.2 ms of a CPU decode step, since they run cold after the step's weights have streamed through the caches.
The rule: where the module's output at a position depends on the position alone, its output for positions
0..rows-1, made by the module itself in one call, holds a step's rows, and the kernels read row p for a token at
position p (ops.rope_store's `positions`). That holds for one position stream (no M-RoPE, whose streams differ
within a prompt) and a rope type whose frequencies are fixed ("dynamic" and "longrope" recompute them from the
call's longest position). The tables grow by doubling to the rows a step may reach. Each table is checked when
made against the module's own output for step-sized sets of positions, bit for bit (torch's elementwise kernels
give an element the same bits wherever it lies in the tensor on the CPUs measured); where they differ, the
module makes every step's rows as before.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

# The rope types whose module recomputes its frequencies from the positions of each call (transformers'
# `dynamic_rope_update`): a table made once would not hold their values.
POSITION_DEPENDENT_ROPE = ("dynamic", "longrope")
FIRST_ROWS = 256  # a table's rows when first made


def fits(rotary_emb: torch.nn.Module) -> bool:
    """Whether the module's output at a position depends on the position alone (see the module's docstring);
    its position streams are checked where it is called."""
    rope_type = getattr(rotary_emb, "rope_type", None)
    types = list(rope_type.values()) if isinstance(rope_type, dict) else [rope_type]
    return bool(types) and all(isinstance(t, str) and not any(word in t for word in POSITION_DEPENDENT_ROPE)
                               for t in types)


class RotaryTables:
    """Each kind's (None, or Gemma 3's layer types) cos and sin [rows, head_dim] in the model's dtype."""

    def __init__(self, rotary_emb: torch.nn.Module, kinds: list[str | None], head_dim: int) -> None:
        self.rotary_emb, self.kinds, self.head_dim = rotary_emb, kinds, head_dim
        self.rows, self.dtype = 0, None
        self.tables: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}
        self.usable = fits(rotary_emb)

    def _module(self, positions: torch.Tensor, kind: str | None, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        extra = () if kind is None else (kind,)
        probe = torch.empty(1, dtype=dtype)  # the module reads its dtype and device only
        cos, sin = self.rotary_emb(probe, positions[None], *extra)
        return (cos.reshape(-1, self.head_dim).contiguous(), sin.reshape(-1, self.head_dim).contiguous())

    def covering(self, rows: int, dtype: torch.dtype) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]] | None:
        """The tables, holding positions 0..rows-1 at least, in `dtype`; None where they do not hold the module's
        values (see the module's docstring)."""
        if not self.usable:
            return None
        if rows <= self.rows and dtype == self.dtype:
            return self.tables
        size = max(FIRST_ROWS, 2 * self.rows)
        while size < rows:
            size *= 2
        with torch.no_grad():
            tables = {kind: self._module(torch.arange(size), kind, dtype) for kind in self.kinds}
            if not all(self._agrees(tables[kind], kind, dtype) for kind in self.kinds):
                log.warning("the rotary embedding's output at a position depends on the other positions of its call "
                            "on this CPU: each decode step makes its own rows")
                self.usable, self.tables, self.rows = False, {}, 0
                return None
        self.tables, self.rows, self.dtype = tables, size, dtype
        return tables

    def _agrees(self, table: tuple[torch.Tensor, torch.Tensor], kind: str | None, dtype: torch.dtype) -> bool:
        """Whether the module gives `table`'s rows, bit for bit, for step-sized sets of positions."""
        size = table[0].shape[0]
        generator = torch.Generator().manual_seed(size)
        sets = [torch.tensor([size - 1]), torch.arange(min(size, 3)),
                *(torch.randint(size, (count,), generator=generator) for count in (5, 8, 13, 32))]
        for positions in sets:
            cos, sin = self._module(positions, kind, dtype)
            if not (torch.equal(cos, table[0][positions]) and torch.equal(sin, table[1][positions])):
                return False
        return True
