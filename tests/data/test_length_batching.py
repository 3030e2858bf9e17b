"""LengthBatcher: the token cap, coverage, determinism, exact resume, saved-state checks."""

import itertools
import random

import numpy as np
import pytest
import torch

from srupp.data import LengthBatch, LengthBatcher


def one_line(excinfo):
    msg = str(excinfo.value)
    assert msg and "\n" not in msg
    return msg


def random_lengths(n=300, seed=1, high=40):
    rng = random.Random(seed)
    return [rng.randint(1, high) for _ in range(n)]


def take(batcher, count, position=None):
    return list(itertools.islice(batcher.iter_from(position), count))


@pytest.mark.parametrize("max_tokens, max_batch_size", [(64, None), (100, 5), (7, None)])
def test_cap_respected_and_each_item_once_per_epoch(max_tokens, max_batch_size):
    lengths = random_lengths() + [55, 200]      # items longer than max_tokens too
    b = LengthBatcher(lengths, max_tokens, max_batch_size=max_batch_size)
    fixed = b.batches()
    for batch in fixed:
        longest = max(lengths[i] for i in batch)
        assert batch and (len(batch) * longest <= max_tokens or len(batch) == 1)
        assert max_batch_size is None or len(batch) <= max_batch_size
    assert sorted(i for batch in fixed for i in batch) == list(range(len(lengths)))
    # greedy: the next batch's first item would not have fitted into the previous batch
    cap = max_batch_size or len(lengths)
    for prev, nxt in zip(fixed, fixed[1:]):
        assert (len(prev) + 1) * lengths[nxt[0]] > max_tokens or len(prev) == cap
    # training epochs visit the same batches, each once, in a shuffled order
    n = len(b)
    drawn = take(b, 3 * n)
    for e in range(3):
        epoch = drawn[e * n:(e + 1) * n]
        assert sorted(map(sorted, (x.indices for x in epoch))) == sorted(map(sorted, fixed))
        assert [x.epoch for x in epoch] == [e] * n
        assert [x.epoch_start for x in epoch] == [True] + [False] * (n - 1)
    assert [x.indices for x in drawn[:n]] != [x.indices for x in drawn[n:2 * n]]


def test_sorted_by_length_with_seeded_ties():
    lengths = [3] * 10 + [1] * 10
    b = LengthBatcher(lengths, 6)
    fixed = b.batches()
    assert [len(x) for x in fixed] == [6, 4, 2, 2, 2, 2, 2]   # ones: 6 + 4; threes: 2 each
    flat = [i for batch in fixed for i in batch]
    assert [lengths[i] for i in flat] == sorted(lengths)
    # ties are mixed by the seed, not kept in data order
    assert flat[:10] != list(range(10, 20)) and sorted(flat[:10]) == list(range(10, 20))
    assert LengthBatcher(lengths, 6, seed=1).batches() != fixed


def test_batch_cut_by_hand():
    # sorted lengths: 1 1 2 2 | 3 3 3 3 | 4 4 5 | ... with max_tokens 12
    lengths = [3, 1, 4, 1, 5, 3, 2, 3, 2, 3, 4]
    b = LengthBatcher(lengths, 12, shuffle=False)
    assert [sorted(lengths[i] for i in x) for x in b.batches()] == [
        [1, 1, 2, 2], [3, 3, 3, 3], [4, 4], [5]]
    assert [x.indices for x in take(b, 4)] == b.batches()   # no shuffle: the sorted order


def test_determinism_and_epoch_order_formula():
    lengths = random_lengths()
    a, b = LengthBatcher(lengths, 50, seed=3), LengthBatcher(lengths, 50, seed=3)
    assert take(a, 2 * len(a)) == take(b, 2 * len(b))
    fixed = a.batches()
    for e in (0, 1):
        order = list(range(len(fixed)))
        random.Random(3 * 1_000_003 + e).shuffle(order)
        got = [x.indices for x in take(a, len(a), e * len(a))]
        assert got == [fixed[k] for k in order]


def test_resume_anywhere_equals_uninterrupted():
    lengths = random_lengths(120)
    b = LengthBatcher(lengths, 40, seed=7)
    n = len(b)
    full = take(b, 4 * n)
    rng = random.Random(0)
    for p in [0, 1, n - 1, n, n + 1, 2 * n] + [rng.randrange(3 * n) for _ in range(8)]:
        fresh = LengthBatcher(lengths, 40, seed=7)
        first = take(fresh, p)                         # train p batches, then save
        state = fresh.state_dict()
        assert state["position"] == p and first == full[:p]
        resumed = LengthBatcher(list(lengths), 40, seed=7)
        resumed.load_state_dict(state)
        assert take(resumed, n) == full[p:p + n]       # from the saved position
        assert take(LengthBatcher(lengths, 40, seed=7), n, p) == full[p:p + n]
    assert isinstance(full[0], LengthBatch) and isinstance(full[0].indices, list)


def test_state_mismatch_names_what_differs():
    lengths = random_lengths(50)
    state = LengthBatcher(lengths, 30).state_dict()
    assert all(type(v) is int for v in state.values())
    changed = [(lengths[:-1] + [lengths[-1] % 40 + 1], 30, {}, "lengths_crc32"),
               (lengths, 31, {}, "max_tokens"),
               (lengths, 30, {"seed": 1}, "seed"),
               (lengths, 30, {"shuffle": False}, "shuffle"),
               (lengths, 30, {"max_batch_size": 4}, "max_batch_size"),
               (lengths[:-1], 30, {}, "num_items")]
    for lens, max_tokens, kw, key in changed:
        with pytest.raises(ValueError) as e:
            LengthBatcher(lens, max_tokens, **kw).load_state_dict(state)
        assert key in one_line(e) and "cannot resume" in one_line(e)
    other = LengthBatcher(lengths, 30)
    with pytest.raises(ValueError, match="lacks lengths_crc32"):
        other.load_state_dict({k: v for k, v in state.items() if k != "lengths_crc32"})
    with pytest.raises(ValueError, match="position"):
        other.load_state_dict(dict(state, position=-1))
    with pytest.raises(ValueError, match="position"):
        other.load_state_dict([])


def test_lengths_from_arrays_and_bad_arguments():
    lengths = [4, 2, 9, 1]
    ref = LengthBatcher(lengths, 8).batches()
    assert LengthBatcher(np.array(lengths), 8).batches() == ref
    assert LengthBatcher(torch.tensor(lengths), 8).batches() == ref
    for bad in ([3, 0, 2], [3, -1], [2.0, 3], [True, 2]):
        with pytest.raises(ValueError, match="positive integer"):
            LengthBatcher(bad, 8)
    with pytest.raises(ValueError, match="empty"):
        LengthBatcher([], 8)
    with pytest.raises(ValueError, match="max_tokens"):
        LengthBatcher(lengths, 0)
    with pytest.raises(TypeError, match="max_tokens"):
        LengthBatcher(lengths, 8.0)
    with pytest.raises(ValueError, match="max_batch_size"):
        LengthBatcher(lengths, 8, max_batch_size=0)
    with pytest.raises(ValueError, match="position"):
        next(LengthBatcher(lengths, 8).iter_from(-1))


def test_eval_order_is_fixed_and_independent_of_training():
    lengths = random_lengths(80)
    b = LengthBatcher(lengths, 60)
    before = b.batches()
    take(b, 5)
    assert b.batches() == before and b.position == 5
    flat = [i for batch in before for i in batch]
    assert [lengths[i] for i in flat] == sorted(lengths)
    before[0].append(999)   # the caller's copy
    assert 999 not in b.batches()[0]
