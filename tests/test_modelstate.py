"""raysim.modelstate (issue 48): a live model's weights in and out without nn.Module's generic state-dict machinery,
the same tensors and copies as ``state_dict(keep_vars=True)`` / ``load_state_dict`` — torch's own code wherever the
tree needs it (hooks, classes that save or load their own way, mismatches: torch's errors)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from raysim.models import cnn4, lenet, resnet_small
from raysim.modelstate import _tensors, live_state, load_live


@pytest.mark.parametrize("build", [lambda: cnn4((3, 32, 32), 10), lambda: lenet((1, 28, 28), 10),
                                   lambda: resnet_small((3, 32, 32), 10)])
def test_same_tensors_and_copies_as_torch(build):
    torch.manual_seed(0)
    a, b = build(), build()
    ref = a.state_dict(keep_vars=True)
    got = live_state(a)
    assert list(got) == list(ref) and all(got[k] is ref[k] for k in ref)
    src = {k: v.detach().clone() + 1 if v.is_floating_point() else v.detach().clone() for k, v in ref.items()}
    load_live(a, src)
    b.load_state_dict(src)
    for (k, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), k
    assert all(p.requires_grad for p in a.parameters())


def test_trees_that_need_torch_go_to_torch():
    m = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))  # BatchNorm loads its own way
    assert _tensors(m) is None
    assert list(live_state(m)) == list(m.state_dict())
    hooked = nn.Sequential(nn.Linear(3, 4))
    seen = []
    hooked.register_load_state_dict_post_hook(lambda mod, keys: seen.append(1))
    load_live(hooked, hooked.state_dict())
    assert seen == [1]


def test_mismatches_raise_torchs_errors():
    m = nn.Sequential(nn.Linear(3, 4))
    with pytest.raises(RuntimeError, match="Missing key"):
        load_live(m, {"0.weight": torch.zeros(4, 3)})
    with pytest.raises(RuntimeError, match="size mismatch"):
        load_live(m, {"0.weight": torch.zeros(4, 2), "0.bias": torch.zeros(4)})
    with pytest.raises(RuntimeError, match="Unexpected key"):
        load_live(m, {"0.weight": torch.zeros(4, 3), "0.bias": torch.zeros(4), "x": torch.zeros(1)})
