"""The privacy boundary: for every registered method, what reaches the server is only the message kinds the method
declares, never a client's data, and its size is exactly what the table accounts."""
import pytest

from raysim import testing
from raysim.engine.prepare import prepare
from raysim.config.registry import ALGORITHMS

NAMES = sorted(n for n, t in ALGORITHMS.items() if t.startswith("algorithms."))


# Model parameters and updates: a row of a first layer's update is a combination of the inputs it saw (with one
# active sample, a scaled copy of it: the gradient leakage that inversion attacks use), so in these messages only a
# verbatim copy of a sample counts; every other message must not hold a sample up to dtype, scale or offset.
MODEL_KINDS = {"weights", "head_weights", "body_weights", "model_delta", "control_delta", "compressed_weights"}


def find_private_rows(tensors, clients, threshold: float = 0.9999, verbatim: bool = False) -> list:
    """(tensor index, row) of every row of an uploaded tensor (any dtype, cut into rows of one sample's size) whose
    Pearson correlation with one of the clients' samples (train, validation or test) is >= ``threshold``: a copy of
    the sample up to dtype, scale and offset (e.g. its uint8 pixels, a normalised or doubled copy). ``verbatim``:
    only rows equal to a sample (after a cast to float64)."""
    import torch

    xs = [x for c in clients for x in (c.x_train, c.x_val, c.x_test) if x is not None and len(x)]
    width = xs[0][0].numel()
    private = torch.cat([x.reshape(len(x), -1).to(torch.float64) for x in xs])
    private = private - private.mean(1, keepdim=True)
    private = private / private.norm(dim=1, keepdim=True).clamp(min=1e-12)
    out = []
    for k, t in enumerate(tensors):
        if t.numel() < width or t.numel() % width or t.dtype == torch.bool:
            continue
        rows = t.detach().reshape(-1, width).to(torch.float64)
        if verbatim:
            raw = torch.cat([x.reshape(len(x), -1).to(torch.float64) for x in xs])
            same = (rows[:, None, :] == raw[None, :, :]).all(2).any(1)
            out += [(k, r) for r in torch.nonzero(same).flatten().tolist()]
            continue
        rows = rows - rows.mean(1, keepdim=True)
        norms = rows.norm(dim=1, keepdim=True)
        rows = rows / norms.clamp(min=1e-12)
        corr = (rows @ private.T).amax(1)
        hit = torch.nonzero((corr >= threshold) & (norms.flatten() > 1e-9)).flatten().tolist()
        out += [(k, r) for r in hit]
    return out


def test_the_leak_detector_finds_copies_in_any_dtype_scale_or_split(tiny):
    """The detector the next test relies on: a sample of x_train, x_val or x_test, copied as float64, scaled,
    offset or as uint8 pixels, is found; model-like random weights of the same width are not."""
    import torch

    prep = prepare(tiny(data={"dataset": "digits", "num_clients": 3, "partition": "iid", "val_fraction": 0.2,
                              "partition_params": {"samples_per_client": 20, "test_per_client": 5}}))
    c = prep.fed_data.clients[1]
    assert len(c.x_val) and len(c.x_test)
    x = c.x_train[3].flatten()
    copies = [x.to(torch.float64), 2.5 * x + 0.1, torch.cat([torch.randn(x.numel()), x.clone()]),
              ((x - x.min()) / (x.max() - x.min()) * 255).round().to(torch.uint8),
              c.x_val[0].flatten().clone(), c.x_test[-1].flatten().clone()]
    for t in copies:
        assert find_private_rows([t], prep.fed_data.clients), t.dtype
    assert find_private_rows([torch.stack([torch.randn(x.numel()), x])], prep.fed_data.clients, verbatim=True)
    assert not find_private_rows([2.0 * x], prep.fed_data.clients, verbatim=True)
    torch.manual_seed(0)
    assert not find_private_rows([torch.randn(32, x.numel())], prep.fed_data.clients)


@pytest.mark.parametrize("name", NAMES)
def test_only_declared_kinds_reach_the_server(tiny, name):
    """raysim.testing.check_message_accounting (declared kinds only, exact sizes against the table), then no upload
    holds a client's samples."""
    from tests.conftest import method_overrides

    cfg = tiny(rounds=2, clients_per_round=4, algorithm={"name": name, "params": {}}, **method_overrides(name))
    seen = testing.check_message_accounting(cfg)
    clients = prepare(cfg).fed_data.clients
    # train, validation or test samples: verbatim in model parameters and updates, in any dtype, scale or offset in
    # every other message
    model = [t for u in seen if u.kind in MODEL_KINDS for t in u.tensors]
    other = [t for u in seen if u.kind not in MODEL_KINDS for t in u.tensors]
    leaked = find_private_rows(model, clients, verbatim=True) + find_private_rows(other, clients)
    assert not leaked, f"{name} uploads private samples: {leaked[:3]}"


def test_client_data_is_tagged_private_and_public_data_public(tiny):
    prep = prepare(tiny(data={"dataset": "synthetic", "num_clients": 3, "partition": "iid",
                              "public": {"dataset": "digits", "size": 20}}))
    assert all(c.provenance == "private" for c in prep.fed_data.clients)
    assert prep.fed_data.public.provenance == "public" and prep.task.public is prep.fed_data.public


def test_unused_public_data_are_samples_of_the_clients_classes_that_no_client_holds(tiny):
    """data.public {dataset: <the run's>, size, unused: true} (seed 004's scenario-1 candidates of the same classes):
    drawn from the training pool minus every client's train and validation samples and the server's validation set."""
    import torch

    from raysim.errors import DataError

    data = {"dataset": "synthetic", "num_clients": 4, "partition": "iid", "partition_params": {"samples_per_client": 40},
            "val_fraction": 0.25, "server_val": 50, "public": {"dataset": "synthetic", "size": 300, "unused": True}}
    prep = prepare(tiny(data=data))
    pub = prep.fed_data.public
    held = torch.cat([torch.cat([c.x_train, c.x_val]) for c in prep.fed_data.clients]
                     + [prep.fed_data.server_val.x]).flatten(1)
    assert len(pub) == 300 and pub.provenance == "public"
    assert set(pub.y.tolist()) == set(range(10))  # the clients' classes
    assert not (torch.cdist(pub.x.flatten(1), held) == 0).any()  # no sample any client or the server holds
    with pytest.raises(DataError, match="data.public.unused"):
        prepare(tiny(data=dict(data, public={"dataset": "digits", "size": 10, "unused": True})))
    with pytest.raises(DataError, match="data.public.size"):
        prepare(tiny(data=dict(data, public={"dataset": "synthetic", "size": 10**6, "unused": True})))
    with pytest.raises(DataError, match="data.public.unused"):  # a quoted "false" is not false
        prepare(tiny(data=dict(data, public={"dataset": "synthetic", "size": 10, "unused": "false"})))
    with pytest.raises(DataError, match="data.public.root"):
        prepare(tiny(data=dict(data, public={"dataset": "synthetic", "size": 10, "unused": True, "root": "/x"})))
    with pytest.raises(DataError, match="data.rotations"):
        prepare(tiny(data=dict(data, rotations=[0, 90])))
