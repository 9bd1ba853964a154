"""The flagship's maths by hand, through the methods themselves: FedProto's local loss (CE + lambda * the prototype
MSE), one local step and the prototypes it uploads (``after`` and ``during_train``), its two prototype aggregations
(count-weighted and plain mean); FedTGP's server step (the adaptive-margin contrastive loss and one SGD step of the
prototype generator); SlaugFL's generator steps (scenario 2: the prototype-guided generator's MSE + mode-seeking
diversity loss and its Adam step; scenario 1: the ACGAN's discriminator and generator losses and Adam steps);
FedDistill's client loss (CE + lambda * T^2 * KL to the global class logits), step and upload.

As in tests/test_maths.py: every expected number comes from the documented formula written out on a 2-4 element
example (plain Python floats with ``math``), never from the code under test; where an optimiser step needs a gradient
through more than one layer, the gradient is autograd's on a float64 copy of the written-out formula (checked equal
to the plain-Python value first) and the update is written out (SGD, or Adam with its bias correction). Models are
tiny linear modules with weights set by hand, so every term is a closed form, and each test fails when one term of
its formula changes (ARCHITECTURE.md, "The maths by hand")."""
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from raysim.config import TrainConfig
from raysim.messages import Message
from raysim.rng import Counter
from tests.test_maths import adam_steps, ce_rows, close, softmax


def matvec(m, v):
    return [sum(m[i][j] * v[j] for j in range(len(v))) for i in range(len(m))]


def sigmoid(s):
    return 1.0 / (1.0 + math.exp(-s))


def mean(xs):
    return sum(xs) / len(xs)


class BodyHead(nn.Module):
    """z = A x (a linear body without bias), logits = H z (a linear head without bias)."""

    def __init__(self, a, h):
        super().__init__()
        self.body = nn.Linear(len(a[0]), len(a), bias=False)
        self.head = nn.Linear(len(h[0]), len(h), bias=False)
        with torch.no_grad():
            self.body.weight.copy_(torch.tensor(a))
            self.head.weight.copy_(torch.tensor(h))
        self.embed_dim = len(a)

    def forward(self, x, return_embedding=False):
        z = self.body(x)
        logits = self.head(z)
        return (logits, z) if return_embedding else logits


def client_ctx(model, round_idx=1):
    return SimpleNamespace(client_id=0, round_idx=round_idx, device="cpu", model=lambda: model,
                           generator=lambda purpose, device=None: torch.Generator().manual_seed(0),
                           stream=lambda purpose: Counter(0))


# == 1. FedProto: loss, step, uploaded prototypes, aggregation ======================================================

A0 = [[1.0, 0.5], [-0.5, 1.0]]  # body: z = A x
H0 = [[1.0, 0.0], [0.0, 1.0], [0.5, -0.5]]  # head: 3 classes
XS = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]
YS = [0, 1, 0]
GLOBAL = {0: [1.0, 0.0], 2: [0.0, 1.0]}  # global prototypes of classes 0 and 2; class 1 has none


def fedproto_by_hand(a, h, lam, protos=GLOBAL):
    """FedProto's loss on the full batch (XS, YS) written out, and its gradient in closed form:
    L = (1/B) sum_b CE(H z_b, y_b) + lam * (1/(B d)) sum_b [y_b has a prototype] ||z_b - P_{y_b}||^2;
    dL/dlogits_b = (softmax - onehot) / B; dL/dz_b = H^T dL/dlogits_b + lam * 2 (z_b - P_{y_b}) / (B d);
    dL/dH = sum_b dL/dlogits_b z_b^T; dL/dA = sum_b dL/dz_b x_b^T. Returns (loss, ce, reg, dA, dH)."""
    b, d, c = len(XS), len(a), len(h)
    zs = [matvec(a, x) for x in XS]
    logits = [matvec(h, z) for z in zs]
    ce = ce_rows(logits, YS)
    reg = sum(sum((zk - pk) ** 2 for zk, pk in zip(z, protos[y])) for z, y in zip(zs, YS) if y in protos) / (b * d)
    d_h = [[0.0] * d for _ in range(c)]
    d_a = [[0.0] * len(a[0]) for _ in range(d)]
    for x, z, lo, y in zip(XS, zs, logits, YS):
        dl = [(p - (k == y)) / b for k, p in enumerate(softmax(lo))]
        dz = [sum(h[k][j] * dl[k] for k in range(c)) for j in range(d)]
        if y in protos:
            dz = [g + lam * 2 * (z[j] - protos[y][j]) / (b * d) for j, g in enumerate(dz)]
        for k in range(c):
            for j in range(d):
                d_h[k][j] += dl[k] * z[j]
        for j in range(d):
            for i in range(len(x)):
                d_a[j][i] += dz[j] * x[i]
    return ce + lam * reg, ce, reg, d_a, d_h


