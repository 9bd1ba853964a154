from raysim.data.arrays import ArrayDataset
from raysim.data.datasets import LOADERS, load_dataset
from raysim.errors import DataError
from raysim.data.federated import ClientData, FederatedData, build_federated_data
from raysim.data.arrays import Partition
from raysim.data.partition import PARTITIONERS

__all__ = ["LOADERS", "PARTITIONERS", "ArrayDataset", "ClientData", "DataError", "FederatedData", "Partition",
           "build_federated_data", "load_dataset"]
