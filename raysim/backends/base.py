"""The backend interface the round loop talks to. Handles (payload, uploads) are opaque: in-process objects for the
sequential backend, Ray object references for the Ray backend."""
from __future__ import annotations

from typing import Any


class Backend:
    name = "base"

    def start(self) -> None: ...

    def broadcast(self, round_idx: int) -> Any:
        """Build the round's payload on the server and return a handle to it."""
        raise NotImplementedError

    def client_updates(self, payload: Any, round_idx: int, client_ids: list[int]) -> tuple[Any, list]:
        """Run the sampled clients; return (handle to their uploads, ClientReports sorted by client id)."""
        raise NotImplementedError

    def aggregate(self, round_idx: int, uploads: Any, failures: list, keep: list | None = None) -> dict:
        """Aggregate the uploads (only those of ``keep``, when given)."""
        raise NotImplementedError

    def evaluate_clients(self, payload: Any, round_idx: int, client_ids: list[int]) -> list:
        raise NotImplementedError

    def evaluate_server(self, round_idx: int) -> dict:
        raise NotImplementedError

    def get_state(self) -> tuple[Any, dict]:
        """(server state, {client_id: client state}) on CPU, for checkpoints."""
        raise NotImplementedError

    def set_state(self, server_state: Any, client_states: dict) -> None:
        raise NotImplementedError

    def shutdown(self) -> None: ...