def sgd(w, g, lr):
    return [[wi - lr * gi for wi, gi in zip(wr, gr)] for wr, gr in zip(w, g)]


def class_means(a):
    """(classes, their mean embeddings, counts) of A x over (XS, YS): the prototypes a client uploads."""
    zs = [matvec(a, x) for x in XS]
    classes = sorted(set(YS))
    means = [[mean([z[j] for z, y in zip(zs, YS) if y == c]) for j in range(len(a))] for c in classes]
    return classes, means, [YS.count(c) for c in classes]


def _fedproto(lam=0.5, epochs=1, **params):
    from algorithms.fedproto import FedProto

    cfg = TrainConfig(local_epochs=epochs, batch_size=3, optimizer="sgd", lr=0.1, momentum=0.0)
    task = SimpleNamespace(train=cfg, num_classes=3, num_clients=2, seed=0, build_model=lambda cid: BodyHead(A0, H0))
    return FedProto(FedProto.Params(lam=lam, **params), task)


def _global_payload(protos=GLOBAL):
    classes = sorted(protos)
    return {"global_protos": Message("global_prototypes", {"protos": torch.tensor([protos[c] for c in classes]),
                                                           "classes": torch.tensor(classes)})}


def _client_data():
    return SimpleNamespace(x_train=torch.tensor(XS), y_train=torch.tensor(YS), num_train=3, client_id=0,
                           classes=[0, 1])


def test_fedproto_loss_is_ce_plus_lambda_times_the_prototype_mse_by_hand():
    """L = CE + lambda * MSE(z, P_y) with nn.MSELoss's mean over |B| x d elements (reference §1.4); the class-1 row
    has no global prototype: it adds 0 but counts in the mean. lambda = 0.5. Before any global prototype (round 0):
    CE alone."""
    z = [matvec(A0, x) for x in XS]  # (1, -0.5), (0.5, 1), (1.5, 0.5)
    assert z == [[1.0, -0.5], [0.5, 1.0], [1.5, 0.5]]
    # reg = ((1 - 1)^2 + (-0.5 - 0)^2 + (1.5 - 1)^2 + (0.5 - 0)^2) / (3 * 2) = 0.75 / 6
    ce = ce_rows([matvec(H0, zb) for zb in z], YS)
    reg = 0.75 / 6
    algo = _fedproto(lam=0.5)
    model = BodyHead(A0, H0)
    start = algo.client_init(model, _global_payload(), {"model": model.state_dict()}, _client_data(), client_ctx(model))
    loss, parts = algo.objective(start)(model, torch.tensor(XS), torch.tensor(YS), 0)
    assert float(parts["ce"]) == pytest.approx(ce, rel=1e-6)
    assert float(parts["proto"]) == pytest.approx(reg, rel=1e-6)
    assert float(loss.detach()) == pytest.approx(ce + 0.5 * reg, rel=1e-6)
    assert fedproto_by_hand(A0, H0, 0.5)[:3] == pytest.approx((ce + 0.5 * reg, ce, reg))  # the helper is the formula
    # round 0: no global prototypes in the payload
    start0 = algo.client_init(model, {}, {"model": model.state_dict()}, _client_data(), client_ctx(model, 0))
    loss0, parts0 = algo.objective(start0)(model, torch.tensor(XS), torch.tensor(YS), 0)
    assert float(loss0.detach()) == pytest.approx(ce, rel=1e-6) and parts0["proto"] == 0.0


