"""Tensors through Ray's object store as raw bytes (raysim/backends/ray_serialization.py): values, dtypes, shapes
and flags survive an actor round trip, the receiver owns writable memory, and other tensor kinds keep torch's
reducer."""
import pytest
import torch

from raysim.backends import ray_serialization as rs

pytestmark = pytest.mark.ray


def _examples():
    return {"f32": torch.randn(3, 4), "i64": torch.arange(5), "bf16": torch.tensor([2.5, -1.0], dtype=torch.bfloat16),
            "empty": torch.zeros(0, 3), "scalar": torch.tensor(7.0), "transposed": torch.randn(4, 3).t(),
            "bool": torch.tensor([True, False, True]), "grad": torch.randn(2, requires_grad=True),
            "param": torch.nn.Parameter(torch.randn(2)), "slice": torch.randn(6, dtype=torch.float64)[1:4],
            "u8": torch.tensor([0, 255], dtype=torch.uint8)}


def test_round_trip_without_ray_is_exact():
    for k, t in _examples().items():
        back = rs._deserialize(rs._serialize(t))
        assert type(back) is type(t) and back.dtype == t.dtype and back.shape == t.shape, k
        assert back.requires_grad == t.requires_grad, k
        assert torch.equal(back.detach(), t.detach()), k


def test_actor_round_trip_is_exact_and_the_store_is_not_modified(ray_session):
    ray = ray_session
    rs.register()

    @ray.remote(num_cpus=0)  # runs beside the warm actors that the session keeps (they hold its CPUs)
    def touch(x):
        x["f32"].add_(1.0)  # the received tensor is the receiver's own memory
        return x

    sent = _examples()
    ref = ray.put(sent)
    got = ray.get(touch.remote(ref))
    again = ray.get(ref)
    for k, t in sent.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        if k != "f32":
            assert torch.equal(got[k].detach(), t.detach()), k
    assert torch.equal(got["f32"], sent["f32"] + 1.0)
    assert torch.equal(again["f32"], sent["f32"])  # the stored object is unchanged
    assert got["grad"].requires_grad and type(got["param"]) is torch.nn.Parameter


def test_raw_path_is_used_for_plain_cpu_tensors():
    assert rs._serialize(torch.randn(3))[0] == "raw"
    assert rs._serialize(torch.nn.Parameter(torch.randn(3)))[0] == "pickle"
    assert rs._serialize(torch.randn(3).to_sparse())[0] == "pickle"
