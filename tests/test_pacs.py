"""PACS (seed 003, Table 2): the loader on a fake release tree (labels, domains, parts, resizing, one clear error per
bad input), the seed's node split and the disjoint option with their exact sizes, the ImageNet-size networks against
torchvision's, and every shipped PACS config run end to end on the fake tree."""
from pathlib import Path

import numpy as np
import pytest
import torch

from raysim.config import load_config
from raysim.data import DataError, load_dataset
from raysim.data.pacs import CLASSES, DOMAINS
from raysim.errors import ConfigError

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "seed003_mafml"
PACS_CONFIGS = ["pacs_mafml.yaml", "pacs_mafml_hetero.yaml", "pacs_ind.yaml", "pacs_agg.yaml", "pacs_fedmd.yaml",
                "pacs_fedavg.yaml"]
PER_CLASS = 4  # images per (domain, class): 3 in the train list, 1 in crossval, all 4 in the test list
EXTRA = {"sketch": 2}  # sketch: 2 more images per class listed in its test list only


def colour(d: int, c: int, k: int) -> tuple:
    """The solid RGB colour of image k of class c in domain d: every image is told apart by its pixels."""
    return 40 * d + 20, 30 * c + 10, 20 * k + 5


def fake_pacs(root: Path, extra=EXTRA, lists_in: str = "", with_lists: bool = True) -> Path:
    """The release's layout: kfold/<domain>/<class>/pic_XXX.jpg (sketch: .png), 8x8 solid colours, and the
    <domain>_{train,crossval,test}_kfold.txt lists (test = the whole domain, as in the original release, plus the
    EXTRA test-only images) in root/lists_in."""
    from PIL import Image

    (root / lists_in).mkdir(parents=True, exist_ok=True)
    for d, dom in enumerate(DOMAINS):
        ext = ".png" if dom == "sketch" else ".jpg"
        lists = {"train": [], "crossval": [], "test": []}
        for c, cls in enumerate(CLASSES):
            (root / "kfold" / dom / cls).mkdir(parents=True, exist_ok=True)
            for k in range(PER_CLASS + extra.get(dom, 0)):
                rel = f"{dom}/{cls}/pic_{k:03d}{ext}"
                Image.fromarray(np.full((8, 8, 3), colour(d, c, k), dtype=np.uint8)).save(root / "kfold" / rel)
                line = f"{rel} {c + 1}"
                if k < PER_CLASS - 1:
                    lists["train"].append(line)
                elif k == PER_CLASS - 1:
                    lists["crossval"].append(line)
                lists["test"].append(line)
        if with_lists:
            for part, lines in lists.items():
                (root / lists_in / f"{dom}_{part}_kfold.txt").write_text("\n".join(lines) + "\n")
    return root


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return fake_pacs(tmp_path_factory.mktemp("pacs"))


def ids(x: torch.Tensor, tol: int) -> list:
    """(domain, class, k) of each image from its (solid) colour; x normalised as (p / 255 - 0.5) / 0.5."""
    px = ((x.float() * 0.5 + 0.5) * 255.0 if x.dtype != torch.uint8 else x.float())
    rgb = px.mean(dim=(2, 3)).round().int().tolist()
    spread = float((px - px.mean(dim=(2, 3), keepdim=True)).abs().max()) if len(px) else 0.0
    assert spread <= tol, "every image should stay one solid colour"
    out = []
    for r, g, b in rgb:
        d, c, k = round((r - 20) / 40), round((g - 10) / 30), round((b - 5) / 20)
        assert max(abs(r - colour(d, c, k)[0]), abs(g - colour(d, c, k)[1]), abs(b - colour(d, c, k)[2])) <= tol
        out.append((d, c, k))
    return out


# -- the loader -------------------------------------------------------------------------------------------------------

