"""Rows of a vectorised group's stacks (raysim.messages.Rows): a group's uploads stay stacked until they are
reduced. The reduction of rows of one stack gives the per-state arithmetic bit for bit (the same float64 products,
summed in the same order from 0), their sizes are the rows' sizes, and a row leaves its process (pickle, the state
store's files) as its own copy, never the whole stack."""
from __future__ import annotations

import io
import pickle

import torch

from raysim import shared_maths
from raysim.io.files import load_tree, save_tree
from raysim.messages import Message, Rows, payload_sizes, rows_of, stacked_rows, tensor_bytes


def _stacks(k, dtype):
    g = torch.Generator().manual_seed(3)
    st = {"a": torch.randn(k, 3, 4, generator=g, dtype=dtype), "b": torch.randn(k, 5, generator=g, dtype=dtype),
          "i": torch.arange(k).reshape(k, 1)}
    st["a"][:, 0, 0] = -0.0  # the sign of a zero sum: +0.0 from 0 + (-0.0), as the loop's in-place adds give
    return st


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8) if a.is_floating_point()
                                                                      else a, b.view(-1).view(torch.uint8)
                                                                      if b.is_floating_point() else b)


def test_weighted_average_of_rows_equals_the_per_state_average_bit_for_bit(monkeypatch):
    for dtype in (torch.float32, torch.float64):
        st = _stacks(7, dtype)
        rows = rows_of(st)
        plain = [{k: v.clone() for k, v in r.items()} for r in rows]
        before = {k: v.clone() for k, v in st.items()}
        w = torch.tensor([5, 1, 9, 2, 2, 7, 3])
        for pick, wts in ((list(range(7)), w), ([4, 1, 6], [3, 1, 2])):
            a = shared_maths.weighted_average_states([rows[i] for i in pick], wts)
            b = shared_maths.weighted_average_states([plain[i] for i in pick], wts)
            assert list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
        monkeypatch.setattr(shared_maths, "_STACK_LIMIT", 4)  # the large-model path: one tensor at a time
        a, b = shared_maths.weighted_average_states(rows, w), shared_maths.weighted_average_states(plain, w)
        assert all(_same(a[k], b[k]) for k in a)
        monkeypatch.undo()
        assert all(torch.equal(st[k], before[k]) for k in st)  # the stacks are read, never written


def test_rows_sizes_and_what_leaves_a_process():
    st = _stacks(5, torch.float32)
    r = rows_of(st)[2]
    m = Message("weights", r)
    assert payload_sizes({"m": m}) == payload_sizes({"m": Message("weights", dict(r.items()))}) == {"weights": (17, 76)}
    assert tensor_bytes({"model": r}) == 76
    back = pickle.loads(pickle.dumps(m))
    assert type(back.tensors) is dict and back.tensors["a"].untyped_storage().nbytes() == 12 * 4
    assert all(torch.equal(back.tensors[k], st[k][2]) for k in st)
    buf = io.BytesIO()
    save_tree({"model": r}, buf)  # the state store's file format: the row, not the stack
    got = load_tree(buf.getvalue())
    assert all(torch.equal(got["model"][k], st[k][2]) for k in st) and len(buf.getvalue()) < 400
    assert stacked_rows(rows_of(st)[1:4]) == (st, [1, 2, 3])
    assert stacked_rows([r, dict(r.items())]) is None and stacked_rows([r, Rows(dict(st), 1)]) is None


def test_rows_of_several_groups_reduce_bit_for_bit():
    """A group trained in chunks (backend.max_group) uploads rows of one stack per chunk: the scan carries its sum
    from chunk to chunk, in the states' order, bit for bit the per-state result."""
    a, b = _stacks(3, torch.float32), _stacks(4, torch.float32)
    b = {k: v.flip(0).contiguous() for k, v in b.items()}
    rows = rows_of(a) + rows_of(b)
    plain = [{k: v.clone() for k, v in r.items()} for r in rows]
    w = [3, 1, 4, 1, 5, 9, 2]
    x, y = shared_maths.weighted_average_states(rows, w), shared_maths.weighted_average_states(plain, w)
    assert all(_same(x[k], y[k]) for k in x)
