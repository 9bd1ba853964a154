"""Bad configs: one clear error naming the field and the allowed values."""
import pytest

from raysim.config import make_config
from raysim.data import DataError
from raysim.engine.prepare import prepare
from raysim.errors import ConfigError
from tests.conftest import tiny_config


def deep_merge(base, over):
    out = dict(base)
    for k, v in over.items():
        merge = isinstance(v, dict) and isinstance(out.get(k), dict) and k not in ("params", "partition_params")
        out[k] = deep_merge(out[k], v) if merge else v
    return out


def err(data, exc=ConfigError):
    """prepare() a valid tiny config with ``data`` merged in; return the single error it raises."""
    with pytest.raises(exc) as e:
        prepare(make_config(deep_merge(tiny_config(), data)))
    return e.value


def test_unknown_key_suggests():
    e = err({"data": {"partiton": "iid"}})
    assert e.field == "data.partiton" and "did you mean 'partition'" in str(e)


def test_wrong_type():
    e = err({"rounds": "many"})
    assert e.field == "rounds" and "integer" in str(e)


def test_bad_choices_list_allowed_values():
    assert "fedproto" in str(err({"algorithm": {"name": "fedprot"}}))
    assert err({"backend": {"name": "dask"}}).field == "backend.name"
    assert "mnist5k" in str(err({"data": {"dataset": "imagenet"}}))
    e = err({"data": {"partition": "zipf"}}, DataError)
    assert e.field == "data.partition" and "nway_kshot" in str(e)


def test_algorithm_params_are_validated():
    e = err({"algorithm": {"name": "fedproto", "params": {"proto_agg": "median"}}})
    assert e.field == "algorithm.params.proto_agg" and "weighted" in str(e)
    e = err({"algorithm": {"name": "fedproto", "params": {"lambda": 1}}})
    assert e.field == "algorithm.params.lambda"


def test_fedavg_needs_homogeneous_models():
    e = err({"algorithm": {"name": "fedavg", "params": {}}, "model": {"per_client": [
        {"arch": "mlp", "params": {"hidden": 18}}, {"arch": "mlp", "params": {"hidden": 20}}]}})
    assert e.field == "model.per_client"


def test_model_params_named():
    e = err({"model": {"arch": "cnn_mnist", "params": {"channels": 3}}})
    assert e.field == "model.params.channels"
    e = err({"model": {"arch": "cnn_mnist", "params": {"out_channels": 3}}})  # 8x8 synthetic images are too small
    assert e.field == "model.arch"
    e = err({"model": {"arch": "mlp", "params": {"hidden": -3}}})
    assert e.field == "model.params"


def test_partition_param_error_names_field():
    e = err({"data": {"partition": "iid", "partition_params": {"alpha": 0.1}}}, DataError)
    assert e.field == "data.partition_params.alpha"
    e = err({"data": {"partition_params": {"ways": 3, "shots": 500}}}, DataError)  # more than synthetic has
    assert e.field == "data.partition_params.shots"
    e = err({"data": {"dataset": "fashion_mnist", "root": "/nonexistent"}}, DataError)
    assert e.field == "data.root"


def test_overrides_and_clients_per_round():
    cfg = make_config({}, ["algorithm.params.lam=0.5", "backend.name=ray", "data.partition_params={ways: 3}"])
    assert cfg.algorithm.params == {"lam": 0.5} and cfg.backend.name == "ray"
    with pytest.raises(ConfigError, match="clients_per_round"):
        make_config({"clients_per_round": 50})
    with pytest.raises(ConfigError) as e:
        make_config({}, ["rounds.x=1"])
    assert e.value.field == "rounds"


def test_run_id_ignores_backend_but_not_science():
    a = make_config({"backend": {"name": "ray"}})
    b = make_config({"backend": {"name": "sequential"}})
    c = make_config({"seed": 2})
    assert a.run_id() == b.run_id() != c.run_id()


def test_one_module_per_section_every_name_from_raysim_config():
    """raysim/config/: the sections live one module each (at most 250 lines), and every public name is still
    importable from ``raysim.config``, the same object as in its section's module."""
    from pathlib import Path

    import raysim.config as config
    from raysim.config import backend, data, experiment, learning, model, output, server

    sections = (data, model, learning, backend, output, server, experiment)
    assert all(len(Path(m.__file__).read_text().splitlines()) <= 250 for m in sections)
    assert all(getattr(config, name) is not None for name in config.__all__)
    owners = {name: m for m in sections for name, obj in vars(m).items()
              if isinstance(obj, type) and obj.__module__ == m.__name__}
    assert {"DataConfig", "ArchSpec", "ModelConfig", "TrainConfig", "AlgorithmConfig", "EvalConfig", "BackendConfig",
            "ModelResources", "OutputConfig", "StalenessConfig", "ServerConfig", "ExperimentConfig"} <= set(owners)
    assert all(getattr(config, name) is getattr(m, name) for name, m in owners.items())