def test_fedproto_one_local_step_and_its_uploaded_prototypes_by_hand():
    """One epoch, one full batch, SGD lr 0.1 without momentum: the new weights are w - lr * the closed-form gradient
    of CE + lambda * reg (the prototype term moves the body), the reported losses are those before the step, and the
    upload is the per-class mean embedding of the training data under the new weights (``proto_collect: after``,
    eval mode) with the class counts."""
    algo = _fedproto(lam=0.5)
    model = BodyHead(A0, H0)
    out = algo.client_update(_global_payload(), {"model": BodyHead(A0, H0).state_dict()}, _client_data(),
                             client_ctx(model))
    loss, ce, reg, d_a, d_h = fedproto_by_hand(A0, H0, 0.5)
    a1, h1 = sgd(A0, d_a, 0.1), sgd(H0, d_h, 0.1)
    assert close(out.state["model"]["body.weight"], a1) and close(out.state["model"]["head.weight"], h1)
    assert out.metrics["train_loss"] == pytest.approx(loss, rel=1e-6)
    assert out.metrics["train_ce"] == pytest.approx(ce, rel=1e-6)
    assert out.metrics["train_proto"] == pytest.approx(reg, rel=1e-6)
    classes, means, counts = class_means(a1)
    up = out.upload["protos"]
    assert up.kind == "prototypes" and up["classes"].tolist() == classes == [0, 1]
    assert close(up["protos"], means) and up["counts"].tolist() == counts == [2, 1]
    # the prototype term is what moved the body's weights this much: without it, another body
    a_ce_only = sgd(A0, fedproto_by_hand(A0, H0, 0.0)[3], 0.1)
    assert not close(out.state["model"]["body.weight"], a_ce_only, 1e-4)


def test_fedproto_during_train_collects_the_last_epoch_under_the_moving_weights():
    """``proto_collect: during_train`` (the official code): the prototypes are the embeddings the training computed
    in the last local epoch, under the weights of that moment. Two epochs of one full batch: the second epoch's batch
    sees A1 (after the first step), so the upload is the class means of A1 x, while the model trains on to A2 and
    ``after`` uploads the class means of A2 x."""
    _, _, _, d_a, d_h = fedproto_by_hand(A0, H0, 0.5)
    a1, h1 = sgd(A0, d_a, 0.1), sgd(H0, d_h, 0.1)
    _, _, _, d_a1, _ = fedproto_by_hand(a1, h1, 0.5)
    a2 = sgd(a1, d_a1, 0.1)
    ups = {}
    for collect in ("during_train", "after"):
        algo = _fedproto(lam=0.5, epochs=2, proto_collect=collect)
        model = BodyHead(A0, H0)
        out = algo.client_update(_global_payload(), {"model": BodyHead(A0, H0).state_dict()}, _client_data(),
                                 client_ctx(model))
        assert close(out.state["model"]["body.weight"], a2)
        ups[collect] = out.upload["protos"]
    classes, during, counts = class_means(a1)
    assert ups["during_train"]["classes"].tolist() == classes and ups["during_train"]["counts"].tolist() == counts
    assert close(ups["during_train"]["protos"], during)
    assert close(ups["after"]["protos"], class_means(a2)[1])
    assert not close(during, class_means(a2)[1], 1e-3)  # the two collections differ measurably here


@pytest.mark.parametrize("agg", ["weighted", "mean"])
def test_fedproto_aggregation_weighted_and_mean_by_hand(agg):
    """Two uploads: client 0 holds classes 0 (3 samples, prototype (1, 2)) and 2 (1 sample, (0, 4)), client 1 class
    0 (1 sample, (5, -2)). ``weighted`` (the paper): P_0 = (3 (1, 2) + 1 (5, -2)) / 4 = (2, 1); ``mean`` (the
    official code): P_0 = ((1, 2) + (5, -2)) / 2 = (3, 0); P_2 = (0, 4) either way; class 1, which nobody uploaded
    this round, keeps its earlier prototype (9, -9); the broadcast carries all three."""
    algo = _fedproto(proto_agg=agg)
    state = {"protos": torch.tensor([[0.0, 0.0], [9.0, -9.0], [0.0, 0.0]]), "mask": torch.tensor([False, True, False])}
    uploads = {0: {"protos": Message("prototypes", {"protos": torch.tensor([[1.0, 2.0], [0.0, 4.0]]),
                                                    "classes": torch.tensor([0, 2]), "counts": torch.tensor([3, 1])})},
               1: {"protos": Message("prototypes", {"protos": torch.tensor([[5.0, -2.0]]), "classes": torch.tensor([0]),
                                                    "counts": torch.tensor([1])})}}
    new, metrics = algo.aggregate(state, uploads, SimpleNamespace(device="cpu"))
    p0 = {"weighted": [(3 * 1 + 5) / 4, (3 * 2 - 2) / 4], "mean": [(1 + 5) / 2, (2 - 2) / 2]}[agg]
    assert close(new["protos"], [p0, [9.0, -9.0], [0.0, 4.0]])
    assert new["mask"].tolist() == [True, True, True] and metrics["num_global_protos"] == 3.0
    down = algo.broadcast(new, None)["global_protos"]
    assert down["classes"].tolist() == [0, 1, 2] and close(down["protos"], [p0, [9.0, -9.0], [0.0, 4.0]])


