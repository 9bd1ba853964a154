"""A FedAvg that fails on purpose for chosen clients (tests failures-as-values on both backends)."""
from dataclasses import dataclass, field

from algorithms.fedavg import FedAvg


class FailingFedAvg(FedAvg):
    name = "failing_fedavg"

    @dataclass(frozen=True)
    class Params(FedAvg.Params):
        fail_clients: list = field(default_factory=list)
        fail_round: int = 1

    def client_update(self, payload, state, data, ctx):
        if ctx.client_id in self.params.fail_clients and ctx.round_idx >= self.params.fail_round:
            raise RuntimeError(f"boom on client {ctx.client_id}")
        return super().client_update(payload, state, data, ctx)


class FailingDownlinkFedAvg(FedAvg):
    """A FedAvg whose downlink fails for chosen clients: a per-client failure, not a crashed actor call."""

    name = "failing_downlink"

    @dataclass(frozen=True)
    class Params(FedAvg.Params):
        fail_clients: list = field(default_factory=list)

    def downlink(self, payload, client_id, ctx=None):
        if client_id in self.params.fail_clients and ctx is not None and ctx.round_idx >= 1:
            raise RuntimeError(f"downlink failed for client {client_id}")
        return payload
