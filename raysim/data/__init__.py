from raysim.data.datasets import LOADERS, ArrayDataset, DataError, load_dataset
from raysim.data.federated import ClientData, FederatedData, build_federated_data
from raysim.data.partition import PARTITIONERS, Partition

__all__ = ["LOADERS", "PARTITIONERS", "ArrayDataset", "ClientData", "DataError", "FederatedData", "Partition",
           "build_federated_data", "load_dataset"]