# == 2. FedTGP: the server's prototype-generator step ===============================================================

TGP = {"embedding.weight": [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]],  # class embeddings e_c
       "mlp.0.weight": [[1.0, -1.0], [0.5, 1.0]], "mlp.0.bias": [0.0, 0.1],
       "mlp.2.weight": [[1.0, 0.0], [0.5, 2.0]], "mlp.2.bias": [0.1, -0.1]}
# the uploads (client 0: classes 0, 1; client 1: classes 0, 2), rows in client-id order
TGP_ROWS = [([0.0, 0.0], 0), ([3.0, 0.0], 1), ([0.0, 0.0], 0), ([0.0, 4.0], 2)]


def tgp_protos(p):
    """P_c = W2 ReLU(W1 e_c + b1) + b2."""
    out = []
    for e in p["embedding.weight"]:
        hid = [max(0.0, v + b) for v, b in zip(matvec(p["mlp.0.weight"], e), p["mlp.0.bias"])]
        out.append([v + b for v, b in zip(matvec(p["mlp.2.weight"], hid), p["mlp.2.bias"])])
    return out


def tgp_loss(protos, delta):
    """The adaptive-margin contrastive loss (reference §2.3), averaged over the uploaded rows:
    -log[exp(-(phi(p, P_y) + delta)) / (exp(-(phi(p, P_y) + delta)) + sum_{c != y} exp(-phi(p, P_c)))],
    phi the Euclidean distance."""
    total = 0.0
    for f, y in TGP_ROWS:
        s = [-(math.dist(f, pc) + (delta if c == y else 0.0)) for c, pc in enumerate(protos)]
        total += -(s[y] - math.log(sum(math.exp(v) for v in s)))
    return total / len(TGP_ROWS)


def test_fedtgp_generator_step_is_the_margin_loss_and_one_sgd_step_by_hand():
    """One server epoch over the four uploaded prototypes in one batch (server_batch_size 4), SGD lr 0.1: the
    margin is the seed's delta = min(max_{c != c'} ||Q_c - Q_c'||, tau) = min(5, 100) = 5 (Q_0 = (0, 0), Q_1 = (3, 0),
    Q_2 = (0, 4)); ``tgp_loss_first`` is the contrastive loss with that margin under the generator as it was; the new
    generator is one SGD step on its gradient; the broadcast prototypes are the new generator's outputs; the fit is
    the share of uploads whose nearest new prototype is their class. The hidden ReLU cuts unit 0 for class 1
    (W1 e_1 + b1 = (-1, 1.1))."""
    from algorithms.fedtgp import FedTGP

    cfg = TrainConfig(batch_size=10, lr=0.01)
    task = SimpleNamespace(train=cfg, num_classes=3, num_clients=2, seed=0, build_model=lambda cid: BodyHead(A0, H0))
    algo = FedTGP(FedTGP.Params(server_epochs=1, server_lr=0.1, server_batch_size=4, hidden_dim=2), task)
    state = {"generator": {k: torch.tensor(v) for k, v in TGP.items()}, "protos": torch.zeros(3, 2),
             "trained": torch.zeros((), dtype=torch.bool)}
    uploads = {0: {"protos": Message("prototypes", {"protos": torch.tensor([[0.0, 0.0], [3.0, 0.0]]),
                                                    "classes": torch.tensor([0, 1]), "counts": torch.tensor([4, 2])})},
               1: {"protos": Message("prototypes", {"protos": torch.tensor([[0.0, 0.0], [0.0, 4.0]]),
                                                    "classes": torch.tensor([0, 2]), "counts": torch.tensor([1, 5])})}}
    ctx = SimpleNamespace(device="cpu", generator=lambda purpose, device=None: torch.Generator().manual_seed(0),
                          stream=lambda purpose: Counter(0))
    new, metrics = algo.aggregate(state, uploads, ctx)

    delta = 5.0
    p0 = tgp_protos(TGP)
    assert p0[1] == pytest.approx([0.1, 2.1])  # class 1: ReLU(-1, 1.1) = (0, 1.1) -> (0.1, 2.2 - 0.1)
    loss = tgp_loss(p0, delta)
    assert metrics["tgp_margin"] == pytest.approx(delta)
    assert metrics["tgp_loss_first"] == pytest.approx(loss, rel=1e-6)
    assert metrics["tgp_loss_last"] == pytest.approx(loss, rel=1e-6)  # one epoch
    # the step: autograd of the written-out loss on a float64 copy, then SGD by hand
    w = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in TGP.items()}
    hid = torch.relu(w["embedding.weight"] @ w["mlp.0.weight"].T + w["mlp.0.bias"])
    protos = hid @ w["mlp.2.weight"].T + w["mlp.2.bias"]
    feats = torch.tensor([f for f, _ in TGP_ROWS], dtype=torch.float64)
    ys = torch.tensor([y for _, y in TGP_ROWS])
    dist = (feats[:, None, :] - protos[None, :, :]).pow(2).sum(-1).sqrt()
    s = -(dist + delta * torch.nn.functional.one_hot(ys, 3))
    loss_t = (torch.logsumexp(s, 1) - s[torch.arange(4), ys]).mean()
    assert float(loss_t.detach()) == pytest.approx(loss, rel=1e-12)  # the copy is the formula above
    loss_t.backward()
    stepped = {k: (v - 0.1 * v.grad).detach().tolist() for k, v in w.items()}
    for k in TGP:
        assert close(new["generator"][k], stepped[k], 1e-6), k
    p1 = tgp_protos(stepped)
    assert close(new["protos"], p1, 1e-6) and bool(new["trained"])
    nearest = [min(range(3), key=lambda c: math.dist(f, p1[c])) for f, _ in TGP_ROWS]
    assert metrics["tgp_fit_acc"] == pytest.approx(mean([float(n == y) for n, (_, y) in zip(nearest, TGP_ROWS)]))
    assert algo.broadcast(new, None)["global_protos"]["classes"].tolist() == [0, 1, 2]


