"""Algorithm maths by hand: PN-ICFL's prototypical-network pieces, FML's and FedKD's distillation losses, FedPU's
objective, MAFML's flat-gradient plumbing and its whole client update (a local and a global step of eq. 1-7, Adam
included), and FedGen's server generator objective (with its Adam step) and client regulariser.

Every expected number is written out from the documented formula on a 2-3 element example (``math.log`` /
``math.exp`` on explicit values), never by calling the function under test or a copy of its code. Where a method's
losses live inside its client update (FML, FedKD), the update is driven on tiny linear models whose logits and
embeddings are set by hand, for one SGD step without momentum, and both the reported loss (measured before the step)
and the step itself (lr x the closed-form gradient) are checked."""
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn

from raysim.algorithm import ModelCache
from raysim.config import TrainConfig
from raysim.messages import Message
from raysim import rng as rngmod


# -- small closed-form helpers (plain Python floats) -----------------------------------------------------------------

def softmax(row):
    e = [math.exp(v) for v in row]
    s = sum(e)
    return [v / s for v in e]


def kl_rows(p_rows, q_rows):
    """(1 / B) sum_i sum_c p_ic (ln p_ic - ln q_ic): KL(p || q) with ``batchmean``."""
    tot = sum(p * (math.log(p) - math.log(q)) for pr, qr in zip(p_rows, q_rows) for p, q in zip(pr, qr))
    return tot / len(p_rows)


def ce_rows(logit_rows, labels):
    """Mean over the rows of -ln softmax(row)[label]."""
    return sum(-math.log(softmax(r)[y]) for r, y in zip(logit_rows, labels)) / len(labels)


def close(t, want, tol=1e-6):
    return torch.allclose(torch.as_tensor(t, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                          atol=tol, rtol=0)


# == 1. PN-ICFL ======================================================================================================

def test_pnicfl_sq_dists_are_squared_euclidean_by_hand():
    from algorithms.pnicfl_maths import sq_dists

    z = torch.tensor([[0.0, 0.0], [1.0, 2.0]])
    protos = torch.tensor([[1.0, 0.0], [0.0, 3.0], [-1.0, -1.0]])
    # z0 = (0, 0): (1 + 0, 0 + 9, 1 + 1); z1 = (1, 2): (0 + 4, 1 + 1, 4 + 9) -- squared, not square-rooted
    assert sq_dists(z, protos).tolist() == [[1.0, 9.0, 2.0], [4.0, 2.0, 13.0]]


def test_pnicfl_proto_loss_by_hand():
    from algorithms.pnicfl_maths import proto_loss

    zq = torch.tensor([[0.0, 0.0], [1.0, 2.0]])
    protos = torch.tensor([[1.0, 0.0], [0.0, 3.0]])
    # squared distances: row 0 (1, 9), row 1 (4, 2); both queries labelled 0.
    # -log softmax(-d)[0]: row 0: 1 + ln(e^-1 + e^-9); row 1: 4 + ln(e^-4 + e^-2)
    yq = torch.tensor([0, 0])
    want = (1 + math.log(math.exp(-1) + math.exp(-9)) + 4 + math.log(math.exp(-4) + math.exp(-2))) / 2
    loss, acc = proto_loss(zq, yq, protos)
    assert float(loss) == pytest.approx(want, rel=1e-6)
    assert float(acc) == 0.5  # row 1 is nearer prototype 1
    # labels (0, 1): both right; the loss of row 1 becomes 2 + ln(e^-4 + e^-2)
    loss, acc = proto_loss(zq, torch.tensor([0, 1]), protos)
    want = (1 + math.log(math.exp(-1) + math.exp(-9)) + 2 + math.log(math.exp(-4) + math.exp(-2))) / 2
    assert float(loss) == pytest.approx(want, rel=1e-6)
    assert float(acc) == 1.0


def test_pnicfl_user_embedding_by_hand():
    from algorithms.pnicfl_maths import user_embedding

    z = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 0.0]])
    y = torch.tensor([2, 0, 2])
    u, counts = user_embedding(z, y, 4)
    # class 0: (3, 4); class 2: mean of (1, 2) and (5, 0) = (3, 1); classes 1 and 3 absent: zero rows
    assert u.tolist() == [[3.0, 4.0], [0.0, 0.0], [3.0, 1.0], [0.0, 0.0]]
    assert counts.dtype == torch.int64 and counts.tolist() == [1, 0, 2, 0]


def _episode_labels():
    # labels 1, 3, 7 have 10 samples each; label 5 has 3 (fewer than n_support + n_query = 5); label 9 is not offered
    y = [1] * 10 + [3] * 10 + [5] * 3 + [7] * 10 + [9] * 4
    return torch.tensor(y)


def test_pnicfl_sample_episode_shapes_classes_and_disjointness():
    from algorithms.pnicfl_maths import sample_episode

    y = _episode_labels()
    yn = y.numpy()
    classes = [1, 3, 5, 7]
    for seed in range(5):
        ep, sup, qry = sample_episode(y, classes, 2, 2, 3, np.random.default_rng(seed))
        assert len(ep) == 2 and len(set(ep)) == 2 and set(ep) <= set(classes)  # class labels, not positions
        assert ep == sorted(ep)
        assert len(sup) == len(qry) == 2
        for c, s, q in zip(ep, sup, qry):
            assert len(s) == 2 and len(q) == 3
            assert (yn[s] == c).all() and (yn[q] == c).all()
        # n_way above the offered classes is capped; label 9 (not offered) never appears
        ep, sup, qry = sample_episode(y, classes, 10, 2, 3, np.random.default_rng(seed))
        assert ep == classes
        for c, s, q in zip(ep, sup, qry):
            assert len(s) == 2 and len(q) == 3 and (yn[s] == c).all() and (yn[q] == c).all()
            picked = np.concatenate([s, q])
            if c != 5:  # enough samples: 5 distinct ones, support and query disjoint
                assert len(set(picked.tolist())) == 5 and not set(s.tolist()) & set(q.tolist())
            else:  # 3 samples for 5 slots: drawn with replacement, from that class only
                assert set(picked.tolist()) <= set(np.flatnonzero(yn == 5).tolist())


def test_pnicfl_sample_episode_is_deterministic_in_its_generator():
    from algorithms.pnicfl_maths import sample_episode

    y = _episode_labels()
    classes = [1, 3, 5, 7]

    def draw(seed):
        ep, sup, qry = sample_episode(y, classes, 2, 2, 3, np.random.default_rng(seed))
        return ep, [s.tolist() for s in sup], [q.tolist() for q in qry]

    assert draw(11) == draw(11)
    assert len({repr(draw(s)) for s in range(6)}) > 1  # the generator, not a constant, decides


