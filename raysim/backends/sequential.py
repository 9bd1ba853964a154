"""In-process backend for debugging and tests: one server runner, one client runner hosting every client."""
from __future__ import annotations

from raysim.backends.base import Backend
from raysim.runtime import ClientRunner, ServerRunner


class SequentialBackend(Backend):
    name = "sequential"

    def __init__(self, spec, fed_data):
        self.spec, self.fed_data = spec, fed_data

    def start(self) -> None:
        self.server = ServerRunner(self.spec, self.fed_data.global_test)
        self.clients = ClientRunner(self.spec, self.fed_data.clients)

    def broadcast(self, round_idx):
        return self.server.broadcast(round_idx)

    def client_updates(self, payload, round_idx, client_ids):
        return self.clients.run_updates(payload, round_idx, client_ids)

    def aggregate(self, round_idx, uploads, failures, keep=None):
        return self.server.aggregate(round_idx, failures, uploads, keep=keep)

    def evaluate_clients(self, payload, round_idx, client_ids):
        return self.clients.evaluate(payload, round_idx, client_ids)

    def evaluate_server(self, round_idx):
        return self.server.evaluate(round_idx)

    def get_state(self):
        return self.server.get_state(), self.clients.get_states()

    def set_state(self, server_state, client_states):
        self.server.set_state(server_state)
        self.clients.set_states(client_states)
