"""The backend interface the round loop talks to. Handles (payload, uploads) are opaque: in-process objects for the
sequential backend, Ray object references for the Ray backend."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class Backend(ABC):
    name = "base"

    def start(self) -> None: ...

    @abstractmethod
    def broadcast(self, round_idx: int) -> Any:
        """Build the round's payload on the server and return a handle to it."""
        ...

    @abstractmethod
    def client_updates(self, payload: Any, round_idx: int, client_ids: list[int]) -> tuple[Any, list]:
        """Run the sampled clients; return (handle to their uploads, ClientReports sorted by client id)."""
        ...

    @abstractmethod
    def aggregate(self, round_idx: int, uploads: Any, failures: list, keep: list | None = None) -> dict:
        """Aggregate the uploads (only those of ``keep``, when given)."""
        ...

    @abstractmethod
    def evaluate_clients(self, payload: Any, round_idx: int, client_ids: list[int]) -> list:
        ...

    @abstractmethod
    def evaluate_server(self, round_idx: int) -> dict:
        ...

    @abstractmethod
    def get_state(self) -> tuple[Any, dict]:
        """(server state, {client_id: client state}) on CPU, for checkpoints."""
        ...

    @abstractmethod
    def set_state(self, server_state: Any, client_states: dict) -> None:
        ...

    def shutdown(self) -> None: ...