def test_pnicfl_episode_losses_by_hand():
    from algorithms.pnicfl_maths import episode_losses

    # the body is the identity, so x holds the embeddings themselves
    x = torch.tensor([[0.0, 0.0], [2.0, 0.0], [1.0, 1.0],    # label 3: support rows 0, 1; query row 2
                      [0.0, 4.0], [0.0, 2.0], [1.0, 0.5]])   # label 7: support rows 3, 4; query row 5
    ep = [3, 7]
    sup = [np.array([0, 1]), np.array([3, 4])]
    qry = [np.array([2]), np.array([5])]
    # support prototypes: (1, 0) and (0, 3). query (1, 1): d = (1, 5); query (1, .5): d = (0.25, 7.25) (misclassified)
    l0 = 1 + math.log(math.exp(-1) + math.exp(-5))
    l1 = 7.25 + math.log(math.exp(-0.25) + math.exp(-7.25))
    loss, acc, lg = episode_losses(nn.Identity(), x, (ep, sup, qry))
    assert float(loss) == pytest.approx((l0 + l1) / 2, rel=1e-6)
    assert float(acc) == 0.5 and lg is None

    # PN-ICFL+: the cluster prototypes E^3 = (0, 0), E^7 = (0, 2) replace the support means
    cluster = torch.zeros(8, 2)
    cluster[7] = torch.tensor([0.0, 2.0])
    mask = torch.zeros(8, dtype=torch.bool)
    mask[3] = mask[7] = True
    # query (1, 1): d = (2, 2) -> ln 2; query (1, .5): d = (1.25, 3.25) -> 3.25 + ln(e^-1.25 + e^-3.25)
    g = (math.log(2) + 3.25 + math.log(math.exp(-1.25) + math.exp(-3.25))) / 2
    loss2, _, lg = episode_losses(nn.Identity(), x, (ep, sup, qry), cluster, mask)
    assert float(loss2) == pytest.approx((l0 + l1) / 2, rel=1e-6)  # L_proto does not depend on the cluster
    assert float(lg) == pytest.approx(g, rel=1e-6)
    # no episode class has a cluster prototype: no L_g
    assert episode_losses(nn.Identity(), x, (ep, sup, qry), cluster, torch.zeros(8, dtype=torch.bool))[2] is None


class _NoShuffle:
    """A generator stand-in whose permutation keeps the order, so the seed's Algorithm 2 partition is hand-computable."""

    @staticmethod
    def permutation(a):
        return np.asarray(a)


def test_pnicfl_partition_uses_every_sample_exactly_once_by_hand():
    from algorithms.pnicfl_maths import partition_tasks

    y = torch.tensor([0, 0, 0, 1, 1, 2, 0])
    # classes one after the other: 0 -> [0, 1, 2, 6], 1 -> [3, 4], 2 -> [5]; dealt in turn to B = 2 tasks:
    # [0, 1, 2, 6, 3, 4, 5] -> task 0: 0, 2, 3, 5; task 1: 1, 6, 4. Support: the first ceil(m/2) of each class.
    t0, t1 = partition_tasks(y, [0, 1, 2], 2, _NoShuffle())
    assert t0.classes == [0, 1, 2] and t1.classes == [0, 1]
    assert [s.tolist() for s in t0.support] == [[0], [3], [5]] and [q.tolist() for q in t0.query] == [[2], [], []]
    assert [s.tolist() for s in t1.support] == [[1], [4]] and [q.tolist() for q in t1.query] == [[6], []]
    # any generator: every sample of D in exactly one task, as support or query; sizes differ by at most one
    for seed in range(20):
        r = np.random.default_rng(seed)
        yy = torch.as_tensor(r.integers(0, 5, size=int(r.integers(10, 60))))
        b = int(r.integers(1, 6))
        tasks = partition_tasks(yy, sorted(torch.unique(yy).tolist()), b, r)
        used = [int(i) for t in tasks for part in (t.support, t.query) for idx in part for i in idx]
        assert sorted(used) == list(range(len(yy)))
        sizes = [sum(len(s) + len(q) for s, q in zip(t.support, t.query)) for t in tasks]
        assert len(tasks) == b and max(sizes) - min(sizes) <= 1
        for t in tasks:
            for c, s, q in zip(t.classes, t.support, t.query):
                assert (yy[torch.as_tensor(np.concatenate([s, q]))] == c).all() and len(s) >= len(q)


def test_pnicfl_task_losses_by_hand():
    from algorithms.pnicfl_maths import episode_losses, task_losses

    x = torch.tensor([[0.0, 0.0], [2.0, 0.0], [1.0, 1.0],    # label 3: support rows 0, 1; query row 2
                      [0.0, 4.0], [0.0, 2.0], [1.0, 0.5],    # label 7: support rows 3, 4; query row 5
                      [5.0, 5.0]])                           # label 9: support row 6 only
    ep, sup, qry = [3, 7], [np.array([0, 1]), np.array([3, 4])], [np.array([2]), np.array([5])]
    # equal sizes: the episode form's value
    same = task_losses(nn.Identity(), x, (ep, sup, qry))
    ref = episode_losses(nn.Identity(), x, (ep, sup, qry))
    assert float(same[0]) == pytest.approx(float(ref[0]), rel=1e-6) and float(same[1]) == float(ref[1])
    # a support-only class is one more candidate: prototypes (1, 0), (0, 3), (5, 5); query (1, 1): d = (1, 5, 32);
    # query (1, .5): d = (0.25, 7.25, 36.25)
    l0 = 1 + math.log(math.exp(-1) + math.exp(-5) + math.exp(-32))
    l1 = 7.25 + math.log(math.exp(-0.25) + math.exp(-7.25) + math.exp(-36.25))
    task = ([3, 7, 9], sup + [np.array([6])], qry + [np.array([], dtype=np.int64)])
    loss, acc, lg = task_losses(nn.Identity(), x, task)
    assert float(loss) == pytest.approx((l0 + l1) / 2, rel=1e-6) and float(acc) == 0.5 and lg is None
    # PN-ICFL+: E^3 = (0, 0), E^7 = (0, 2), E^9 = (4, 4) (all candidates); query (1, 1): d = (2, 2, 18),
    # query (1, .5): d = (1.25, 3.25, 21.25)
    cluster = torch.zeros(10, 2)
    cluster[7], cluster[9] = torch.tensor([0.0, 2.0]), torch.tensor([4.0, 4.0])
    mask = torch.zeros(10, dtype=torch.bool)
    mask[[3, 7, 9]] = True
    g0 = 2 + math.log(2 * math.exp(-2) + math.exp(-18))
    g1 = 3.25 + math.log(math.exp(-1.25) + math.exp(-3.25) + math.exp(-21.25))
    assert float(task_losses(nn.Identity(), x, task, cluster, mask)[2]) == pytest.approx((g0 + g1) / 2, rel=1e-6)
    # a task without a query: no step
    empty = ([9], [np.array([6])], [np.array([], dtype=np.int64)])
    assert task_losses(nn.Identity(), x, empty) == (None, None, None)


