"""A FedAvg that fails on purpose for chosen clients (tests failures-as-values on both backends)."""
from dataclasses import dataclass, field

from algorithms.fedavg import FedAvg
from algorithms.fedproto import FedProto


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


class NaNFedAvg(FedAvg):
    """A FedAvg whose chosen clients diverge on purpose from ``nan_round`` on: a NaN loss (``where=loss``) or a NaN
    in the uploaded weights with a finite loss (``where=upload``)."""

    name = "nan_fedavg"

    @dataclass(frozen=True)
    class Params(FedAvg.Params):
        nan_clients: list = field(default_factory=list)
        nan_round: int = 1
        where: str = "loss"

    def client_update(self, payload, state, data, ctx):
        res = super().client_update(payload, state, data, ctx)
        if ctx.client_id in self.params.nan_clients and ctx.round_idx >= self.params.nan_round:
            if self.params.where == "loss":
                res.metrics["train_loss"] = float("nan")
            else:
                msg = next(iter(res.upload.values()))
                next(iter(msg.tensors.values())).view(-1)[0] = float("inf")
        return res


class DyingFedProto(FedProto):
    """A FedProto whose hosting process dies (os._exit) the first time ``die_client`` runs in ``die_round``: a killed
    actor mid-step. A marker file in ``marker_dir`` makes it happen once (a retried client then runs normally)."""

    name = "dying_fedproto"

    @dataclass(frozen=True)
    class Params(FedProto.Params):
        marker_dir: str = ""
        die_client: int = 1
        die_round: int = 1
        how: str = "exit"  # exit: the process ends; stop: it stops itself (SIGSTOP: alive but never answers)

    def client_update(self, payload, state, data, ctx):
        import os
        import signal

        marker = os.path.join(self.params.marker_dir, "died")
        if ctx.client_id == self.params.die_client and ctx.round_idx == self.params.die_round and \
                not os.path.exists(marker):
            open(marker, "w").close()
            if self.params.how == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            os._exit(1)
        return super().client_update(payload, state, data, ctx)


class PlacementProbe(FedAvg):
    """A FedAvg whose clients report, with their test metrics, where they ran: the process, the GPUs Ray made
    reserved for it and whether the model stayed on the CPU."""

    name = "placement_probe"

    def evaluate_client(self, payload, state, data, ctx):
        import os

        from ray._private.worker import global_worker

        out = super().evaluate_client(payload, state, data, ctx)
        # the GPU slots Ray reserved for this actor (ray.get_gpu_ids() would map them through CUDA_VISIBLE_DEVICES,
        # which the test session leaves empty: tests/conftest.py)
        ids = sorted({i for name, slots in global_worker.core_worker.resource_ids().items() if name == "GPU"
                      for i, _ in slots})
        out["probe_pid"] = float(os.getpid())
        out["probe_gpus_visible"] = float(len(ids))
        out["probe_gpu_id"] = float(ids[0]) if ids else -1.0
        out["probe_on_cpu"] = float(str(ctx.device) == "cpu")
        out["probe_cuda_hidden"] = float(os.environ.get("CUDA_VISIBLE_DEVICES") == "")
        return out


class PoolProbe(FedProto):
    """A FedProto (any mix of architectures) whose clients report the Ray resources of the process they ran in."""

    name = "pool_probe"

    def evaluate_client(self, payload, state, data, ctx):
        import os

        import ray

        out = super().evaluate_client(payload, state, data, ctx)
        try:  # in an actor: its resources; in the driver (the sequential backend) there are none
            got = ray.get_runtime_context().get_assigned_resources()
        except Exception:
            got = {}
        out["probe_pid"] = float(os.getpid())
        out["probe_gpu_share"] = float(got.get("GPU", 0.0))
        out["probe_cpu_share"] = float(got.get("CPU", 0.0))
        return out


class HoldFedProto(FedProto):
    """A FedProto that lets a study be killed mid-trial at a known point: with RAYSIM_TEST_HOLD_DIR set, every run
    appends a line to ``runs`` there in its first round, and the third run, in its second round, writes ``holding``
    and waits until ``release`` exists (tests/test_tuning.py kills the study while it waits)."""

    name = "hold_fedproto"

    def aggregate(self, server_state, uploads, ctx):
        import os
        import time
        from pathlib import Path

        hold = os.environ.get("RAYSIM_TEST_HOLD_DIR")
        if hold:
            d = Path(hold)
            if ctx.round_idx == 0:
                with open(d / "runs", "a") as f:
                    f.write("run\n")
            elif ctx.round_idx == 1 and len((d / "runs").read_text().splitlines()) == 3:
                (d / "holding").write_text("")
                while not (d / "release").exists():
                    time.sleep(0.05)
        return super().aggregate(server_state, uploads, ctx)


class NondeterministicAvg(FedAvg):
    """A FedAvg whose server reports a number from the operating system's entropy (raysim.testing's determinism
    check must catch it)."""

    name = "nondet_avg"

    def aggregate(self, server_state, uploads, ctx):
        import os

        state, metrics = super().aggregate(server_state, uploads, ctx)
        return state, {**metrics, "entropy": float(int.from_bytes(os.urandom(4), "little"))}


class UndeclaredUploadAvg(FedAvg):
    """A FedAvg whose clients also upload a kind it does not declare (raysim.testing's accounting check must catch
    it)."""

    name = "undeclared_avg"

    def client_final(self, model, start, payload, state, data, ctx):
        import torch
        from raysim.messages import Message

        state, upload = super().client_final(model, start, payload, state, data, ctx)
        upload["extra"] = Message("extra_kind", {"x": torch.zeros(3)})
        return state, upload
