"""The ``data`` section: the dataset, how it is split among the clients, their local and public shares."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from raysim.errors import ConfigError
from raysim.config.fields import _p, positive


MAX_CLIENTS = 10_000_000  # per-client arrays of this length still fit in memory


@dataclass(frozen=True)
class DataConfig:
    dataset: str = "mnist5k"  # a built-in name, a format (npz, imagefolder, leaf), a registered name or an import
    #                          path "package.module:loader" (loader(root, **dataset_params) -> mapping of arrays)
    root: Optional[str] = None  # local directory for file-based datasets (npz: the file)
    dataset_params: dict = field(default_factory=dict)  # keyword arguments of the loader or format (e.g. size)
    num_clients: int = 20
    partition: str = "nway_kshot"
    partition_params: dict = field(default_factory=dict)
    test_fraction: float = 0.2  # per-class share held out as the test pool when a dataset has no test split
    public: Optional[dict] = None  # an explicitly public dataset: {dataset: ..., size: ..., root: ...}
    rotations: Optional[list[float]] = None  # domain shift: client i's images rotated by rotations[i % len] degrees
    val_fraction: float = 0.0  # per-client validation split carved from each client's training data (0: none)
    # MAFML's per-node four-way split {public: a, val: v, test: t} of each client's samples (private = the rest):
    # the test split comes from the client's own samples, the public shares of all clients form the public dataset.
    # mode: dataset (PACS) takes private / val / test part from the dataset's own parts; public: a of the test part
    local_split: Optional[dict] = None
    # a server-held validation set: this many samples of the training pool (class-stratified, seeded), removed from
    # the pool before partitioning, so disjoint from every client's data and from the test set; server steps of a
    # method that declares it read it as ctx.server_data["server_val"] (0: none). The test set reaches only evaluation
    # steps.
    server_val: int = 0

    def check(self, path: str) -> None:
        positive(_p(path, "num_clients"), self.num_clients)
        if self.num_clients > MAX_CLIENTS:
            raise ConfigError(_p(path, "num_clients"), f"{self.num_clients:,} exceeds the {MAX_CLIENTS:,} clients a "
                                                       f"simulation may hold")
        if isinstance(self.server_val, bool) or not isinstance(self.server_val, int) or self.server_val < 0:
            raise ConfigError(_p(path, "server_val"), f"must be a sample count >= 0, got {self.server_val!r}")
        if self.server_val > 0 and self.partition == "files":
            raise ConfigError(_p(path, "server_val"), "is not supported with partition: files (no training pool "
                                                      "outside the clients' split files)")
        if self.server_val > 0 and self.local_split is not None:
            raise ConfigError(_p(path, "server_val"), "is not supported with local_split")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(_p(path, "val_fraction"), f"must be in [0, 1), got {self.val_fraction}")
        if self.rotations is not None and len(self.rotations) == 0:
            raise ConfigError(_p(path, "rotations"), "must list at least one angle (degrees)")
        if not 0.0 < self.test_fraction < 1.0:
            raise ConfigError(_p(path, "test_fraction"), f"must be in (0, 1), got {self.test_fraction}")
        if self.local_split is not None:
            if not isinstance(self.local_split, dict):
                raise ConfigError(_p(path, "local_split"), "must be a mapping {public: a, val: v, test: t}")
            mode = self.local_split.get("mode", "random")
            if mode not in ("random", "dataset"):
                raise ConfigError(_p(path, "local_split.mode"), f"{mode!r} is not allowed; choose one of: random (each "
                                                                f"client's samples split by the fractions), dataset "
                                                                f"(the dataset's own train/validation/test parts)")
            for k, v in self.local_split.items():
                if k == "mode":
                    continue
                if k not in ("public", "val", "test"):
                    raise ConfigError(_p(path, f"local_split.{k}"), "unknown key; allowed: public, val, test, mode")
                if mode == "dataset" and k != "public":
                    raise ConfigError(_p(path, f"local_split.{k}"), "comes from the dataset's own parts with mode: "
                                                                    "dataset (only public is a fraction: of each "
                                                                    "client's test part); remove it")
                if not isinstance(v, (int, float)) or not 0.0 <= float(v) < 1.0:
                    raise ConfigError(_p(path, f"local_split.{k}"), f"must be a fraction in [0, 1), got {v!r}")
            if mode == "dataset" and self.rotations:
                raise ConfigError(_p(path, "rotations"), "local_split mode: dataset takes the dataset's own domains "
                                                         "as they are; remove data.rotations")
            if sum(float(v) for k, v in self.local_split.items() if k != "mode") >= 1.0:
                raise ConfigError(_p(path, "local_split"), "public + val + test must leave a private share (< 1)")
            if self.val_fraction > 0:
                raise ConfigError(_p(path, "val_fraction"), "use local_split.val with local_split (not both)")
            if self.public is not None:
                raise ConfigError(_p(path, "public"), "local_split makes the clients' public shares the public "
                                                      "dataset; remove data.public")
            if self.partition == "files":
                raise ConfigError(_p(path, "local_split"), "is not supported with partition: files")
