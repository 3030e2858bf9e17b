"""append_steps: equal to torch.cat, in place only when that is safe.

Every test takes the ``device`` fixture (``pytest --device cuda`` runs them on the
GPU, where decoding appends to its caches): tensors are drawn on the CPU and moved.
"""

import contextlib

import pytest
import torch

from srupp.nn.append import append_steps, sliding_windows


def test_repeated_appends_equal_cat_and_reuse_the_buffer(device):
    torch.manual_seed(0)
    with torch.no_grad():
        cache, want = None, torch.empty(2, 0, 3, device=device)
        for L in (5, 1, 1, 2, 1, 64, 1):
            new = torch.randn(2, L, 3).to(device)
            cache = append_steps(cache, new)
            want = torch.cat([want, new], 1)
            torch.testing.assert_close(cache, want, rtol=0, atol=0)
        # the last single step fitted into spare room: same buffer as before
        again = append_steps(cache, torch.randn(2, 1, 3).to(device))
        assert again._base is cache._base


def test_an_older_view_never_changes_and_a_second_branch_copies(device):
    with torch.no_grad():
        root = append_steps(None, torch.zeros(1, 4, 2, device=device))
        a = append_steps(root, torch.ones(1, 1, 2, device=device))  # in place after root
        # root is no longer the end: copy
        b = append_steps(root, torch.full((1, 1, 2), 7.0, device=device))
        assert a._base is root._base and b._base is not root._base
        torch.testing.assert_close(a[:, -1], torch.ones(1, 2, device=device))
        torch.testing.assert_close(b[:, -1], torch.full((1, 2), 7.0, device=device))
        torch.testing.assert_close(root, torch.zeros(1, 4, 2, device=device))


def test_a_sliding_window_and_other_dims(device):
    torch.manual_seed(1)
    with torch.no_grad():
        cache, want = None, torch.empty(1, 2, 0, 3, device=device)
        for _ in range(200):
            new = torch.randn(1, 2, 1, 3).to(device)
            cache = append_steps(cache, new, dim=2)[:, :, -8:]  # keep the last 8 steps
            want = torch.cat([want, new], 2)[:, :, -8:]
            torch.testing.assert_close(cache, want, rtol=0, atol=0)
        assert cache._base.shape[2] <= 64 + 2 * 9  # the buffer stays bounded


def test_with_gradients_it_is_plain_cat(device):
    old = torch.randn(1, 3, 2).to(device)
    new = torch.randn(1, 1, 2).to(device).requires_grad_()
    out = append_steps(old, new)
    assert out.grad_fn is not None
    out.sum().backward()
    torch.testing.assert_close(new.grad, torch.ones_like(new))


def test_dtype_of_the_new_steps_wins(device):
    with torch.no_grad():
        out = append_steps(torch.zeros(1, 2, 2, dtype=torch.float64, device=device),
                           torch.ones(1, 1, 2, device=device))
    assert out.dtype == torch.float32 and out.shape == (1, 3, 2)


@pytest.mark.parametrize("M,L,n", [(0, 5, None), (4, 5, None), (4, 5, 3), (4, 5, 5), (4, 3, 5),
                                   (2, 3, 9), (6, 1, 4), (None, 5, 2), (None, 2, 5)])
@pytest.mark.parametrize("grad", [False, True])
def test_append_keep_last_equals_cat_then_cut(M, L, n, grad, device):
    from srupp.nn.srupp import _append_keep_last, _keep_last

    old = None if M is None else torch.randn(2, M, 3).to(device)
    new = torch.randn(2, L, 3).to(device).requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        got = _append_keep_last(old, new, n)
    want = _keep_last(new if old is None else torch.cat([old, new], 1), n)
    assert torch.equal(got, want)
    if grad:  # gradients reach the kept steps of new
        (g,) = torch.autograd.grad(got.sum(), new)
        assert g.sum() == min(L, want.shape[1]) * 2 * 3


