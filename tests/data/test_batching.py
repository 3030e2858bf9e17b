"""StreamBatcher: contiguous streams, shifted targets, ranks, resume, errors."""

import itertools

import pytest
import torch

from srupp.data import Batch, StreamBatcher


def epoch_streams(batcher):
    """Rebuild each stream from one epoch of batches: inputs, then the last target."""
    batches = list(batcher)
    xs = torch.cat([x for x, _ in batches], dim=1)
    ys = torch.cat([y for _, y in batches], dim=1)
    return batches, xs, ys


def test_streams_contiguous_and_targets_shift():
    ids = torch.arange(103)                # 4 streams of 25, 3 tokens dropped
    b = StreamBatcher(ids, batch_size=4, unroll=5)
    assert b.stream_len == 25 and b.dropped_tokens == 3
    assert len(b) == 5                     # 24 pairs per stream / 5 = 4.8 -> 5 batches
    batches, xs, ys = epoch_streams(b)
    assert [x.shape for x, _ in batches] == [(4, 5)] * 4 + [(4, 4)]   # short last batch kept
    for x, y in batches:
        assert x.dtype == y.dtype == torch.int64 and x.is_contiguous()
        assert torch.equal(y, x + 1)       # targets are inputs shifted by one
    # concatenating the batches gives each contiguous stream (minus its last token)
    expected = torch.arange(100).view(4, 25)
    assert torch.equal(xs, expected[:, :-1]) and torch.equal(ys, expected[:, 1:])
    assert b.tokens_per_epoch == 4 * 24 == ys.numel()


def test_exact_fit_has_no_short_batch():
    b = StreamBatcher(torch.arange(2 * 13), batch_size=2, unroll=4)   # 12 pairs = 3 x 4
    assert len(b) == 3 and all(x.shape == (2, 4) for x, _ in b)


@pytest.mark.parametrize("world_size", [2, 3])
def test_rank_split_disjoint_and_covering(world_size):
    ids = torch.arange(1000)
    B, L = 3, 7
    per_rank = []
    for rank in range(world_size):
        b = StreamBatcher(ids, B, L, rank=rank, world_size=world_size)
        _, xs, ys = epoch_streams(b)
        per_rank.append(torch.cat([xs, ys[:, -1:]], dim=1))   # full streams
    all_streams = torch.cat(per_rank)
    S = 1000 // (B * world_size)
    assert all_streams.shape == (B * world_size, S)
    # every rank holds different tokens, and together they cover the kept tokens in order
    assert torch.equal(all_streams.flatten(), torch.arange(B * world_size * S))
    sets = [set(s.flatten().tolist()) for s in per_rank]
    for a, c in itertools.combinations(sets, 2):
        assert not a & c


def test_iter_from_wraps_and_flags_epoch_start():
    b = StreamBatcher(torch.arange(40), batch_size=2, unroll=4)  # S=20, 19 pairs -> 5 batches
    n = len(b)
    got = list(itertools.islice(b.iter_from(0), 2 * n + 1))
    assert all(isinstance(g, Batch) for g in got)
    assert [g.step for g in got] == list(range(2 * n + 1))
    assert [g.epoch for g in got] == [0] * n + [1] * n + [2]
    assert [g.epoch_start for g in got] == [s % n == 0 for s in range(2 * n + 1)]
    assert [b.is_epoch_start(s) for s in range(2 * n + 1)] == [g.epoch_start for g in got]
    for g in got[n:2 * n]:                 # same layout every epoch
        x, y = b.get_batch(g.step - n)
        assert torch.equal(g.inputs, x) and torch.equal(g.targets, y)
    assert b.position == 2 * n + 1 and b.epoch == 2


def test_resume_from_state_dict_reproduces_batches():
    ids = torch.randint(0, 256, (5000,), generator=torch.Generator().manual_seed(0))
    ref = StreamBatcher(ids, 4, 16)
    reference = [(g.inputs, g.targets, g.epoch_start)
                 for g in itertools.islice(ref.iter_from(0), 200)]

    first = StreamBatcher(ids, 4, 16)
    it = first.iter_from()
    for _ in range(123):
        next(it)
    state = first.state_dict()
    assert state["position"] == 123 and all(isinstance(v, int) for v in state.values())

    resumed = StreamBatcher(ids.clone(), 4, 16)
    resumed.load_state_dict(state)
    assert resumed.position == 123
    rest = [(g.inputs, g.targets, g.epoch_start) for g in itertools.islice(resumed.iter_from(), 77)]
    for (x, y, e), (rx, ry, re) in zip(rest, reference[123:]):
        assert torch.equal(x, rx) and torch.equal(y, ry) and e == re


def test_load_state_dict_rejects_other_data_or_layout():
    ids = torch.arange(500)
    state = StreamBatcher(ids, 4, 8).state_dict()
    with pytest.raises(ValueError) as e:
        StreamBatcher(ids, 5, 8).load_state_dict(state)
    msg = str(e.value)
    assert "\n" not in msg and "batch_size: saved 4, now 5" in msg
    other = ids.clone()
    other[7] = 0
    with pytest.raises(ValueError, match="data_crc32"):
        StreamBatcher(other, 4, 8).load_state_dict(state)
    with pytest.raises(ValueError, match="position"):
        StreamBatcher(ids, 4, 8).load_state_dict({"batch_size": 4})


def test_too_little_data():
    with pytest.raises(ValueError) as e:
        StreamBatcher(torch.arange(100), batch_size=8, unroll=16, world_size=2)
    msg = str(e.value)
    assert "\n" not in msg
    for number in ("100 tokens", "batch_size=8", "world_size=2", "unroll=16", "272"):
        assert number in msg
    StreamBatcher(torch.arange(16 * 17), batch_size=8, unroll=16, world_size=2)  # just enough


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(batch_size=0, unroll=4), ValueError, "batch_size"),
    (dict(batch_size=2, unroll=-1), ValueError, "unroll"),
    (dict(batch_size=2.0, unroll=4), TypeError, "batch_size"),
    (dict(batch_size=2, unroll=True), TypeError, "unroll"),
    (dict(batch_size=2, unroll=4, rank=2, world_size=2), ValueError, "rank"),
    (dict(batch_size=2, unroll=4, world_size=0), ValueError, "world_size"),
])
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match) as e:
        StreamBatcher(torch.arange(100), **kwargs)
    assert type(e.value) is error  # a plain API error, not the CLI's UserError


def test_bad_steps():
    b = StreamBatcher(torch.arange(100), 2, 4)
    with pytest.raises(ValueError, match="non-negative"):
        b.get_batch(-1)
    with pytest.raises(TypeError, match="non-negative"):
        b.get_batch(1.0)
    with pytest.raises(ValueError, match="non-negative"):
        next(b.iter_from(-3))


def test_bad_ids():
    with pytest.raises(ValueError, match="1-D"):
        StreamBatcher(torch.zeros(10, 10, dtype=torch.long), 2, 2)
    with pytest.raises(TypeError, match="integers"):
        StreamBatcher(torch.zeros(100), 2, 2)
    b = StreamBatcher(list(range(50)), 2, 3)            # lists are accepted
    assert b.get_batch(0)[0].tolist() == [[0, 1, 2], [25, 26, 27]]