def test_loader_labels_domains_parts_and_resizing(tree):
    ds = load_dataset("pacs", str(tree), {"size": 16})
    assert ds.num_classes == 7 and ds.input_shape == (3, 16, 16) and ds.train.norm == (0.5, 0.5)
    n_train = len(DOMAINS) * 7 * PER_CLASS  # train + crossval parts
    n_test = n_train + 7 * EXTRA["sketch"]
    assert ds.train.x.shape == (n_train, 3, 16, 16) and ds.test.x.shape == (n_test, 3, 16, 16)
    tol = 4  # JPEG's rounding of a solid colour; the sketches (PNG) are exact
    for part in (ds.train, ds.test):
        got = ids(part.x, tol)
        assert [c for _, c, _ in got] == part.y.tolist()  # every label is its image's class folder
        assert [d for d, _, _ in got] == part.domain.tolist()
    sk = ds.train.domain == DOMAINS.index("sketch")
    ids(ds.train.x[sk], 0.01)  # the sketches (PNG) keep their colours exactly
    got = ids(ds.train.x, tol)
    assert [k == PER_CLASS - 1 for _, _, k in got] == ds.train.val_mask.tolist()  # crossval marked as validation
    assert sorted(got) == sorted((d, c, k) for d in range(4) for c in range(7) for k in range(PER_CLASS))
    # the seed's test part lists every image of the domain (the original release): it shares the training images'
    # storage instead of copying them
    assert ds.test.x.data_ptr() == ds.train.x.data_ptr()
    big = load_dataset("pacs", str(tree))  # the seed's 224 x 224
    assert big.input_shape == (3, 224, 224) and big.train.x.shape[1:] == (3, 224, 224)
    assert ids(big.train.x, tol) == got  # resized, still the same solid colours in the same order


def test_lists_found_in_pacs_label_and_beside_kfold(tmp_path):
    root = fake_pacs(tmp_path / "rel", lists_in="pacs_label")
    a = load_dataset("pacs", str(root), {"size": 8})
    b = load_dataset("pacs", str(root / "kfold"), {"size": 8, "domains": ["sketch", "photo"]})  # root = kfold/
    assert len(a.train) == 112 and b.train.domain.unique().tolist() == [0, 1]
    assert len(b.train) == 56 and ids(b.train.x[:1], 0)[0][0] == DOMAINS.index("sketch")  # node 0 = sketch


def _rewrite(root: Path, name: str, edit):
    p = root / name
    p.write_text(edit(p.read_text()))


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.replace(" 1\n", "\n", 1), r"photo_train_kfold.txt, line 1: expected a path and a label"),
    (lambda t: t.replace(" 1\n", " 9\n", 1), r"line 1: label '9' is not one of 1..7"),
    (lambda t: t.replace(" 1\n", " 2\n", 1), r"line 1: label 2 is elephant, but the image is in the class folder 'dog'"),
    (lambda t: t.replace("photo/dog/pic_000", "sketch/dog/pic_000", 1), r"line 1: path .* is not in domain photo"),
    (lambda t: t.replace("pic_000", "pic_999", 1), r"line 1: the image .*pic_999.jpg does not exist"),
    (lambda t: t.replace("pic_001.jpg 1", "pic_000.jpg 1", 1), r"line 2: photo/dog/pic_000.jpg is listed twice"),
    (lambda t: t.replace("photo/dog/", "photo/cat/", 1), r"line 1: class folder 'cat' is not a PACS class"),
])
def test_a_bad_line_is_one_error_naming_file_and_line(tmp_path, edit, match):
    root = fake_pacs(tmp_path, extra={})
    _rewrite(root, "photo_train_kfold.txt", edit)
    with pytest.raises(DataError, match=match) as e:
        load_dataset("pacs", str(root), {"size": 8})
    assert e.value.field == "data.root" and "labels 1..7 = 1 dog" in str(e.value)


def test_missing_root_lists_or_images_name_data_root_and_where_looked(tmp_path):
    with pytest.raises(DataError, match="pacs needs data.root") as e:
        load_dataset("pacs", None)
    assert e.value.field == "data.root"
    with pytest.raises(DataError, match="is not a directory") as e:
        load_dataset("pacs", str(tmp_path / "nowhere"))
    assert e.value.field == "data.root"
    # the plain image tree without the release's lists: no fallback, the places looked in are named
    bare = fake_pacs(tmp_path / "bare", with_lists=False)
    with pytest.raises(DataError) as e:
        load_dataset("pacs", str(bare))
    msg = str(e.value)
    assert e.value.field == "data.root" and "no PACS split files" in msg and "image folders" in msg
    for where in ("bare,", "bare/pacs_label", "bare/splits", "bare/kfold"):
        assert where in msg
    # one list missing: named, with the folder holding the others
    root = fake_pacs(tmp_path / "one", extra={})
    (root / "cartoon_crossval_kfold.txt").unlink()
    with pytest.raises(DataError, match=r"split file .*/one/cartoon_crossval_kfold.txt is missing; the other split "
                                        r"files are in .*Looked in") as e:
        load_dataset("pacs", str(root))
    assert e.value.field == "data.root"
    # a damaged image: the file named
    (root / "cartoon_crossval_kfold.txt").write_text("")
    with pytest.raises(DataError, match="cartoon_crossval_kfold.txt lists no images"):
        load_dataset("pacs", str(root))