def test_pnicfl_lg_leaves_out_classes_without_a_cluster_prototype():
    from algorithms.pnicfl_maths import episode_losses

    # three episode classes (labels 0, 1, 2), one support and one query each
    x = torch.tensor([[0.0, 0.0], [0.0, 1.0],     # label 0: support (0, 0), query (0, 1)
                      [4.0, 0.0], [3.0, 0.0],     # label 1: support (4, 0), query (3, 0)
                      [0.0, 5.0], [0.0, 4.0]])    # label 2: support (0, 5), query (0, 4)
    ep, sup, qry = [0, 1, 2], [np.array([0]), np.array([2]), np.array([4])], [np.array([1]), np.array([3]),
                                                                              np.array([5])]
    cluster = torch.tensor([[0.0, 2.0], [9.0, 9.0], [2.0, 0.0]])
    mask = torch.tensor([True, False, True])  # class 1 has no cluster prototype: its query and E^1 are left out
    # L_g over the queries of labels 0 and 2 against (E^0, E^2) = ((0, 2), (2, 0)):
    # (0, 1): d = (1, 5) -> 1 + ln(e^-1 + e^-5); (0, 4): d = (4, 20) -> 20 + ln(e^-4 + e^-20)
    g = (1 + math.log(math.exp(-1) + math.exp(-5)) + 20 + math.log(math.exp(-4) + math.exp(-20))) / 2
    _, _, lg = episode_losses(nn.Identity(), x, (ep, sup, qry), cluster, mask)
    assert float(lg) == pytest.approx(g, rel=1e-6)
    # L_proto: queries against the support rows (0, 0), (4, 0), (0, 5)
    # (0, 1): d = (1, 17, 16); (3, 0): d = (9, 1, 34); (0, 4): d = (16, 32, 1) -- each nearest its own class
    lse = lambda ds: math.log(sum(math.exp(-d) for d in ds))
    want = ((1 + lse([1, 17, 16])) + (1 + lse([9, 1, 34])) + (1 + lse([16, 32, 1]))) / 3
    loss, acc, _ = episode_losses(nn.Identity(), x, (ep, sup, qry), cluster, mask)
    assert float(loss) == pytest.approx(want, abs=1e-6) and float(acc) == 1.0  # float32: a small loss


def test_pnicfl_episode_gradient_reaches_the_support_samples():
    from algorithms.pnicfl_maths import episode_losses

    # Snell et al.: the prototypes are means of the support embeddings, not constants, so the loss has a gradient on
    # the support rows. Queries (1, 1) and (1, .5) as above.
    x = torch.tensor([[0.0, 0.0], [2.0, 0.0], [1.0, 1.0], [0.0, 4.0], [0.0, 2.0], [1.0, 0.5]], requires_grad=True)
    loss, _, _ = episode_losses(nn.Identity(), x, ([3, 7], [np.array([0, 1]), np.array([3, 4])],
                                                       [np.array([2]), np.array([5])]))
    loss.backward()
    # -log p(y | q) = d_y + ln sum_k e^{-d_k} with d_k = ||q - c_k||^2, so d(-log p_y)/d c_A = (1[y = A] - p_A) * -2 (q - c_A).
    # Query (1, 1), class A, c_A = (1, 0): (1 - p_A) * -2 (0, 1); query (1, .5), class B: -p_A * -2 (0, .5).
    pa1 = math.exp(-1) / (math.exp(-1) + math.exp(-5))          # query (1, 1): p of its own class A
    pa2 = math.exp(-0.25) / (math.exp(-0.25) + math.exp(-7.25))  # query (1, .5): p of the wrong class A
    g_ca = [0.0, (-2 * (1 - pa1) + pa2) / 2]  # mean over the 2 queries
    # c_A is the mean of support rows 0 and 1: each gets half of it
    assert close(x.grad[0], [g / 2 for g in g_ca], 1e-6) and close(x.grad[1], [g / 2 for g in g_ca], 1e-6)
    assert float(x.grad[3].abs().sum()) > 0 and float(x.grad[4].abs().sum()) > 0


# == 2. FML ==========================================================================================================

class Lin(nn.Module):
    """logits = x W^T (no bias): with x = I, sample i's logits are column i of W."""

    def __init__(self, c, d):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(c, d))
        self.embed_dim = d

    def forward(self, x, return_embedding=False):
        z = x @ self.w.T
        return (z, x) if return_embedding else z


def test_fml_kl_is_batchmean_and_detaches_the_teacher():
    from algorithms.fml import kl

    s = torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0]], requires_grad=True)  # q = (1/4, 3/4), (1/2, 1/2)
    t = torch.tensor([[0.0, 0.0], [math.log(4.0), 0.0]], requires_grad=True)  # p = (1/2, 1/2), (4/5, 1/5)
    # KL(p || q) summed over the batch, divided by B = 2 (not by the 4 elements)
    tot = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75) + 0.8 * math.log(0.8 / 0.5) + 0.2 * math.log(0.2 / 0.5)
    got = kl(s, t)
    assert float(got.detach()) == pytest.approx(tot / 2, rel=1e-6)
    assert abs(float(got.detach()) - tot / 4) > 1e-2  # element-wise mean would be half of it
    got.backward()
    assert t.grad is None  # the teacher is detached
    # d/ds of batchmean KL = (q - p) / B
    assert close(s.grad, [[(0.25 - 0.5) / 2, (0.75 - 0.5) / 2], [(0.5 - 0.8) / 2, (0.5 - 0.2) / 2]])