# == 3. SlaugFL's generator steps ===================================================================================

class TinyGen(nn.Module):
    """G(z, y) = tanh(w_y + u * z): two 'pixels', one per noise coordinate; the label picks a bias."""

    def __init__(self, w, u):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(w))
        self.u = nn.Parameter(torch.tensor(u))

    def forward(self, z, y):
        return torch.tanh(self.w[y] + self.u * z)


class Rep(nn.Module):
    """A representative model: embedding z = M x (fixed), logits unused."""

    def __init__(self, m):
        super().__init__()
        self.register_buffer("m", torch.tensor(m))

    def forward(self, x, return_embedding=False):
        z = x @ self.m.T
        return (z, z) if return_embedding else z


GEN_W, GEN_U = [[0.2, -0.4], [0.6, 0.1], [0.0, 0.3]], [0.5, -1.0]
NORM = (0.25, 2.0)  # the task's pixel normalisation: x = ((t + 1) / 2 - 0.25) / 2


def gen_out(w, u, z, y):
    return [math.tanh(w[y][j] + u[j] * z[j]) for j in range(2)]


def to_input(t):
    return [((v + 1) / 2 - NORM[0]) / NORM[1] for v in t]


def test_slaugfl_prototype_generator_step_by_hand():
    """Scenario 2, one step of batch 4, noise 2, lam_div 0.5, Adam(0.5, 0.999) lr 0.01. Labels are drawn among the
    classes with a prototype (0 and 1; class 2 has none), then the noise. Each generated image, mapped into the input
    space, is embedded by the representative model of its label (class 0: device 0's M_0, class 1: device 1's M_1);
    L_proto = MSE(per-label mean embedding, the label's prototype) over the labels present, L_div = lam_div / (l_z +
    1e-5) with l_z = mean|G(z_1) - G(z_2)| / mean|z_1 - z_2| between the batch's halves (raw tanh outputs). The
    metrics are the last 10 steps' means (one step: a tenth of the step's losses); the new weights are one Adam step
    on the gradient of L_proto + L_div."""
    from algorithms.generators import GeneratorRun, train_proto_generator
    from algorithms.slaugfl import features_by_label

    m0, m1 = [[1.0, 0.0], [1.0, 1.0]], [[0.0, 2.0], [-1.0, 1.0]]
    protos = [[0.1, -0.2], [0.3, 0.4], [0.0, 0.0]]
    rep, models = torch.tensor([0, 1, -1]), {0: Rep(m0), 1: Rep(m1)}
    p = SimpleNamespace(gen_steps=1, gen_batch=4, gen_lr=0.01, gen_noise=2, lam_div=0.5)
    gen = TinyGen(GEN_W, GEN_U)
    sd, metrics = train_proto_generator(gen, torch.tensor(protos), torch.tensor([True, True, False]),
                                        lambda x, y: features_by_label(x, y, rep, models),
                                        GeneratorRun(p, torch.Generator().manual_seed(3), NORM))
    # the draws, as documented: labels among the classes with a prototype, then the noise
    g = torch.Generator().manual_seed(3)
    ys = torch.tensor([0, 1])[torch.randint(2, (4,), generator=g)].tolist()
    zs = torch.randn(4, 2, generator=g).tolist()
    assert set(ys) == {0, 1}  # (this seed) both labels in the batch
    raw = [gen_out(GEN_W, GEN_U, z, y) for z, y in zip(zs, ys)]
    emb = [matvec(m0 if y == 0 else m1, to_input(t)) for t, y in zip(raw, ys)]
    l_proto = mean([(mean([e[j] for e, y in zip(emb, ys) if y == c]) - protos[c][j]) ** 2
                    for c in (0, 1) for j in range(2)])
    l_z = (mean([abs(raw[i][j] - raw[i + 2][j]) for i in range(2) for j in range(2)])
           / mean([abs(zs[i][j] - zs[i + 2][j]) for i in range(2) for j in range(2)]))
    l_div = 0.5 / (l_z + 1e-5)
    assert metrics["gen_proto_loss"] == pytest.approx(l_proto, rel=1e-5)  # one step: the mean of the last (up to 10) steps is its loss
    assert metrics["gen_div_loss"] == pytest.approx(l_div, rel=1e-5)
    # the step: autograd of the written-out loss on a float64 copy, then Adam by hand
    w = torch.tensor(GEN_W, dtype=torch.float64, requires_grad=True)
    u = torch.tensor(GEN_U, dtype=torch.float64, requires_grad=True)
    z, y = torch.tensor(zs, dtype=torch.float64), torch.tensor(ys)
    t = torch.tanh(w[y] + u * z)
    x = ((t + 1) / 2 - NORM[0]) / NORM[1]
    e = torch.where((y == 0)[:, None], x @ torch.tensor(m0, dtype=torch.float64).T,
                    x @ torch.tensor(m1, dtype=torch.float64).T)
    means = torch.stack([e[y == c].mean(0) for c in (0, 1)])
    lp = (means - torch.tensor(protos[:2], dtype=torch.float64)).pow(2).mean()
    ld = 0.5 / ((t[:2] - t[2:]).abs().mean() / (z[:2] - z[2:]).abs().mean() + 1e-5)
    assert float((lp + ld).detach()) == pytest.approx(l_proto + l_div, rel=1e-9)  # the copy is the formula above
    (lp + ld).backward()
    for name, v in (("w", w), ("u", u)):
        want = [adam_steps(float(a), [float(ga)], [0.01], b1=0.5)
                for a, ga in zip(v.detach().flatten(), v.grad.flatten())]
        assert close(sd[name].flatten(), want, 1e-6), name