def test_reserve_steps_keeps_the_old_steps_and_follows_the_same_buffer_rules(device):
    """reserve_steps is append_steps without the copy of the new steps: the caller (the
    fused decoding op) writes them; an older view still never changes."""
    from srupp.nn.append import reserve_steps

    torch.manual_seed(2)
    with torch.no_grad():
        root = append_steps(None, torch.randn(2, 3, 4).to(device))
        kept = root.clone()
        base, start = reserve_steps(root, (2, 1, 4), root)
        assert base is root._base and start == 0
        torch.testing.assert_close(base[:, start:start + 3], kept, rtol=0, atol=0)
        base[:, start + 3] = 5.0
        # the next append continues after the reserved step, in the same buffer
        grown = append_steps(base.narrow(1, start, 4), torch.ones(2, 1, 4, device=device))
        assert grown._base is base
        torch.testing.assert_close(grown[:, 3], torch.full((2, 4), 5.0, device=device))
        # root no longer ends its buffer: a second branch gets a copy
        other, at = reserve_steps(root, (2, 1, 4), root)
        assert other is not base and at == 0
        torch.testing.assert_close(other[:, :3], kept, rtol=0, atol=0)
        torch.testing.assert_close(root, kept, rtol=0, atol=0)
        # a window that slid forward: the start is where the view begins in its buffer
        window = grown[:, 2:]
        base2, start2 = reserve_steps(window, (2, 1, 4), window)
        assert base2 is base and start2 == 2
        # from nothing: a fresh buffer with room, of the given dtype and device
        fresh, s0 = reserve_steps(None, (3, 1, 5), torch.zeros((), dtype=torch.bfloat16,
                                                               device=device))
        assert s0 == 0 and fresh.shape[0] == 3 and fresh.shape[1] >= 1 and fresh.shape[2] == 5
        assert fresh.dtype == torch.bfloat16


def test_reserve_steps_with_known_rows_agrees_and_falls_back_when_they_are_stale(device):
    """``known`` (where the caller says ``old`` lies) gives what the strides give; when
    that buffer's last append no longer ends at old's end (a second branch), or has no
    room, or old's dtype differs, it is ignored and the usual rules apply."""
    from srupp.nn.append import reserve_steps

    torch.manual_seed(3)
    with torch.no_grad():
        base, start = reserve_steps(None, (2, 5, 4), torch.zeros(2, 5, 4, device=device))
        base[:, :5] = torch.randn(2, 5, 4, device=device)
        old = base.narrow(1, 2, 3)                          # a window: rows 2..4
        kept = old.clone()
        got, at = reserve_steps(old, (2, 1, 4), old, known=(base, 2))
        assert got is base and at == 2 and base._srupp_append_end == 6
        # the same old again: its buffer's end moved on, so a copy, as without known
        other, at2 = reserve_steps(old, (2, 1, 4), old, known=(base, 2))
        assert other is not base and at2 == 0
        torch.testing.assert_close(other[:, :3], kept, rtol=0, atol=0)
        # no room left in the buffer: a fresh, larger one
        full = base.narrow(1, 0, base.shape[1])
        base._srupp_append_end = base.shape[1]
        bigger, at3 = reserve_steps(full, (2, 1, 4), full, known=(base, 0))
        assert bigger is not base and at3 == 0 and bigger.shape[1] > base.shape[1]
        # another dtype for the new steps: converted, as without known
        like = torch.zeros((), dtype=torch.float64, device=device)
        conv, at4 = reserve_steps(kept, (2, 1, 4), like, known=(base, 2))
        assert conv.dtype == torch.float64 and at4 == 0
        torch.testing.assert_close(conv[:, :3], kept.double(), rtol=0, atol=0)


@pytest.mark.parametrize("window,step", [(8, 1), (8, 3), (5, 2), (40, 1)])
def test_sliding_windows_slide_in_place(window, step, device):
    """Under sliding_windows a window of steps that is appended to and cut to its last
    ``window`` steps equals cat-then-cut at every step, slides back to its buffer's start
    in place (one buffer, allocated once, 1.5× the rows), where the default moves to new,
    twice as large buffers."""
    from srupp.nn.srupp import _keep_last

    torch.manual_seed(3)
    for sliding in (True, False):
        context = sliding_windows() if sliding else contextlib.nullcontext()
        cache, want, buffers = None, None, set()
        with torch.no_grad(), context:
            for _ in range(40):
                new = torch.randn(2, step, 3).to(device)
                cache = _keep_last(append_steps(cache, new), window)
                want = _keep_last(new if want is None else torch.cat([want, new], 1), window)
                assert torch.equal(cache, want)
                buffers.add(id(cache._base))
        if sliding:
            assert len(buffers) == 1  # allocated once, then slid in place
            M = min(window, step * 40)
            assert cache._base.shape[1] <= max(64, M + step + max(step, (M + step) // 2))
        else:
            assert len(buffers) >= 1


def test_an_older_view_is_kept_by_default(device):
    """The default keeps every view handed out; sliding is the engine's promise that it
    reads only the newest (an older view may then change)."""
    from srupp.nn.srupp import _keep_last

    with torch.no_grad():
        cache = _keep_last(append_steps(None, torch.randn(1, 70, 2).to(device)), 8)
        first = cache.clone()
        old = cache
        for _ in range(200):
            cache = _keep_last(append_steps(cache, torch.randn(1, 1, 2).to(device)), 8)
        assert torch.equal(old, first)  # default: the old view never changed