def _fml_setup(alpha, beta, lr=0.1):
    from algorithms.fml import FML

    cfg = TrainConfig(local_epochs=1, batch_size=2, optimizer="sgd", lr=lr, momentum=0.0, local_steps=1)
    task = SimpleNamespace(train=cfg, build_model=lambda cid: Lin(3, 2), rounds=1)
    algo = FML(FML.Params(alpha=alpha, beta=beta), task)
    private = Lin(3, 2)
    ctx = SimpleNamespace(model=lambda client_id=None: private, device="cpu", round_idx=0, client_id=1,
                          generator=lambda purpose, device=None: torch.Generator().manual_seed(0),
                          models=ModelCache(task, "cpu"))
    data = SimpleNamespace(num_train=2, x_train=torch.eye(2), y_train=torch.tensor([0, 1]))
    return algo, ctx, data


def test_fml_local_and_meme_losses_and_one_step_by_hand():
    alpha, beta, lr = 0.3, 0.8, 0.1
    algo, ctx, data = _fml_setup(alpha, beta, lr)
    zp = [[1.0, 0.0, -1.0], [0.0, 0.0, 2.0]]  # private logits of samples 0 and 1 (labels 0, 1)
    zm = [[0.0, 1.0, 0.0], [2.0, 0.0, 0.0]]  # meme logits
    wp = torch.tensor(zp).T.contiguous()  # x = I: column i of W is sample i's logits
    wm = torch.tensor(zm).T.contiguous()
    state = {"model": {"w": wp.clone()}, "opt": {}, "opt_meme": {}}
    out = algo.client_update({"meme": Message("weights", {"w": wm.clone()})}, state, data, ctx)

    p = [softmax(r) for r in zp]
    q = [softmax(r) for r in zm]
    y = [0, 1]
    # L_local = alpha CE(private) + (1 - alpha) KL(p_meme || p_private); L_meme = beta CE(meme) + (1 - beta) KL(p || q)
    want_local = alpha * ce_rows(zp, y) + (1 - alpha) * kl_rows(q, p)
    want_meme = beta * ce_rows(zm, y) + (1 - beta) * kl_rows(p, q)
    assert out.metrics["train_loss"] == pytest.approx(want_local, rel=1e-6)
    assert out.metrics["train_loss_meme"] == pytest.approx(want_meme, rel=1e-6)
    # the weights are not swapped: with alpha and beta exchanged the numbers differ
    assert abs(want_local - (beta * ce_rows(zp, y) + (1 - beta) * kl_rows(q, p))) > 1e-2

    # one SGD step (no momentum, gradients far below the clip of 10). For logits z_i = W x_i with x_i = e_i:
    # d L_local / d z_i = [alpha (p_i - onehot_i) + (1 - alpha)(p_i - q_i)] / B -- the meme side detached; the
    # private model's gradient has no term from L_meme (whose KL detaches the private logits).
    def step(w, own, other, weight):
        g = [[(weight * (own[i][c] - (c == y[i])) + (1 - weight) * (own[i][c] - other[i][c])) / 2 for c in range(3)]
             for i in range(2)]
        return [[w[c][i] - lr * g[i][c] for i in range(2)] for c in range(3)]

    assert close(out.state["model"]["w"], step(wp.tolist(), p, q, alpha))
    assert close(out.upload["meme"]["w"], step(wm.tolist(), q, p, beta))


# == 3. FedKD ========================================================================================================

