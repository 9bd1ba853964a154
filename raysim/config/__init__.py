"""Typed experiment configuration, validated at the edge.

A YAML file (plus ``--set dotted.key=value`` overrides) becomes a tree of frozen dataclasses. Every problem is
reported as one :class:`ConfigError` naming the dotted field and the allowed values, before any data is loaded or
any Ray process is started.

One module per section: :mod:`~raysim.config.data`, :mod:`~raysim.config.model`, :mod:`~raysim.config.learning`
(``train``, ``algorithm``, ``eval``), :mod:`~raysim.config.backend`, :mod:`~raysim.config.output`,
:mod:`~raysim.config.server`, and :mod:`~raysim.config.experiment` (the whole config, its identity,
:func:`make_config`, :func:`load_config`); dict <-> dataclass in :mod:`~raysim.config.fields`, YAML and overrides in
:mod:`~raysim.config.yamlio`. Every name is importable from ``raysim.config`` as before.
"""
from __future__ import annotations

from raysim.errors import ConfigError
from raysim.config.fields import check_path_component, choice, from_dict, positive, to_dict
from raysim.config.yamlio import (MAX_YAML_BYTES, YamlBoundsError, apply_overrides, load_config_dict, load_yaml_mapping,
                                  parse_override, read_text_file, set_dotted, yaml_error_text, yaml_load)
from raysim.config.data import MAX_CLIENTS, DataConfig
from raysim.config.model import ArchSpec, ModelConfig
from raysim.config.learning import AlgorithmConfig, EvalConfig, TrainConfig
from raysim.config.backend import BackendConfig, ModelResources
from raysim.config.output import OutputConfig
from raysim.config.server import ServerConfig, StalenessConfig
from raysim.config.experiment import OLD_VALUES, ExperimentConfig, load_config, make_config

# the public names of the configuration layer, importable from raysim.config as before
__all__ = ["AlgorithmConfig", "ArchSpec", "BackendConfig", "ConfigError", "DataConfig", "EvalConfig", "ExperimentConfig",
           "MAX_CLIENTS", "ModelResources", "OLD_VALUES", "ServerConfig", "StalenessConfig",
           "MAX_YAML_BYTES", "ModelConfig", "OutputConfig", "TrainConfig", "YamlBoundsError", "apply_overrides",
           "check_path_component", "choice", "from_dict", "load_config", "load_config_dict", "load_yaml_mapping",
           "make_config", "parse_override", "positive", "read_text_file", "set_dotted", "to_dict", "yaml_error_text",
           "yaml_load"]
