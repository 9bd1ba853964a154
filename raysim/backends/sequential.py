"""In-process backend for debugging and tests: one server runner, one client runner hosting every client."""
from __future__ import annotations

import os

import shutil

from raysim.backends.base import NO_FOLLOW, Backend, BackendReport, run_state_dir
from raysim.runner.runners import ClientRunner, ServerRunner, server_data


class SequentialBackend(Backend):
    name = "sequential"

    def __init__(self, spec, fed_data, settings):
        self.spec, self.fed_data, self.settings = spec, fed_data, settings  # settings: engine.settings.BackendSettings
        self.server: ServerRunner | None = None
        self.clients: ClientRunner | None = None
        self._state_dir = None  # this run's state stores (start), removed at shutdown

    def start(self) -> None:
        self.spec, self._state_dir = run_state_dir(self.spec, self.settings)
        self.server = ServerRunner(self.spec, self.fed_data.global_test, server_data(self.spec, self.fed_data))
        self.clients = ClientRunner(self.spec, self.fed_data.clients)

    def initial_payload(self, round_idx):
        return self.server.initial_payload(round_idx)

    def client_step(self, step, payload, round_idx, iteration, client_ids, follow=NO_FOLLOW):
        uploads, reports = self.clients.run_client_step(step, payload, round_idx, iteration, client_ids,
                                                        follow.merge)
        return [uploads], reports

    def commit(self, client_ids, token=None):
        self.clients.commit(client_ids, token)
        self.clients.discard()

    def server_step(self, step, round_idx, iteration, uploads, failures, keep=None):
        return self.server.run_server_step(step, round_idx, iteration, failures, *(uploads or []), keep=keep)

    def save_checkpoint(self, directory):
        self.server.save(os.path.join(directory, "server.pt"))
        self.clients.save_shard(os.path.join(directory, "clients-0.pt"))
        return {"server": "server.pt", "clients": ["clients-0.pt"]}

    def load_checkpoint(self, directory, manifest):
        self.server.load(os.path.join(directory, manifest["server"]))
        self.clients.load_shards([os.path.join(directory, f) for f in manifest["clients"]])

    def save_messages(self, path, payloads, uploads):
        self.server.save_messages(path, payloads, uploads)

    def load_messages(self, path):
        data = self.server.load_messages(path)
        return data["payloads"], {b: [group] for b, group in data["uploads"].items()}

    def report(self):
        return BackendReport(store=[self.clients.store_stats()], fallbacks=self.clients.fallbacks_taken())

    def shutdown(self) -> None:
        for r in (self.clients, self.server):
            if r is not None:
                r.close()
        if self._state_dir:
            shutil.rmtree(self._state_dir, ignore_errors=True)