class KD(nn.Module):
    """h = x * a (element-wise), z = h V^T."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.ones(2))
        self.v = nn.Parameter(torch.eye(2))
        self.embed_dim = 2

    def forward(self, x, return_embedding=False):
        h = x * self.a
        z = h @ self.v.T
        return (z, h) if return_embedding else z


def test_fedkd_mentor_mentee_losses_and_w_h_step_by_hand():
    from algorithms.fedkd import FedKD

    lr = 0.1
    cfg = TrainConfig(local_epochs=1, batch_size=2, optimizer="sgd", lr=lr, momentum=0.0, local_steps=1)
    task = SimpleNamespace(train=cfg, build_model=lambda cid: KD(), rounds=1)
    algo = FedKD(FedKD.Params(), task)
    mentor = KD()
    ctx = SimpleNamespace(model=lambda client_id=None: mentor, device="cpu", round_idx=0, client_id=1,
                          generator=lambda purpose, device=None: torch.Generator().manual_seed(0),
                          models=ModelCache(task, "cpu"))
    data = SimpleNamespace(num_train=2, x_train=torch.eye(2), y_train=torch.tensor([0, 1]))
    # mentor: a = (1, 1), V = [[2, 0], [0, -1]] -> h = (1, 0), (0, 1); z = (2, 0), (0, -1)
    # mentee: a = (2, 1), V = [[0, 1], [1, 0]] -> h_g = (2, 0), (0, 1); z_g = (0, 2), (1, 0)
    # W_h = diag(1, 3): W_h h_g = (2, 0), (0, 3)
    state = {"model": {"a": torch.tensor([1.0, 1.0]), "v": torch.tensor([[2.0, 0.0], [0.0, -1.0]])},
             "w_h": {"weight": torch.tensor([[1.0, 0.0], [0.0, 3.0]])}, "opt": {}, "opt_g": {}, "opt_w": {}}
    mentee = Message("compressed_weights", {"a": torch.tensor([2.0, 1.0]), "v": torch.tensor([[0.0, 1.0], [1.0, 0.0]])})
    out = algo.client_update({"mentee": mentee}, state, data, ctx)

    z, zg, y = [[2.0, 0.0], [0.0, -1.0]], [[0.0, 2.0], [1.0, 0.0]], [0, 1]
    ce = (math.log(1 + math.exp(-2)) + math.log(1 + math.e)) / 2
    ce_g = (math.log(1 + math.exp(2)) + math.log(1 + math.e)) / 2
    assert ce_rows(z, y) == pytest.approx(ce) and ce_rows(zg, y) == pytest.approx(ce_g)  # the helper itself
    norm = ce + ce_g
    mse = ((1 - 2) ** 2 + 0 + 0 + (1 - 3) ** 2) / 4  # mean over the 2 x 2 elements
    p, pg = [softmax(r) for r in z], [softmax(r) for r in zg]
    want = ce + kl_rows(pg, p) / norm + mse / norm
    want_g = ce_g + kl_rows(p, pg) / norm + mse / norm
    assert out.metrics["train_loss"] == pytest.approx(want, rel=1e-6)
    assert out.metrics["train_loss_mentee"] == pytest.approx(want_g, rel=1e-6)
    # W_h's gradient comes from the MSE term of both losses (nothing detached): 2 / norm * d MSE / d W_h, with
    # d MSE / d W_h = (2 / 4) sum_i (W_h h_g,i - h_i) h_g,i^T = 0.5 ((1, 0) (2, 0)^T + (0, 2) (0, 1)^T) = diag(1, 1)
    g = 2 / norm * 1.0
    assert close(out.state["w_h"]["weight"], [[1.0 - lr * g, 0.0], [0.0, 3.0 - lr * g]])


# == 4. FedPU ========================================================================================================

def _pu_batch():
    from algorithms.fedpu import PUView
    from algorithms.prototype_maths import UNLABELLED

    # row 0 labelled 0, p = (1/3, 1/3, 1/3); row 1 labelled 2, p = (1/4, 1/4, 1/2); row 2 unlabelled, p = (3/5, 1/5, 1/5)
    logits = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, math.log(2.0)], [math.log(3.0), 0.0, 0.0]])
    y_obs = torch.tensor([0, 2, UNLABELLED])
    view = PUView(y_obs=y_obs, prior=torch.tensor([0.5, 0.3, 0.2]), positive=torch.tensor([1.0, 0.0, 1.0]))
    ce = (math.log(3.0) + math.log(2.0)) / 2  # the labelled rows only
    l_u = (-math.log(1 - 3 / 5) - math.log(1 - 1 / 5)) / (1 * 3)  # m = (1, 0, 1); |U| = 1, C = 3
    l_pc = (0.5 * -math.log(1 - 1 / 3) + 0.2 * -math.log(1 - 1 / 2)) / 2  # pi_y of each labelled row; |P| = 2
    return logits, y_obs, view, ce, l_u - l_pc


def test_fedpu_objective_combines_ce_and_weighted_pu_by_hand():
    from algorithms.fedpu import pu_objective

    logits, y_obs, view, ce, pu = _pu_batch()
    for w in (0.7, 2.0):
        loss, parts = pu_objective(logits, y_obs, view, w)
        assert float(loss) == pytest.approx(ce + w * pu, abs=1e-5)  # eps = 1e-6 inside the logs
        assert float(parts["ce"]) == pytest.approx(ce, rel=1e-6)
        assert float(parts["pu"]) == pytest.approx(pu, abs=1e-5)
    # pu_weight = 0: the labelled CE alone (the unlabelled row does not enter it)
    loss, parts = pu_objective(logits, y_obs, view, 0.0)
    assert float(loss) == pytest.approx(ce, rel=1e-6) and parts["pu"] == 0.0
    # a batch with no labelled row: CE = 0, L_Pc = 0, so L = w * L_U of the row (3/5, 1/5, 1/5)
    loss, _ = pu_objective(logits[2:], y_obs[2:], view, 0.5)
    assert float(loss) == pytest.approx(0.5 * (-math.log(0.4) - math.log(0.8)) / 3, abs=1e-5)


def test_fedpu_ce_loss_through_a_model_with_set_logits():
    from algorithms.fedpu import pu_ce_loss

    logits, y_obs, view, ce, pu = _pu_batch()
    model = nn.Linear(3, 3, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.eye(3))  # model(x) = x
    x = logits.clone().requires_grad_(True)  # model(x) = x: the gradient wrt x is the gradient wrt the logits
    loss, parts = pu_ce_loss(view, 1.5)(model, x, y_obs, 0)
    assert float(loss.detach()) == pytest.approx(ce + 1.5 * pu, abs=1e-5)
    loss.backward()
    # row 0 (labelled 0, p = 1/3 each): CE gives (p - onehot) / |P| = (-1/3, 1/6, 1/6); -w L_Pc gives
    # -w pi_0 / |P| * d(-ln(1 - p_0))/dz = -w pi_0 / |P| * p_0 / (1 - p_0) * (onehot_0 - p)  (eps neglected)
    k = -1.5 * 0.5 / 2 * (1 / 3) / (2 / 3)
    row0 = [(1 / 3 - 1) / 2 + k * (1 - 1 / 3), (1 / 3) / 2 + k * (-1 / 3), (1 / 3) / 2 + k * (-1 / 3)]
    # row 2 (unlabelled, p = (3/5, 1/5, 1/5), m = (1, 0, 1)): no CE; w L_U gives
    # w / (|U| C) * sum_c m_c p_c / (1 - p_c) (onehot_c - p) = 0.5 * [1.5 (0.4, -0.2, -0.2) + 0.25 (-0.6, -0.2, 0.8)]
    row2 = [0.5 * (1.5 * 0.4 + 0.25 * -0.6), 0.5 * (1.5 * -0.2 + 0.25 * -0.2), 0.5 * (1.5 * -0.2 + 0.25 * 0.8)]
    assert close(x.grad[0], row0, 1e-5) and close(x.grad[2], row2, 1e-5)


# == 5. MAFML's flat gradients =======================================================================================

class TwoParams(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.zeros(2, 2))
        self.b = nn.Parameter(torch.zeros(3))
        self.c = nn.Parameter(torch.zeros(1))


def test_flat_grad_and_set_flat_grad_round_trip_by_hand():
    from algorithms.mutual_maths import flat_grad, set_flat_grad

    m = TwoParams()
    m.a.grad = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    m.b.grad = torch.tensor([5.0, 6.0, 7.0])
    # c has no gradient: zeros in its slot; order = model.parameters(), row-major
    assert flat_grad(m).tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 0.0]
    g = torch.arange(8.0)
    set_flat_grad(m, g)
    assert m.a.grad.tolist() == [[0.0, 1.0], [2.0, 3.0]] and m.b.grad.tolist() == [4.0, 5.0, 6.0]
    assert m.c.grad.tolist() == [7.0]
    g[0] = 100.0  # the gradients are copies, not views of the vector
    assert m.a.grad[0, 0] == 0.0
    set_flat_grad(m, flat_grad(m))
    assert flat_grad(m).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]


def test_projected_public_gradient_drives_the_sgd_step():
    from algorithms.mutual_maths import flat_grad, project_conflicting, set_flat_grad

    # MAFML's step (eq. 7) through the model's parameters: linear losses give exact gradients spread over two
    # parameter tensors: g_loc = (1, 1, 0), g_pub = (-1, 0, 2) -- dot -1 < 0, ||g_loc||^2 = 2
    # g~ = g_pub - (-1 / 2) g_loc = (-1/2, 1/2, 2)
    m = nn.Module()
    m.u = nn.Parameter(torch.tensor([1.0, 2.0]))
    m.v = nn.Parameter(torch.tensor([3.0]))
    (m.u @ torch.tensor([1.0, 1.0]) + 0 * m.v.sum()).backward()
    g_loc = flat_grad(m).detach().clone()
    assert g_loc.tolist() == [1.0, 1.0, 0.0]
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    opt.zero_grad(set_to_none=True)
    (m.u @ torch.tensor([-1.0, 0.0]) + 2 * m.v.sum()).backward()
    g, fired = project_conflicting(flat_grad(m), g_loc)
    assert fired
    set_flat_grad(m, g)
    opt.step()
    assert close(m.u.detach(), [1.0 + 0.25, 2.0 - 0.25]) and close(m.v.detach(), [3.0 - 1.0])


# == 6. MAFML's client update (eq. 1-7): one local step, then one global step ========================================

def adam_steps(w, grads, lrs, b1=0.9, b2=0.999, eps=1e-8):
    """Adam (Kingma & Ba, Algorithm 1) on one scalar: m, v moments with bias correction,
    w <- w - lr * m_hat / (sqrt(v_hat) + eps), one step per (gradient, learning rate)."""
    m = v = 0.0
    for t, (g, lr) in enumerate(zip(grads, lrs), start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        w = w - lr * (m / (1 - b1 ** t)) / (math.sqrt(v / (1 - b2 ** t)) + eps)
    return w


@pytest.mark.parametrize("project", [True, False])
def test_mafml_local_and_global_step_by_hand(project):
    """Node 1 of 3 on a linear model z = W x (2 classes, 2 features, no bias). Local step (eq. 1-2): a batch of its
    two private samples e_0 (label 0) and e_1 (label 1), g_loc = grad CE, Adam step with lr beta; then the soft labels
    and accuracy of its one public sample. Global step (eq. 3-7) against the hand-made uploads of nodes 0 and 2: the
    accuracy-weighted KL and the CE over the two teachers, averaged (N - 1 = 2), the conflict check against g_loc
    and the projection, then a second Adam step (the same Adam state) with lr eta."""
    from algorithms.mafml import MAFML, Teachers

    beta, eta = 0.1, 0.05
    w0 = [[0.5, -0.2], [0.1, 0.3]]  # W[c][k]
    # the public set: sample 0 (1, 1) label 1 of node 0; sample 1 (1, 0) label 1 of node 1; sample 2 (0, 1) label 0
    # of node 2
    pub = SimpleNamespace(x=torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 1.0]]), y=torch.tensor([1, 1, 0]),
                          owner=torch.tensor([0, 1, 2]))
    cfg = TrainConfig(local_epochs=1, batch_size=2, optimizer="adam", lr=beta)
    task = SimpleNamespace(train=cfg, build_model=lambda cid: Lin(2, 2), public=pub, num_clients=3, rounds=1)
    algo = MAFML(MAFML.Params(iterations=1, public_lr=eta, project=project), task)
    ctx = SimpleNamespace(client_id=1, device="cpu", round_idx=0, models=ModelCache(task, "cpu"),
                          generator=lambda purpose, device=None: torch.Generator().manual_seed(0))
    data = SimpleNamespace(num_train=2, x_train=torch.eye(2), y_train=torch.tensor([0, 1]))
    state = {"model": {"w": torch.tensor(w0)}, "opt": {}, "g_loc": torch.zeros(0)}

    # -- local step: CE over samples e_0, e_1; dCE/dz_i = (p_i - onehot_i) / 2 lands in column i of W
    out = algo.local({}, state, data, ctx)
    z = [[w0[0][i], w0[1][i]] for i in range(2)]
    p = [softmax(r) for r in z]
    assert out.metrics["train_loss"] == pytest.approx(ce_rows(z, [0, 1]), rel=1e-6)
    g_loc = [[(p[k][c] - (c == k)) / 2 for k in range(2)] for c in range(2)]
    assert close(out.state["g_loc"], [g for row in g_loc for g in row])  # flat, row-major (c, k)
    w1 = [[adam_steps(w0[c][k], [g_loc[c][k]], [beta]) for k in range(2)] for c in range(2)]
    assert close(out.state["model"]["w"], w1)
    # soft labels of its public sample (1, 0), read after the step: z = column 0 of W1; label 1
    s = [w1[0][0], w1[1][0]]
    soft = out.upload["soft"]
    assert soft.kind == "soft_labels" and soft["idx"].tolist() == [1]
    assert close(soft["p"], [softmax(s)])
    assert soft["acc"].tolist() == [float(s[1] > s[0])] == [out.metrics["public_batch_acc"]]

    # -- global step against node 0 (A = 0.5, sample 0, p = (0.7, 0.3)) and node 2 (A = 1, sample 2, p = (0.2, 0.8))
    teachers = {0: (0.5, [1.0, 1.0], 1, [0.7, 0.3]), 2: (1.0, [0.0, 1.0], 0, [0.2, 0.8])}
    uploads = {**teachers, 1: (1.0, None, 0, [0.5, 0.5])}  # the relay forwards node 1's own upload too
    relayed = {"teachers": Teachers(teachers={
        j: Message("soft_labels", {"idx": torch.tensor([j]), "p": torch.tensor([pj]), "acc": torch.tensor([a])})
        for j, (a, _, _, pj) in uploads.items()})}
    # node 1 downloads the relay's message without its own soft labels, and only in its global step
    payload = algo.downlink(relayed, 1, SimpleNamespace(step="global"))
    assert sorted(payload["teachers"].teachers) == [0, 2]
    assert algo.downlink(relayed, 1, SimpleNamespace(step="local")) == {}
    glob = algo.step_global(payload, out.state, data, ctx)
    kl = ce = 0.0
    g_pub = [[0.0, 0.0], [0.0, 0.0]]
    for a, x, y, pj in teachers.values():
        zs = [w1[c][0] * x[0] + w1[c][1] * x[1] for c in range(2)]
        q = softmax(zs)
        kl += a * kl_rows([pj], [q]) / 2  # (1 / (N - 1)) sum_j A_j KL(p_j || q_j)  (eq. 3-4)
        ce += ce_rows([zs], [y]) / 2  # (1 / (N - 1)) sum_j CE  (eq. 5)
        dz = [(a * (q[c] - pj[c]) + (q[c] - (c == y))) / 2 for c in range(2)]  # d(KL + CE)/dz_j
        for c in range(2):
            for k in range(2):
                g_pub[c][k] += dz[c] * x[k]
    assert glob.metrics["train_kl"] == pytest.approx(kl, rel=1e-5)
    assert glob.metrics["train_ce_public"] == pytest.approx(ce, rel=1e-6)
    dot = sum(g_pub[c][k] * g_loc[c][k] for c in range(2) for k in range(2))
    nn2 = sum(g * g for row in g_loc for g in row)
    assert dot < -0.05  # (by construction) the public gradient conflicts with the local one: cos < 0
    if project:  # eq. 7: the component along g_loc removed
        g = [[g_pub[c][k] - dot / nn2 * g_loc[c][k] for k in range(2)] for c in range(2)]
        assert abs(sum(g[c][k] * g_loc[c][k] for c in range(2) for k in range(2))) < 1e-12  # now orthogonal
    else:
        g = g_pub
    assert glob.metrics["projected"] == float(project)
    w2 = [[adam_steps(w0[c][k], [g_loc[c][k], g[c][k]], [beta, eta]) for k in range(2)] for c in range(2)]
    assert close(glob.state["model"]["w"], w2, 1e-6)
    other = [[adam_steps(w0[c][k], [g_loc[c][k], g_pub[c][k] if project else
                                    g_pub[c][k] - dot / nn2 * g_loc[c][k]], [beta, eta]) for k in range(2)]
             for c in range(2)]
    assert not close(glob.state["model"]["w"], other, 1e-4)  # the projection moves the weights measurably
    assert glob.state["g_loc"].numel() == 0 and glob.upload == {}


# == 7. FedGen: the server's generator objective and the client's regulariser ========================================

class HeadLin(nn.Module):
    """An identity body (the embedding is the input) and a linear head without bias: logits = H x."""

    def __init__(self, d=2, c=3):
        super().__init__()
        self.head = nn.Linear(d, c, bias=False)
        self.embed_dim = d

    def forward(self, x, return_embedding=False):
        z = self.head(x)
        return (z, x) if return_embedding else z


def _fedgen(**params):
    from algorithms.fedgen import FedGen

    cfg = TrainConfig(local_epochs=1, batch_size=2, optimizer="sgd", lr=0.1, momentum=0.0)
    task = SimpleNamespace(train=cfg, build_model=lambda cid: HeadLin(), num_classes=3, rounds=3, seed=0)
    return FedGen(FedGen.Params(**params), task)


def _generator_weights(gen):
    """FeatureGenerator (noise 1, 3 classes) -> Linear(4, 3) -> BN(3) -> ReLU -> Linear(3, 2), set by hand."""
    sd = gen.state_dict()
    sd["net.0.weight"] = torch.tensor([[0.5, 1.0, -1.0, 0.2], [-0.3, 0.4, 0.8, -0.6], [1.0, -0.5, 0.3, 0.9]])
    sd["net.0.bias"] = torch.tensor([0.1, -0.2, 0.05])
    sd["net.3.weight"] = torch.tensor([[1.0, -0.5, 0.3], [0.2, 0.7, -1.0]])
    sd["net.3.bias"] = torch.tensor([0.05, -0.1])
    return sd


def _gen_forward(p, eps, y, train):
    """The generator's maths written out: h = W1 [eps, onehot(y)] + b1; BatchNorm (train: the batch's mean and biased
    variance; eval: the running mean 0 and variance 1; eps 1e-5; gamma 1, beta 0); ReLU; z = W2 h + b2."""
    inp = torch.cat([eps, torch.eye(3, dtype=eps.dtype)[y]], dim=1)
    h = inp @ p["net.0.weight"].T + p["net.0.bias"]
    if train:
        mu, var = h.mean(0), h.var(0, unbiased=False)
    else:
        mu, var = torch.zeros(3, dtype=h.dtype), torch.ones(3, dtype=h.dtype)
    h = (h - mu) / torch.sqrt(var + 1e-5) * p["net.1.weight"] + p["net.1.bias"]
    return torch.relu(h) @ p["net.3.weight"].T + p["net.3.bias"]


def test_fedgen_client_regulariser_by_hand():
    """Round 2, decay 0.5 (factor 0.25), alpha 2, beta 3, B_gen 4, B 2: loss = CE(x, y) + (4 / 2) alpha' CE(h(G(eps,
    y_hat)), y_hat) + beta' KL(softmax(h(G(eps, y))) || softmax(h(x))), with y_hat from the client's own labels (here
    only label 1) and the generator in eval mode. The generator ignores its noise (noise weights 0), so every term is
    a closed form."""
    algo = _fedgen(alpha=2.0, beta=3.0, decay=0.5, gen_batch=4, noise_dim=1, hidden=3)
    gen_sd = _generator_weights(algo.make_generator())
    gen_sd["net.0.weight"][:, 0] = 0.0  # G(eps, y) = G(y)
    model = HeadLin()
    h = [[1.0, -1.0], [0.5, 2.0], [-0.5, 0.0]]
    payload = {"model": Message("weights", {"head.weight": torch.tensor(h)}),
               "generator": Message("generator", gen_sd)}
    data = SimpleNamespace(y_train=torch.tensor([1, 1, 1]))
    ctx = SimpleNamespace(round_idx=2, device="cpu", client_id=0, models=ModelCache(algo.task, "cpu"),
                          generator=lambda purpose, device=None: torch.Generator().manual_seed(1),
                          stream=lambda purpose: rngmod.Counter(1))
    start = algo.begin(model, payload, {}, data, ctx)  # client_init, its declared start weights loaded
    loss_fn = algo.objective(start)
    xb, yb = torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 2])
    loss, parts = loss_fn(model, xb, yb, 0)

    p64 = {k: v.to(torch.float64) for k, v in gen_sd.items()}
    head = lambda z: [[sum(h[c][k] * float(z[i][k]) for k in range(2)) for c in range(3)] for i in range(len(z))]
    logits = head(xb)  # rows = columns of H: (1, .5, -.5), (-1, 2, 0)
    ce = ce_rows(logits, [0, 2])
    target = [softmax(r) for r in head(_gen_forward(p64, torch.zeros(2, 1, dtype=torch.float64), yb, train=False))]
    latent = kl_rows(target, [softmax(r) for r in logits])
    z1 = _gen_forward(p64, torch.zeros(1, 1, dtype=torch.float64), torch.tensor([1]), train=False)
    teacher = ce_rows(head(z1), [1])  # every y_hat is 1: the mean over the 4 equals one row
    alpha, beta = 2.0 * 0.25, 3.0 * 0.25
    assert float(parts["ce"]) == pytest.approx(ce, rel=1e-6)
    assert float(parts["teacher"]) == pytest.approx(teacher, rel=1e-5)
    assert float(parts["latent"]) == pytest.approx(latent, rel=1e-5)
    assert float(loss.detach()) == pytest.approx(ce + (4 / 2) * alpha * teacher + beta * latent, rel=1e-5)
    loss.backward()
    assert model.head.weight.grad is not None
    assert all(p.grad is None and not p.requires_grad for p in start.aux["gen"].parameters())  # G frozen
    # round 0, no generator yet: plain CE
    start0 = algo.begin(model, {"model": payload["model"]}, {}, data, ctx)
    loss0, parts0 = algo.objective(start0)(model, xb, yb, 0)
    assert float(loss0.detach()) == pytest.approx(ce, rel=1e-6) and set(parts0) == {"ce"}


def test_fedgen_server_generator_objective_and_adam_step_by_hand():
    """One server step (gen_steps 1) over two uploads whose label counts are (3, 1, 0) and (1, 0, 0): labels drawn
    from the held classes {0, 1} only, w_{0,k} = (3/4, 1/4), w_{1,k} = (1, 0); L_G = mean_b sum_k w_{y_b,k}
    CE(H_k z_b, y_b) + eta exp(-mean_{a,b} mean((eps_a - eps_b)^2) mean|z_a - z_b|), z = G(eps, y) with the
    generator in training mode; the reported gen_loss is L_G before the step, and the new generator is one Adam step
    (lr gen_lr) on its gradient."""
    eta, lr, bsz = 0.7, 0.01, 4
    algo = _fedgen(gen_batch=bsz, gen_steps=1, gen_lr=lr, noise_dim=1, hidden=3, eta=eta)
    sd = _generator_weights(algo.make_generator())
    heads = [[[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]], [[-1.0, 2.0], [0.3, -0.2], [0.0, 1.0]]]
    counts = [[3, 1, 0], [1, 0, 0]]
    uploads = {cid: {"model": Message("weights", {"head.weight": torch.tensor(heads[cid])}),
                     "num_samples": Message("num_samples", {"n": torch.tensor([sum(counts[cid])])}),
                     "label_counts": Message("class_counts", {"counts": torch.tensor(counts[cid])})}
               for cid in (0, 1)}
    ctx = SimpleNamespace(round_idx=0, device="cpu", models=ModelCache(algo.task, "cpu"),
                          generator=lambda purpose, device=None: torch.Generator().manual_seed(4))
    state = {"model": {"head.weight": torch.zeros(3, 2)}, "generator": {k: v.clone() for k, v in sd.items()},
             "trained": torch.zeros((), dtype=torch.bool)}
    new, metrics = algo.aggregate(state, uploads, ctx)

    # the draws, as documented: labels uniform over the held classes (0, 1), then eps ~ U[0, 1)
    g = torch.Generator().manual_seed(4)
    y = torch.tensor([0, 1])[torch.randint(2, (bsz,), generator=g)]
    eps = torch.rand(bsz, 1, generator=g).to(torch.float64)
    assert set(y.tolist()) == {0, 1}  # (this seed) both classes in the batch
    w = {0: [3 / 4, 1 / 4], 1: [1.0, 0.0]}
    params = {k: v.to(torch.float64).requires_grad_(v.is_floating_point() and "running" not in k)
              for k, v in sd.items() if k != "net.1.num_batches_tracked"}
    z = _gen_forward(params, eps, y, train=True)
    zl = z.detach().tolist()
    ens = sum(w[int(yb)][k] * ce_rows([[sum(heads[k][c][j] * zl[b][j] for j in range(2)) for c in range(3)]],
                                      [int(yb)]) for b, yb in enumerate(y) for k in range(2)) / bsz
    e = eps.flatten().tolist()
    pairs = [(e[a] - e[b]) ** 2 * sum(abs(zl[a][j] - zl[b][j]) for j in range(2)) / 2
             for a in range(bsz) for b in range(bsz)]
    div = math.exp(-sum(pairs) / bsz ** 2)
    assert metrics["gen_loss"] == pytest.approx(ens + eta * div, rel=1e-5)
    assert bool(new["trained"])
    # the step: autograd of the written-out loss (a differentiable copy of the same formula), then Adam by hand
    hk = [torch.tensor(hh, dtype=torch.float64) for hh in heads]
    wt = torch.tensor([[3 / 4, 1.0, 0.0], [1 / 4, 0.0, 0.0]], dtype=torch.float64)
    loss_t = sum(wt[k, y] * torch.nn.functional.cross_entropy(z @ hk[k].T, y, reduction="none") for k in range(2)).mean()
    nd = (eps[:, None, :] - eps[None, :, :]).pow(2).mean(2)
    zd = (z[:, None, :] - z[None, :, :]).abs().mean(2)
    loss_t = loss_t + eta * torch.exp(-(nd * zd).mean())
    assert float(loss_t.detach()) == pytest.approx(ens + eta * div, rel=1e-9)  # the copy is the formula above
    loss_t.backward()
    for k, p in params.items():
        if not p.requires_grad:
            continue
        want = [adam_steps(float(v), [float(gv)], [lr]) for v, gv in zip(p.detach().flatten(), p.grad.flatten())]
        got = new["generator"][k].flatten().tolist()
        # elements with a gradient near 0 (the BN shift cancels the first layer's bias) move by an Adam sign step
        # whose sign float32 may not resolve: compare where |g| resolves
        for wv, gv, gt, old in zip(want, p.grad.flatten().tolist(), got, p.detach().flatten().tolist()):
            if abs(gv) > 1e-5:
                assert gt == pytest.approx(wv, abs=1e-6), (k, gv)
            else:
                assert abs(gt - old) <= lr * 1.001, k
    # BatchNorm's running statistics took the batch's (momentum 0.1; unbiased variance)
    h = torch.cat([eps, torch.eye(3, dtype=torch.float64)[y]], 1) @ params["net.0.weight"].detach().T + params["net.0.bias"].detach()
    assert close(new["generator"]["net.1.running_mean"], (0.1 * h.mean(0)).tolist(), 1e-6)
    assert close(new["generator"]["net.1.running_var"], (0.9 + 0.1 * h.var(0, unbiased=True)).tolist(), 1e-6)
