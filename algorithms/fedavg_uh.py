"""FedAvg-UH: FedAvg (McMahan et al., AISTATS 2017) with the fixed, orthogonally initialised head of FedProto-UH
(seed 000, "固定头 UH"; reference §1.10): every client's last layer is the frozen linear layer logits = W z (no bias),
W (C x d) with orthonormal rows drawn from the experiment seed (:func:`algorithms.fedproto_uh.uh_model`, ``linear``),
never trained; the feature extractor is trained and averaged as in FedAvg. The seed reports that the fixed head does
not suit FedAvg ("UH 并不适用于 FedAvg 方法,使用后反而会使得准确率降低": it lowers FedAvg's accuracy).

The head is part of the model's state, so it travels with every weights message (C*d floats; FedAvg's messages are
the whole state) and averaging leaves it unchanged (every client holds the same W). Classic rounds only (not the
iteration mode), the per-client loop (not vectorised), synchronous server."""
from __future__ import annotations

from algorithms.fedavg import FedAvg
from algorithms.fedproto_uh import uh_model
from algorithms.prototype_maths import orthogonal_head
from raysim import rng as rngmod
from raysim.errors import ConfigError
from raysim.models import arch_key


class FedAvgUH(FedAvg):
    name = "fedavg_uh"
    asynchronous = False  # server.mode: async not supported (not tested with buffered aggregation)
    paper = "McMahan et al., FedAvg, AISTATS 2017 + the fixed orthogonal head of FedProto-UH (seed 000)"

    def validate(self):
        super().validate()
        if self.iteration_mode:
            raise ConfigError("algorithm.params.sync_every", "fedavg_uh runs classic rounds (sync_every: 0)")
        d = self.task.build_model(0).embed_dim
        if self.task.num_classes > d:
            raise ConfigError("model.params.embed_dim", f"an orthogonal head needs embed_dim >= num_classes "
                                                        f"({self.task.num_classes}), got {d}")

    def head_weight(self, embed_dim: int):
        """W (C x embed_dim), orthonormal rows, a pure function of the experiment seed (every client rebuilds it)."""
        g = rngmod.torch_generator(self.task.seed, rngmod.NO_ROUND, rngmod.SERVER, "uh_head")
        return orthogonal_head(self.task.num_classes, embed_dim, g)

    def _with_head(self, base):
        return uh_model(base, self.head_weight(base.embed_dim), 1.0, False, "linear")

    def _uh(self, ctx, base, client_id: int):
        return ctx.models.get(("uh", arch_key(self.task.archs[client_id])), lambda: self._with_head(base))

    def build_global_model(self):
        return self._with_head(self.task.build_model(0))

    def live_model(self, ctx):
        return self._uh(ctx, ctx.model(), ctx.client_id)

    def global_model(self, ctx):
        return self._uh(ctx, ctx.model(0), 0)

    def vectorizable(self, start) -> bool:
        return False  # the vectorised executor trains the zoo's module, not the fixed-head one
