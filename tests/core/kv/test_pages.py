"""PagePool: allocation order, sharing through reference counts, loud double frees."""

from __future__ import annotations

import random

import pytest

from engine.core.kv.pages import OutOfPages, PagePool


def state(pool: PagePool) -> tuple:
    return pool.num_free, [pool.refcount(p) for p in range(pool.num_pages)]


def test_alloc_hands_out_lowest_free_ids_and_never_the_null_page():
    pool = PagePool(8)
    assert (pool.num_usable, pool.num_free, pool.num_used) == (7, 7, 0)
    assert pool.alloc(3) == [1, 2, 3]
    assert [pool.refcount(p) for p in range(8)] == [0, 1, 1, 1, 0, 0, 0, 0]
    assert (pool.num_free, pool.num_used) == (4, 3)
    pool.decref([2])
    assert pool.alloc(2) == [2, 4]  # the freed id comes back before untouched higher ones
    assert pool.alloc(0) == []
    assert 0 not in pool.alloc(pool.num_free)
    pool.check_consistency()


def test_out_of_pages_allocates_nothing():
    pool = PagePool(5)
    pool.alloc(3)
    before = state(pool)
    with pytest.raises(OutOfPages):
        pool.alloc(2)
    assert state(pool) == before
    assert pool.alloc(1) == [4]
    with pytest.raises(OutOfPages):
        pool.alloc(1)
    pool.check_consistency()


def test_shared_page_is_freed_by_its_last_reference():
    pool = PagePool(4)
    (p,) = pool.alloc(1)
    pool.incref([p, p])
    assert pool.refcount(p) == 3
    pool.decref([p])
    pool.decref([p])
    assert pool.num_free == 2 and pool.refcount(p) == 1
    pool.decref([p])
    assert pool.num_free == 3 and pool.refcount(p) == 0
    pool.check_consistency()


@pytest.mark.parametrize("bad", [[0], [3], [1, 1, 1], [2, 4]])
def test_bad_decref_raises_and_changes_nothing(bad):
    pool = PagePool(6)
    pool.alloc(2)  # pages 1 and 2 with one reference each
    pool.incref([1])
    before = state(pool)
    with pytest.raises(ValueError):
        pool.decref(bad)
    assert state(pool) == before
    pool.check_consistency()


@pytest.mark.parametrize("bad", [[0], [3], [1, 6], [-1]])
def test_incref_of_unallocated_page_raises_and_changes_nothing(bad):
    pool = PagePool(6)
    pool.alloc(2)
    before = state(pool)
    with pytest.raises(ValueError):
        pool.incref(bad)
    assert state(pool) == before


def test_double_free_is_loud():
    pool = PagePool(3)
    pages = pool.alloc(2)
    pool.decref(pages)
    with pytest.raises(ValueError):
        pool.decref(pages[:1])
    pool.check_consistency()


def test_check_consistency_catches_a_corrupt_pool():
    pool = PagePool(4)
    pool.alloc(1)
    pool._refcount[1] = 0  # referenced by nobody, yet not on the free list
    with pytest.raises(AssertionError):
        pool.check_consistency()


def test_random_operations_agree_with_a_refcount_model(seed):
    rng = random.Random(seed)
    pool = PagePool(17)
    model: dict[int, int] = {}  # page -> references held
    for _ in range(600):
        op = rng.random()
        if op < 0.4:
            n = rng.randint(0, 5)
            free_before = pool.num_usable - len(model)
            if n > free_before:
                with pytest.raises(OutOfPages):
                    pool.alloc(n)
            else:
                expect = sorted(set(range(1, 17)) - set(model))[:n]
                assert pool.alloc(n) == expect
                model.update(dict.fromkeys(expect, 1))
        elif op < 0.6 and model:
            pages = rng.choices(sorted(model), k=rng.randint(1, 3))
            pool.incref(pages)
            for p in pages:
                model[p] += 1
        elif model:
            pages = rng.choices(sorted(model), k=rng.randint(1, 3))
            if any(pages.count(p) > model[p] for p in pages):
                with pytest.raises(ValueError):
                    pool.decref(pages)
            else:
                pool.decref(pages)
                for p in pages:
                    model[p] -= 1
                    if model[p] == 0:
                        del model[p]
        assert [pool.refcount(p) for p in range(17)] == [model.get(p, 0) for p in range(17)]
        assert pool.num_used == len(model)
        pool.check_consistency()