class TinyDisc(nn.Module):
    """D(x) = (a . x + a0, B x): a real/fake logit and three class logits, linear."""

    def __init__(self, a, a0, b):
        super().__init__()
        self.a = nn.Parameter(torch.tensor(a))
        self.a0 = nn.Parameter(torch.tensor(a0))
        self.b = nn.Parameter(torch.tensor(b))

    def forward(self, x):
        return x @ self.a + self.a0, x @ self.b.T


DISC_A, DISC_A0, DISC_B = [1.0, -0.5], 0.2, [[0.5, 0.0], [0.0, 0.0], [-0.3, 0.8]]


def disc_out(a, a0, b, x):
    return sum(ai * xi for ai, xi in zip(a, x)) + a0, matvec(b, x)


def bce_logit(s, target):
    """BCE of sigmoid(s) against 1 or 0: -log sigma(s) or -log(1 - sigma(s))."""
    return math.log1p(math.exp(-s)) if target else math.log1p(math.exp(s))


def acgan_losses(a, a0, b, xr, yr, fake, yg):
    """L_D = 1/2 { 1/2 [BCE(D(x_r), 1) + CE(aux(x_r), y_r)] + 1/2 [BCE(D(G), 0) + CE(aux(G), y_g)] } and
    L_G = 1/2 [BCE(D(G), 1) + CE(aux(G), y_g)] (reference §5.3), each BCE / CE the mean over the batch."""
    real = [disc_out(a, a0, b, x) for x in xr]
    fk = [disc_out(a, a0, b, x) for x in fake]
    l_d = 0.5 * (0.5 * (mean([bce_logit(s, 1) for s, _ in real]) + ce_rows([c for _, c in real], yr))
                 + 0.5 * (mean([bce_logit(s, 0) for s, _ in fk]) + ce_rows([c for _, c in fk], yg)))
    l_g = 0.5 * (mean([bce_logit(s, 1) for s, _ in fk]) + ce_rows([c for _, c in fk], yg))
    return l_d, l_g


