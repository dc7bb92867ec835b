"""How the runner packs decodes for attention (exactness of the result is test_exactness's job)."""

from __future__ import annotations


def test_a_long_context_among_short_ones_is_attended_in_its_own_batch(make_engine):
    runner = make_engine(block_size=16).runner
    # (packed query index, context length, cache blocks)
    short = [(i, 40 + i, [i * 3, i * 3 + 1, i * 3 + 2]) for i in range(8)]
    long = (8, 1700, list(range(100, 207)))
    groups = runner._decode_groups([*short, long])
    assert [group.query_index.tolist() for group in groups] == [[8], [7, 6, 5, 4, 3, 2, 1, 0]]
    alone, together = groups
    assert alone.block_tables.shape == (1, 107) and alone.mask.sum() == 1700
    assert together.block_tables.shape == (8, 3)
    assert together.mask[:, 0, 0].sum(dim=1).tolist() == [47, 46, 45, 44, 43, 42, 41, 40]
    assert together.block_tables[0].tolist() == [21, 22, 23]


def test_similar_contexts_share_one_batch(make_engine):
    runner = make_engine(block_size=16).runner
    contexts = [100 + 10 * i for i in range(6)]
    groups = runner._decode_groups([(i, n, list(range(20 * i, 20 * i + -(-n // 16)))) for i, n in enumerate(contexts)])
    assert len(groups) == 1 and groups[0].query_index.tolist() == [5, 4, 3, 2, 1, 0]
    assert groups[0].block_tables.shape == (6, 10)  # 150 positions in blocks of 16
    assert groups[0].mask[:, 0, 0].sum(dim=1).tolist() == contexts[::-1]
