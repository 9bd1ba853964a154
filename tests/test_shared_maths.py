"""Hand-computed examples for the shared maths (prototype means, aggregation, FedProto's loss, FedAvg)."""
import torch

from raysim.shared_maths import (aggregate_prototypes, class_prototypes, nearest_prototype,
                                 prototype_regulariser, weighted_average_states)


def test_class_prototypes_are_per_class_means():
    z = torch.tensor([[1.0, 2.0], [3.0, 4.0], [10.0, 0.0], [0.0, 0.0], [5.0, 5.0]])
    y = torch.tensor([0, 0, 2, 2, 2])
    classes, protos, counts = class_prototypes(z, y, num_classes=4)
    assert classes.tolist() == [0, 2]
    assert counts.tolist() == [2, 3]
    assert torch.allclose(protos, torch.tensor([[2.0, 3.0], [5.0, 5.0 / 3]]))


def test_weighted_and_mean_prototype_aggregation():
    # client A: class 0 -> (0, 0) from 1 sample, class 1 -> (2, 2) from 3 samples
    # client B: class 0 -> (4, 8) from 3 samples
    a = (torch.tensor([0, 1]), torch.tensor([[0.0, 0.0], [2.0, 2.0]]), torch.tensor([1, 3]))
    b = (torch.tensor([0]), torch.tensor([[4.0, 8.0]]), torch.tensor([3]))
    w, mask = aggregate_prototypes([a, b], num_classes=3, dim=2, mode="weighted")
    assert mask.tolist() == [True, True, False]
    assert torch.allclose(w[0], torch.tensor([3.0, 6.0]))  # (1*(0,0) + 3*(4,8)) / 4
    assert torch.allclose(w[1], torch.tensor([2.0, 2.0]))
    assert torch.all(w[2] == 0)
    m, _ = aggregate_prototypes([a, b], num_classes=3, dim=2, mode="mean")
    assert torch.allclose(m[0], torch.tensor([2.0, 4.0]))  # plain mean over clients (official code)


def test_fedproto_loss_matches_hand_computation():
    z = torch.tensor([[1.0, 3.0], [2.0, 2.0], [0.0, 4.0]], requires_grad=True)
    y = torch.tensor([0, 1, 2])
    protos = torch.tensor([[0.0, 1.0], [2.0, 0.0], [9.0, 9.0]])
    mask = torch.tensor([True, True, False])  # class 2 has no global prototype yet
    # squared errors: row0 (1,4) -> 1+4 = 5; row1 (0,4) -> 0+4 = 4; row2 target = itself -> 0; mean over 3*2 = 6
    loss = prototype_regulariser(z, y, protos, mask)
    assert torch.isclose(loss, torch.tensor(9.0 / 6))
    loss.backward()  # the row without a prototype gets no gradient
    assert torch.all(z.grad[2] == 0)
    assert torch.allclose(z.grad[0], 2 * torch.tensor([1.0, 2.0]) / 6)


def test_nearest_prototype_restricted_to_candidates():
    protos = torch.tensor([[0.0, 0.0], [10.0, 10.0], [1.0, 1.0]])
    z = torch.tensor([[0.9, 0.9], [9.0, 9.0]])
    everyone = torch.tensor([True, True, True])
    assert nearest_prototype(z, protos, everyone).tolist() == [2, 1]
    only_0_1 = torch.tensor([True, True, False])
    assert nearest_prototype(z, protos, only_0_1).tolist() == [0, 1]


def test_weighted_average_states_uses_sample_counts_and_keeps_int_buffers():
    s1 = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(5)}
    s2 = {"w": torch.tensor([4.0, 8.0]), "n": torch.tensor(7)}
    out = weighted_average_states([s1, s2], [1, 2])
    assert torch.allclose(out["w"], torch.tensor([3.0, 6.0]))
    assert out["n"].item() == 5
