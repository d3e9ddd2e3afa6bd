"""PageTable mirrors page lists exactly: its gather equals the block table built from the lists."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_async_cb.engine.page_table import PageTable
from hf_async_cb.model.step_metadata import block_table

# Operations on 6 requests: extend by k pages, reset (preemption / finish), or gather all holders.
ops = st.lists(st.tuples(st.sampled_from(["extend", "reset", "gather"]), st.integers(0, 5), st.integers(1, 40)),
               max_size=80)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_gather_equals_the_block_table_of_the_page_lists(operations):
    table = PageTable(rows=2, width=4)  # small, so that rows and columns must grow
    pages: dict[int, list[int]] = {i: [] for i in range(6)}
    next_page = 0
    for op, who, k in operations:
        if op == "extend":
            pages[who] = pages[who] + list(range(next_page, next_page + k))
            next_page += k
            table.sync(who, pages[who])
        elif op == "reset":
            pages[who] = []
            table.sync(who, pages[who])
        holders = [r for r in pages if pages[r]]
        if op == "gather" and holders:
            width = max(len(pages[r]) for r in holders) + k
            pad_rows = k % 3  # padding requests: rows of one page only
            got = table.gather(holders, width, pad_rows, pad_page=10_000)
            lists = [pages[r] for r in holders]
            full = [len(p) * 16 for p in lists]
            assert np.array_equal(got[:len(holders)], block_table(lists, full, 16, width))
            assert got.shape == (len(holders) + pad_rows, width) and (got[len(holders):] == 10_000).all()
    assert len(table.rows) == sum(1 for p in pages.values() if p)