@pytest.mark.parametrize("params, field", [
    ({"size": 0}, "data.dataset_params.size"),
    ({"size": "big"}, "data.dataset_params.size"),
    ({"split": "random"}, "data.dataset_params.split"),
    ({"holdout": 0.2}, "data.dataset_params.holdout"),  # the seed's split holds nothing out
    ({"split": "disjoint", "holdout": 1.0}, "data.dataset_params.holdout"),
    ({"domains": ["photo", "painting"]}, "data.dataset_params.domains"),
    ({"domains": ["photo", "photo"]}, "data.dataset_params.domains"),
    ({"resize": 32}, "data.dataset_params.resize"),
])
def test_bad_parameters_name_their_field(tree, params, field):
    with pytest.raises(DataError) as e:
        load_dataset("pacs", str(tree), params)
    assert e.value.field == field


def test_damaged_image_is_named(tmp_path):
    root = fake_pacs(tmp_path, extra={})
    (root / "kfold" / "cartoon" / "horse" / "pic_002.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(DataError, match=r"cannot read .*cartoon/horse/pic_002.jpg \(data.root\)"):
        load_dataset("pacs", str(root), {"size": 8})


# -- the node split: the seed's protocol and the disjoint option ----------------------------------------------------

def _fed(tree, *overrides):
    from raysim.data.federated import build_federated_data

    cfg = load_config(CONFIGS / "pacs_mafml.yaml", [f"data.root={tree}", "data.dataset_params.size=8", *overrides])
    return build_federated_data(cfg.data, cfg.seed)


def test_seed_protocol_one_node_per_domain_exact_sizes(tree):
    fed = _fed(tree)
    assert fed.domains == [0, 1, 2, 3] and fed.input_shape == (3, 8, 8)
    # per node: private = 21 train-list images, val = the 7 crossval images, public = round(0.1 x test part),
    # test = the rest: 28 -> 3 / 25 (sketch: 42 -> 4 / 38)
    assert [(c.num_train, int(c.y_test.shape[0]), int(c.y_val.shape[0])) for c in fed.clients] == \
        [(24, 25, 7), (24, 25, 7), (24, 25, 7), (25, 38, 7)]
    assert fed.public.owner.tolist() == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 4
    assert len(fed.global_test) == 25 * 3 + 38 and fed.clients[0].cross_test[0].shape[0] == 113
    for d, c in enumerate(fed.clients):
        assert c.is_compact  # uint8 pixels from the start: PACS at 224 is 1.5 GB so, 6 GB as floats
        train, test, val = ids(c.x_train, 4), ids(c.x_test, 4), ids(c.x_val, 4)
        pub = ids(fed.public.x[fed.public.owner == d], 4)
        assert all(dd == d for dd, _, _ in train + test + val + pub)
        private = [(d, cl, k) for cl in range(7) for k in range(PER_CLASS - 1)]  # the train list
        assert sorted(train) == sorted(private + pub)  # a node trains on its private data and its public share
        assert sorted(val) == [(d, cl, PER_CLASS - 1) for cl in range(7)]  # the crossval list
        listed = [(d, cl, k) for cl in range(7) for k in range(PER_CLASS + EXTRA.get(DOMAINS[d], 0))]
        assert sorted(test + pub) == listed and not set(test) & set(pub)  # the test list, split 10 / 90
        # the caveat, kept: the test data holds images the node trains on (all but sketch's test-only ones)
        assert set(test) & set(private)
        decoded = c.to("cpu")
        assert torch.equal(decoded.x_test, fed.clients[0].cross_test[0][fed.clients[0].cross_test[2] == d])


def test_disjoint_option_tests_on_held_out_images_exact_sizes(tree):
    fed = _fed(tree, "data.dataset_params.split=disjoint")
    # photo / art / cartoon: the test list is the whole domain, so round(0.3 x 3) = 1 train image per class (7) is
    # held out: private 14, public round(0.7) = 1, test 6; sketch: its 14 test-only images, public 1, test 13
    assert [(c.num_train, int(c.y_test.shape[0]), int(c.y_val.shape[0])) for c in fed.clients] == \
        [(15, 6, 7), (15, 6, 7), (15, 6, 7), (22, 13, 7)]
    for d, c in enumerate(fed.clients):
        train, test, val = set(ids(c.x_train, 4)), set(ids(c.x_test, 4)), set(ids(c.x_val, 4))
        assert not test & (train | val)  # never trained or validated on
    sketch_test = ids(fed.clients[3].x_test, 0)
    assert all(k >= PER_CLASS for _, _, k in sketch_test)  # the test-list images outside train / crossval
    again = _fed(tree, "data.dataset_params.split=disjoint", "seed=7")  # the held-out draw is the dataset's own
    assert [ids(c.x_val, 4) for c in again.clients] == [ids(c.x_val, 4) for c in fed.clients]
    held = lambda f: sorted(set(ids(f.clients[0].x_test, 4)) | set(ids(f.public.x[f.public.owner == 0], 4)))  # noqa
    assert held(again) == held(fed)


@pytest.mark.parametrize("overrides, exc, field", [
    (["data.local_split={mode: fixed, public: 0.1}"], ConfigError, "data.local_split.mode"),
    (["data.local_split={mode: dataset, public: 0.1, val: 0.1}"], ConfigError, "data.local_split.val"),
    (["data.rotations=[0, 90]"], ConfigError, "data.rotations"),
    (["data.num_clients=3", "clients_per_round=3"], DataError, "data.num_clients"),
    (["data.local_split={mode: dataset, public: 0.99}"], DataError, "data.local_split.public"),
    (["data.dataset=mnist5k", "data.dataset_params={}", "data.partition=shared_base"], DataError,
     "data.local_split.mode"),
    (["data.dataset=mnist5k", "data.dataset_params={}", "data.local_split={public: 0.1}"], DataError,
     "data.partition"),
])
def test_bad_node_split_settings_name_their_field(tree, overrides, exc, field):
    with pytest.raises(exc) as e:
        _fed(tree, *overrides)
    assert e.value.field == field


# -- the networks -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch, side", [("resnet18", 32), ("resnet34", 32), ("alexnet", 64), ("vgg11", 32)])
def test_networks_are_torchvisions_with_a_body_head_split(arch, side):
    """Parameter names (under body. / head.) and shapes are torchvision's; with torchvision's weights loaded the
    logits are torchvision's, and the embedding is the input of its last Linear."""
    import torchvision

    from raysim.models import ARCHS

    torch.manual_seed(0)
    ref = getattr(torchvision.models, arch)(weights=None, num_classes=7).eval()
    last = "fc" if arch.startswith("resnet") else "classifier.6"
    with torch.device("meta"):
        model = ARCHS[arch]((3, side, side), 7)
    src = ref.state_dict()
    mapped = {k: src[k[len("body."):] if k.startswith("body.") else f"{last}.{k.rsplit('.', 1)[1]}"]
              for k in model.state_dict()}
    assert len(mapped) == len(src)
    model.load_state_dict(mapped, assign=True)
    model.eval()
    x = torch.randn(2, 3, side, side)
    with torch.no_grad():
        logits, z = model(x, return_embedding=True)
        assert torch.allclose(logits, ref(x), atol=1e-5)
        assert z.shape == (2, model.embed_dim) and torch.allclose(ref.get_submodule(last)(z), logits, atol=1e-5)


def test_alexnet_too_small_an_image_names_the_arch():
    from raysim.models import alexnet

    with pytest.raises(ConfigError, match="alexnet needs images of at least 63x63.*dataset_params.size") as e:
        alexnet((3, 32, 32), 7)
    assert e.value.field == "model.arch"


# -- the shipped configs ----------------------------------------------------------------------------------------------

SMALL_HETERO = ("model.per_client=[{arch: resnet18, params: {width: 8}}, {arch: resnet34, params: {width: 8}}, "
                "{arch: alexnet, params: {hidden: 32}}, {arch: vgg11, params: {width: 8, hidden: 32}}]")


@pytest.mark.parametrize("name", PACS_CONFIGS)
def test_config_runs_end_to_end_on_a_fake_tree(tree, tmp_path, name):
    """Each PACS config as shipped: full size (224, 200 rounds x 50 iterations, the seed's networks), and on the
    fake tree with tiny sizes it runs end to end on the sequential backend with finite metrics for every node."""
    from raysim import run_experiment

    cfg = load_config(CONFIGS / name)
    assert cfg.data.dataset == "pacs" and cfg.data.root is None and cfg.data.dataset_params["size"] == 224
    assert cfg.data.partition == "domains" and cfg.data.local_split == {"mode": "dataset", "public": 0.10}
    assert cfg.rounds == 200 and cfg.train.lr == 1e-4 and cfg.train.weight_decay == 1e-5 and cfg.train.batch_size == 32
    hetero = cfg.model.per_client is not None
    if hetero:
        assert [s.arch for s in cfg.model.per_client] == ["resnet18", "resnet34", "alexnet", "vgg11"]
    else:
        assert cfg.model.arch == "resnet18"
    iters = (["algorithm.params.iterations=2"] if cfg.algorithm.name == "mafml" else ["train.local_steps=2"])
    small = [f"data.root={tree}", f"data.dataset_params.size={64 if hetero else 32}", "rounds=1",
             "train.batch_size=8", f"output.dir={tmp_path}", *iters,
             *([SMALL_HETERO] if hetero else ["model.params={width: 8}"])]
    if cfg.algorithm.name == "fedavg":  # 2 iterations cannot fit an average into 100 x MAFML's floats: average each
        small += ["algorithm.params.bandwidth_ratio=0", "algorithm.params.sync_every=1"]
    if cfg.algorithm.name == "fedmd":
        small += ["algorithm.params.transfer_public_epochs=1", "algorithm.params.transfer_private_epochs=1"]
    res = run_experiment(load_config(CONFIGS / name, small), progress=False)
    t = res.table
    rows = t[(t.scope == "client") & (t.metric == "test_acc_all")]
    assert sorted(rows.client_id.unique().tolist()) == [0, 1, 2, 3]
    assert np.isfinite(rows.value).all() and ((rows.value >= 0) & (rows.value <= 1)).all()
    assert (t.metric == "val_acc_all").any()


def test_fedavg_cap_is_100_times_mafmls_floats(tree):
    """pacs_fedavg.yaml at full length: ResNet18's 11,189,703 state floats against MAFML's 3,600 per iteration give
    an average every 251 iterations (39 over 10,000: 98.2 x MAFML's floats; 250 would give 40, over the cap)."""
    from algorithms.mafml import floats_per_iteration

    try:
        from raysim.engine.prepare import prepare
    except ImportError:  # before the engine/ package
        from raysim.engine.prepare import prepare
    p = prepare(load_config(CONFIGS / "pacs_fedavg.yaml", [f"data.root={tree}", "data.dataset_params.size=32"]))
    k, P, m = p.algorithm.sync_period, p.algorithm.model_floats(), floats_per_iteration(4, 7, 32)
    assert (k, P, m) == (251, 11_189_703, 3_600)
    total = lambda k: 4 * P + (10_000 // k) * 2 * 4 * P  # noqa: E731 (the initial download + each average)
    assert total(251) <= 100 * 10_000 * m < total(250)


def test_reproduce_table2_without_data_is_one_line_naming_data_root(tmp_path, capsys):
    from raysim.app.cli import main

    for exp in ("table2_pacs", "table2_pacs_hetero"):
        out = tmp_path / "out"
        assert main(["reproduce", exp, "--out", str(out), "--seeds", "1"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "data.root" in err[0] and "pacs needs data.root" in err[0], err
        assert not out.exists()


def test_table2_manifest_resolves_with_data(tree, tmp_path):
    """With data.root set, every run of table2_pacs plans (configs, data and the models checked) and carries the
    seed's number; the heterogeneous experiment gives each baseline the four networks."""
    from raysim.app import seed_experiments as rp

    exps, numbers = rp.load_experiments(), rp.load_numbers()
    plan = rp.plan(exps["table2_pacs"], [1], tmp_path, [f"data.root={tree}", "data.dataset_params.size=32"])
    assert [p.run.label for p in plan] == ["MAFML", "IND", "AGG", "FedMD", "FedAvg 100x bandwidth"]
    assert all(p.status == "to run" for p in plan)
    assert rp.paper_value(exps["table2_pacs"], numbers, plan[0].run, "test_acc_all") == pytest.approx(87.77)
    het = rp.plan(exps["table2_pacs_hetero"], [1], tmp_path, check_data=False)
    assert all([s.arch for s in p.cfg.model.per_client] == ["resnet18", "resnet34", "alexnet", "vgg11"] for p in het)
    assert rp.paper_value(exps["table2_pacs_hetero"], numbers, het[3].run, "test_fwt") == pytest.approx(67.08)
    dis = rp.plan(exps["table2_pacs_disjoint"], [1], tmp_path, check_data=False)
    assert all(p.cfg.data.dataset_params["split"] == "disjoint" and p.run.paper is None for p in dis)
