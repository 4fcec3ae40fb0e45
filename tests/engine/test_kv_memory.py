"""The page allocator and the KV cache manager against a brute-force model of slot ownership."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.batch.req import Req
from engine.memory.kv_pool import KVPool
from engine.memory.page_allocator import PageAllocator
from engine.memory.req_to_token import ReqToTokenPool
from engine.runtime.messages import TokenizedRequest
from engine.sampling_params import SamplingParams
from engine.scheduler.kv_cache import KVCache


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


def _req(rid: str, tokens: list[int], max_new: int = 4) -> Req:
    sampling = SamplingParams(max_new_tokens=max_new)
    return Req(TokenizedRequest(rid=rid, input_ids=list(tokens), sampling=sampling, seed=0))


def _extend(kv: KVCache, req: Req, n: int, kv_content: dict | None = None) -> list[int]:
    """Grow a request by n tokens and record their slots in the table, as the batch builder does;
    `kv_content` (slot -> token), a brute-force KV pool, gets the tokens the model would store."""
    start = req.kv_len
    slots = kv.extend(req, n).tolist()
    kv.req_to_token.write_slots(
        torch.full((n,), req.pool_row), torch.arange(start, start + n), torch.tensor(slots)
    )
    if kv_content is not None:
        kv_content.update(zip(slots, req.fill_ids[start : start + n].tolist()))
    return slots


def _admit(kv: KVCache, req: Req, limit: int) -> int:
    """Admit the request and write its cached prefix into its row, as the batch builder does."""
    prefix = kv.admit(req, limit)
    if len(prefix):
        kv.req_to_token.write_prefixes(
            torch.tensor([req.pool_row]),
            torch.tensor([len(prefix)]),
            torch.tensor([0]),
            torch.from_numpy(prefix),
            len(prefix),
        )
    return len(prefix)


@pytest.mark.parametrize("seed", range(3))
def test_write_prefixes_against_brute_force(seed):
    """Rows that share a stretch of the shipped slots (one cached prefix, shipped once) and rows
    with their own all get exactly their stretch, and nothing else of the table changes."""
    gen = torch.Generator().manual_seed(seed)
    pool = ReqToTokenPool(12, 40, torch.device("cpu"))
    pool.table.copy_(torch.randint(0, 1000, pool.table.shape, generator=gen, dtype=torch.int32))
    want = pool.table.clone()
    slots = torch.randint(1, 1000, (60,), generator=gen)
    rows = torch.randperm(12, generator=gen)[:7]
    lens = torch.randint(1, 21, (7,), generator=gen)
    # sources point into three stretches, several rows to the same one
    sources = torch.tensor([0, 20, 0, 40, 20, 0, 40])
    for row, n, src in zip(rows.tolist(), lens.tolist(), sources.tolist()):
        want[row, :n] = slots[src : src + n].to(torch.int32)
    pool.write_prefixes(rows, lens, sources, slots, int(lens.sum()))
    assert torch.equal(pool.table, want)


def _tree_pages(kv: KVCache) -> list[int]:
    return [p for node in kv.tree._nodes() for p in kv.tree.pages_of(node.value)] if kv.tree else []


def _check_ownership(kv: KVCache, live: list[Req]) -> None:
    """Every page is exactly one of: free, owned by one live request, held by the prefix cache."""
    free = kv.allocator.free_pages()
    cached = _tree_pages(kv)
    owned = [p for r in live for p in kv.own_pages(r).tolist()]
    every = free + cached + owned
    assert len(every) == len(set(every)), "a page is in two places"
    assert sorted(every) == list(range(1, kv.pool.num_pages + 1)), "a page leaked"
    ps = kv.page_size
    for r in live:  # a request's prefix pages (as its table row says) are the cache's
        prefix_pages = kv.req_to_token.table[r.pool_row, : r.prefix_len : ps] // ps
        assert set(prefix_pages.tolist()) <= set(cached)
        # its own pages (the host's column) are those its table row's own slots lie in
        own_slots = kv.req_to_token.table[r.pool_row, r.prefix_len : r.kv_len]
        assert (own_slots // ps).unique_consecutive().tolist() == kv.own_pages(r).tolist()


@settings(max_examples=80, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4]),
    num_pages=st.integers(8, 64),
    radix=st.booleans(),
    plan=st.lists(
        st.tuples(
            st.lists(st.integers(0, 3), min_size=1, max_size=24),
            st.integers(0, 12),
            st.booleans(),
        ),
        min_size=1,
        max_size=14,
    ),
)
def test_kv_cache_page_ownership(page_size, num_pages, radix, plan):
    """Admit, grow token by token, share (cache_prefix, as after a prefill step, at once or later
    when another request may have cached the same tokens) and release requests with overlapping
    prompts: no page is lost or shared wrongly, and each request's table row reads its own
    tokens from a brute-force KV pool, whatever the cache served or took over."""
    pool = KVPool(
        num_pages,
        page_size,
        num_layers=1,
        num_kv_heads=1,
        head_dim=2,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    table = ReqToTokenPool(max_requests=6, max_context=64, device=torch.device("cpu"))
    kv = KVCache(pool, table, enable_prefix_cache=radix)
    live: list[Req] = []
    kv_content: dict[int, int] = {}  # slot -> the token whose K/V it holds

    def check_rows() -> None:
        for r in live:
            row = table.table[r.pool_row, : r.kv_len].tolist()
            assert [kv_content[s] for s in row] == r.fill_ids[: r.kv_len].tolist()

    for i, (prompt, grow, share_now) in enumerate(plan):
        req = _req(f"r{i}", prompt)
        if table.num_free == 0:
            kv.release(live.pop(0))
        cached = _admit(kv, req, len(prompt) - 1)
        assert cached % page_size == 0 and cached <= len(prompt) - 1
        need = kv.pages_for(len(prompt) + grow) - kv.pages_held(req)
        if need > kv.available_pages:
            kv.release(req)  # does not fit: back out, nothing computed
            _check_ownership(kv, live)
            continue
        _extend(kv, req, len(prompt) - cached, kv_content)
        if share_now:  # (its row may now read another request's copy of the same tokens)
            kv.cache_prefix(req)
        for t in range(grow):
            req.append_token(t % 4)
            _extend(kv, req, 1, kv_content)
        live.append(req)
        owners = [
            s for r in live for s in table.table[r.pool_row, : r.kv_len].tolist()[r.prefix_len :]
        ]
        assert len(owners) == len(set(owners)), "two requests computed into one slot"
        _check_ownership(kv, live)
        check_rows()
        if i % 3 == 1:  # the others share late: what they computed may be cached already
            for r in live:
                kv.cache_prefix(r)
            _check_ownership(kv, live)
            check_rows()
        if i % 3 == 2:
            kv.release(live.pop(0))
            _check_ownership(kv, live)
            check_rows()
    for req in live:
        kv.release(req)
    _check_ownership(kv, [])
    kv.flush()
    assert kv.allocator.num_free == num_pages and table.num_free == 6


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
    kv = KVCache(pool, ReqToTokenPool(2, 32, torch.device("cpu")), enable_prefix_cache=False)
    req = _req("a", range(6), 3)
    _admit(kv, req, 5)
    slots = _extend(kv, req, 6)
    pages = kv.own_pages(req).tolist()
    assert len(pages) == 2  # 6 tokens in pages of 4
    assert [s // 4 for s in slots] == [pages[0]] * 4 + [pages[1]] * 2
    assert [s % 4 for s in slots] == [0, 1, 2, 3, 0, 1]
    _extend(kv, req, 2)
    assert len(kv.own_pages(req)) == 2  # token 7 and 8 still fit the second page
    _extend(kv, req, 1)
    assert len(kv.own_pages(req)) == 3


@pytest.mark.parametrize("page_size", [1, 3, 4])
def test_decode_extension_equals_one_token_at_a_time(page_size):
    """extend_by_one (a decode step's batched allocation) gives each request the slot and pages
    that extend(req, 1) would have given it, for requests at every offset within a page."""

    def setup():
        pool = KVPool(64, page_size, 1, 1, 2, torch.float32, torch.device("cpu"))
        kv = KVCache(pool, ReqToTokenPool(8, 64, torch.device("cpu")), enable_prefix_cache=False)
        reqs = [_req(f"r{n}", range(n), 40) for n in (1, 2, 3, 5, 8)]
        for req in reqs:
            _admit(kv, req, 0)
            kv.extend(req, req.prompt_len)
        return kv, reqs

    kv_a, batched = setup()
    kv_b, single = setup()
    for _ in range(7):
        rows = np.array([r.pool_row for r in batched])
        assert kv_a.pages_to_extend_by_one(rows) == sum(
            kv_b.pages_for(r.kv_len + 1) - kv_b.pages_held(r) for r in single
        )
        slots_a = kv_a.extend_by_one(rows).tolist()
        slots_b = [int(kv_b.extend(req, 1)[0]) for req in single]
        assert slots_a == slots_b
        own_a = [kv_a.own_pages(r).tolist() for r in batched]
        assert own_a == [kv_b.own_pages(r).tolist() for r in single]
        assert [r.kv_len for r in batched] == [r.kv_len for r in single]
        assert kv_a.allocator.num_free == kv_b.allocator.num_free