def test_slaugfl_acgan_discriminator_then_generator_step_by_hand():
    """Scenario 1, one step of batch 3 over three labelled candidates (classes 0 and 2), Adam(0.5, 0.999) lr 0.1.
    The discriminator steps first, on L_D of a real batch and a generated one (labels drawn among the candidates'
    classes); then the generator steps on L_G judged by the *updated* discriminator. The metrics are the last 10
    steps' means (one step: a tenth of each loss)."""
    from algorithms.generators import GeneratorRun, train_acgan

    x = [[0.5, -0.5], [1.0, 0.2], [-0.4, 0.9]]
    y = [0, 2, 2]
    p = SimpleNamespace(gen_steps=1, gen_batch=4, gen_lr=0.1, gan_noise=2)
    gen, disc = TinyGen(GEN_W, GEN_U), TinyDisc(DISC_A, DISC_A0, DISC_B)
    sd, metrics = train_acgan(gen, disc, torch.tensor(x), torch.tensor(y), GeneratorRun(p, torch.Generator().manual_seed(5), NORM))
    # the draws, as documented: the real batch's indices (with replacement), the noise, the generated labels
    g = torch.Generator().manual_seed(5)
    idx = torch.randint(3, (3,), generator=g).tolist()
    zs = torch.randn(3, 2, generator=g).tolist()
    yg = torch.tensor([0, 2])[torch.randint(2, (3,), generator=g)].tolist()
    xr, yr = [x[i] for i in idx], [y[i] for i in idx]
    fake = [to_input(gen_out(GEN_W, GEN_U, z, c)) for z, c in zip(zs, yg)]
    l_d, l_g_before = acgan_losses(DISC_A, DISC_A0, DISC_B, xr, yr, fake, yg)
    assert metrics["gan_d_loss"] == pytest.approx(l_d, rel=1e-5)  # one step: its loss, not loss / 10

    # the discriminator's step: autograd of the written-out L_D on a float64 copy, then Adam by hand
    d64 = [torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in (DISC_A, DISC_A0, DISC_B)]
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    ce = torch.nn.functional.cross_entropy
    xr_t, fake_t = torch.tensor(xr, dtype=torch.float64), torch.tensor(fake, dtype=torch.float64)
    yr_t, yg_t = torch.tensor(yr), torch.tensor(yg)

    def judged(d, inp):
        return inp @ d[0] + d[1], inp @ d[2].T

    (sr, cr), (sf, cf) = judged(d64, xr_t), judged(d64, fake_t)
    ld_t = 0.5 * (0.5 * (bce(sr, torch.ones(3, dtype=torch.float64)) + ce(cr, yr_t))
                  + 0.5 * (bce(sf, torch.zeros(3, dtype=torch.float64)) + ce(cf, yg_t)))
    assert float(ld_t.detach()) == pytest.approx(l_d, rel=1e-9)  # the copy is the formula above
    ld_t.backward()
    d1 = [[adam_steps(float(v), [float(gv)], [0.1], b1=0.5) for v, gv in zip(t.detach().flatten(), t.grad.flatten())]
          for t in d64]
    a1, a01, b1 = d1[0], d1[1][0], [d1[2][0:2], d1[2][2:4], d1[2][4:6]]
    # the generator is judged by the discriminator after its step
    _, l_g = acgan_losses(a1, a01, b1, xr, yr, fake, yg)
    assert abs(l_g - l_g_before) > 0.01  # (the updated discriminator judges measurably otherwise)
    assert metrics["gan_g_loss"] == pytest.approx(l_g, rel=1e-5)
    # the generator's step: autograd of L_G under the updated discriminator, then Adam by hand
    w = torch.tensor(GEN_W, dtype=torch.float64, requires_grad=True)
    u = torch.tensor(GEN_U, dtype=torch.float64, requires_grad=True)
    t = torch.tanh(w[yg_t] + u * torch.tensor(zs, dtype=torch.float64))
    sg, cg = judged([torch.tensor(a1, dtype=torch.float64), torch.tensor(a01, dtype=torch.float64),
                     torch.tensor(b1, dtype=torch.float64)], ((t + 1) / 2 - NORM[0]) / NORM[1])
    lg_t = 0.5 * (bce(sg, torch.ones(3, dtype=torch.float64)) + ce(cg, yg_t))
    assert float(lg_t.detach()) == pytest.approx(l_g, rel=1e-9)
    lg_t.backward()
    for name, v in (("w", w), ("u", u)):
        want = [adam_steps(float(a), [float(ga)], [0.1], b1=0.5)
                for a, ga in zip(v.detach().flatten(), v.grad.flatten())]
        assert close(sd[name].flatten(), want, 1e-6), name


