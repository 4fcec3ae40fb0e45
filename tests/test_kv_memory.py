"""The page allocator and the KV cache manager against a brute-force model of slot ownership."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.memory.kv_cache import KVCache
from engine.memory.kv_pool import KVPool
from engine.memory.page_allocator import PageAllocator
from engine.memory.req_to_token import ReqToTokenPool
from engine.request import Req
from engine.sampling_params import SamplingParams


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), st.lists(st.tuples(st.booleans(), st.integers(0, 12)), max_size=60))
def test_allocator_never_hands_out_a_page_twice(num_pages, ops):
    alloc = PageAllocator(num_pages)
    held: list[list[int]] = []
    for is_alloc, n in ops:
        if is_alloc:
            out_now = {p for block in held for p in block}
            if n > num_pages - len(out_now):
                with pytest.raises(MemoryError):
                    alloc.alloc(n)
                continue
            block = alloc.alloc(n)
            assert len(block) == n
            assert not set(block) & out_now, "a page handed out twice"
            assert all(1 <= p <= num_pages for p in block), (
                "page 0 is scratch; ids are 1..num_pages"
            )
            held.append(block)
        elif held:
            alloc.free(held.pop(n % len(held)))
        assert alloc.num_free == num_pages - sum(map(len, held))
    for block in held:
        alloc.free(block)
    assert alloc.num_free == num_pages


def test_double_free_raises():
    alloc = PageAllocator(4)
    pages = alloc.alloc(2)
    alloc.free(pages)
    with pytest.raises(RuntimeError, match="freed but not allocated"):
        alloc.free(pages[:1])


def _req(rid: str, prompt_len: int, max_new: int) -> Req:
    return Req(
        rid=rid,
        input_ids=list(range(prompt_len)),
        sampling=SamplingParams(max_new_tokens=max_new),
        seed=0,
    )


@settings(max_examples=60, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4, 16]),
    num_pages=st.integers(4, 64),
    plan=st.lists(st.tuples(st.integers(1, 30), st.integers(0, 20)), min_size=1, max_size=12),
)
def test_kv_cache_slots_are_exclusive_and_table_is_consistent(page_size, num_pages, plan):
    """Admit what fits, grow each request token by token: slots never collide, the table says where each token is."""
    pool = KVPool(
        num_pages,
        page_size,
        num_layers=1,
        num_kv_heads=1,
        head_dim=2,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    table = ReqToTokenPool(max_requests=8, max_context=64, device=torch.device("cpu"))
    kv = KVCache(pool, table)
    live: dict[str, tuple[Req, list[int]]] = {}
    for i, (prompt, max_new) in enumerate(plan):
        req = _req(f"r{i}", prompt, max_new)
        if not kv.can_admit(req):
            assert (
                kv.reserved_pages + kv.pages_for(prompt + max_new) > num_pages
                or table.num_free == 0
            )
            continue
        kv.admit(req)
        slots = kv.extend(req, prompt).tolist()
        for _ in range(max_new):
            slots += kv.extend(req, 1).tolist()
        live[req.rid] = (req, slots)
        every = [s for _, ss in live.values() for s in ss]
        assert len(every) == len(set(every)), "a KV slot belongs to two tokens"
        assert all(s >= page_size for s in every), "page 0 (scratch) handed out"
        assert table.table[req.pool_row, : len(slots)].tolist() == slots
        assert kv.reserved_pages <= num_pages
        if i % 3 == 2:  # finish the oldest request
            oldest = next(iter(live))
            kv.release(live.pop(oldest)[0])
    for req, _ in list(live.values()):
        kv.release(req)
    assert kv.allocator.num_free == num_pages and kv.reserved_pages == 0 and table.num_free == 8


def test_pages_follow_page_size():
    pool = KVPool(
        10,
        4,
        num_layers=1,
        num_kv_heads=1,
        head_dim=2,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    kv = KVCache(pool, ReqToTokenPool(2, 32, torch.device("cpu")))
    req = _req("a", 6, 3)
    kv.admit(req)
    slots = kv.extend(req, 6).tolist()
    assert len(req.kv_pages) == 2  # 6 tokens in pages of 4
    assert [s // 4 for s in slots] == [req.kv_pages[0]] * 4 + [req.kv_pages[1]] * 2
    assert [s % 4 for s in slots] == [0, 1, 2, 3, 0, 1]
    kv.extend(req, 2)
    assert len(req.kv_pages) == 2  # token 7 and 8 still fit the second page
    kv.extend(req, 1)
    assert len(req.kv_pages) == 3