# == 4. FedDistill's client regulariser =============================================================================

W_D = [[1.0, 0.0], [0.0, 1.0], [0.5, -0.5]]  # logits = W x
GLOBAL_LOGITS = {0: [1.0, 0.0, -1.0], 2: [0.0, 0.5, 2.0]}  # class 1 has no global logit


class Lin(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(w))

    def forward(self, x, return_embedding=False):
        out = x @ self.w.T
        return (out, x) if return_embedding else out


def test_feddistill_loss_step_and_upload_by_hand():
    """L = CE(f(x), y) + lambda * T^2 * (1/B) sum_b [y_b has a global logit] KL(softmax(l_{y_b} / T) ||
    softmax(f(x_b) / T)), lambda 0.5, T 2 (the class-1 row adds 0 but counts in the mean). One full batch, SGD lr 0.1
    without momentum: dL/df_b = (softmax(f_b) - onehot) / B + lambda * T (softmax(f_b / T) - softmax(l_y / T)) / B.
    The upload is the per-class mean of the logits the training computed (under the weights before the step)."""
    from algorithms.feddistill import FedDistill

    lam, temp, lr = 0.5, 2.0, 0.1
    cfg = TrainConfig(local_epochs=1, batch_size=3, optimizer="sgd", lr=lr, momentum=0.0)
    task = SimpleNamespace(train=cfg, num_classes=3, num_clients=1, seed=0, build_model=lambda cid: Lin(W_D))
    algo = FedDistill(FedDistill.Params(lam=lam, temperature=temp), task)
    classes = sorted(GLOBAL_LOGITS)
    payload = {"global_logits": Message("global_logits", {"logits": torch.tensor([GLOBAL_LOGITS[c] for c in classes]),
                                                          "classes": torch.tensor(classes)})}
    model = Lin(W_D)
    out = algo.client_update(payload, {"model": Lin(W_D).state_dict()}, _client_data(), client_ctx(model))

    b = len(XS)
    f = [matvec(W_D, x) for x in XS]
    ce = ce_rows(f, YS)
    kd = 0.0
    grad = [[0.0, 0.0] for _ in range(3)]
    for x, fb, y in zip(XS, f, YS):
        df = [(p - (c == y)) / b for c, p in enumerate(softmax(fb))]
        if y in GLOBAL_LOGITS:
            target = softmax([v / temp for v in GLOBAL_LOGITS[y]])
            q = softmax([v / temp for v in fb])
            kd += temp * temp * sum(t * (math.log(t) - math.log(qc)) for t, qc in zip(target, q)) / b
            df = [d + lam * temp * (qc - t) / b for d, qc, t in zip(df, q, target)]
        for c in range(3):
            for k in range(2):
                grad[c][k] += df[c] * x[k]
    assert out.metrics["train_ce"] == pytest.approx(ce, rel=1e-6)
    assert out.metrics["train_distill"] == pytest.approx(kd, rel=1e-6)
    assert out.metrics["train_loss"] == pytest.approx(ce + lam * kd, rel=1e-6)
    assert close(out.state["model"]["w"], sgd(W_D, grad, lr))
    up = out.upload["logits"]
    assert up.kind == "class_logits" and up["classes"].tolist() == [0, 1]
    assert close(up["logits"], [[(f[0][c] + f[2][c]) / 2 for c in range(3)], f[1]])
