"""A toy method with a setup phase and two exchanges per round (one of them repeated), for the engine's tests.
Every message has a size that is easy to check by hand:

setup (round -1, all clients):
  server "setup_send"    -> payload {vec: 7 floats}
  client "setup_recv"    <- 7 floats;  -> {hello: 3 floats, n: 1 int64}
  server "setup_collect" (stores the total sample count)
round t (sampled clients):
  client "local"   <- {g: 4 floats}        -> {stat: 2 floats}
  server "combine" -> {combined: 5 floats}
  2 x [client "refine" <- 5 floats -> {r: 1 float};  server "merge"]
  server "finish"  -> next round's {g: 4 floats}
per sampled client and round: down 4 + 2*5 = 14 floats, up 2 + 2*1 = 4 floats (float32: 4 bytes each).
``refine`` runs one SGD-with-momentum step on w; the momentum lives in the client state and carries over from the
first repetition to the second within a round (reset at the round's first repetition).
"""
from dataclasses import dataclass

import torch

from raysim.algorithm import Algorithm, ClientUpdate, ServerUpdate
from raysim.messages import Message
from raysim.steps import ALL, ClientStep, Repeat, ServerStep


class ToyTwoExchange(Algorithm):
    name = "toy_two_exchange"

    @dataclass(frozen=True)
    class Params:
        repeats: int = 2

    def setup_schedule(self):
        return (ServerStep("setup_send"), ClientStep("setup_recv", clients=ALL), ServerStep("setup_collect"))

    def schedule(self):
        return (ClientStep("local"), ServerStep("combine"),
                Repeat(self.params.repeats, (ClientStep("refine"), ServerStep("merge"))), ServerStep("finish"))

    # -- server -------------------------------------------------------------------------------------------------
    def init_server_state(self, ctx):
        return {"g": torch.zeros(4), "total_n": torch.zeros((), dtype=torch.int64), "setup_runs": 0, "acc": torch.zeros(()),
                "last": {}}

    def broadcast(self, state, ctx):
        return {"g": Message("global_vector", {"g": state["g"].clone()})}

    def setup_send(self, state, uploads, ctx):
        return ServerUpdate({**state, "setup_runs": state["setup_runs"] + 1},
                            {"vec": Message("setup_vector", {"v": torch.arange(7, dtype=torch.float32)})})

    def setup_collect(self, state, uploads, ctx):
        total = sum(int(u["n"]["n"][0]) for u in uploads.values())
        return ServerUpdate({**state, "total_n": torch.tensor(total)}, None, {"setup_clients": float(len(uploads))})

    def combine(self, state, uploads, ctx):
        s = sum(float(u["stat"]["s"][0]) for u in uploads.values())
        # server-side per-client state, in the server state: each client's last statistic
        last = {**state["last"], **{cid: u["stat"]["s"].clone() for cid, u in uploads.items()}}
        c = torch.tensor([s, float(len(uploads)), 0.0, 0.0, 0.0])
        return ServerUpdate({**state, "last": last}, {"combined": Message("combined", {"c": c})}, {"combine_sum": s})

    def merge(self, state, uploads, ctx):
        r = sum(float(u["r"]["r"][0]) for u in uploads.values())
        return ServerUpdate({**state, "acc": state["acc"] + r}, None, {f"merge_{ctx.iteration}": r})

    def finish(self, state, uploads, ctx):
        seen = sorted(state["last"])  # every client the server has heard from so far
        last = sum(float(state["last"][c][0]) for c in seen)
        g = state["g"] + torch.tensor([0.1, 0.2, 0.3 + 0.001 * last, float(state["total_n"]) + len(seen)]) * 0.01
        new = {**state, "g": g}
        return ServerUpdate(new, self.broadcast(new, ctx.next_round()))

    # -- client -------------------------------------------------------------------------------------------------
    def init_client_state(self, ctx):
        return {"w": torch.full((3,), float(ctx.client_id)), "s": torch.zeros(()), "refines": 0,
                "mom": torch.zeros(3), "mom_round": -2}

    def setup_recv(self, payload, state, data, ctx):
        s = payload["vec"]["v"].sum()
        up = {"hello": Message("hello", {"h": torch.tensor([float(ctx.client_id), 0.0, 0.0])}),
              "n": Message("num_samples", {"n": torch.tensor([data.num_train], dtype=torch.int64)})}
        return ClientUpdate({**state, "s": s}, up)

    def local(self, payload, state, data, ctx):
        w = state["w"] + payload["g"]["g"][:3] + state["s"] * 0.001
        up = {"stat": Message("stat", {"s": torch.tensor([float(w.sum()), float(ctx.client_id)])})}
        return ClientUpdate({**state, "w": w}, up, {"train_loss": float(w.abs().mean())})

    def refine(self, payload, state, data, ctx):
        c = payload["combined"]["c"]
        w = state["w"].clone().requires_grad_(True)
        mom = state["mom"] if state["mom_round"] == ctx.round_idx else torch.zeros(3)  # momentum within the round
        opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
        if state["mom_round"] == ctx.round_idx:
            opt.state[w] = {"momentum_buffer": mom.clone()}
        loss = ((w - c[0] / 100.0) ** 2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        new = {**state, "w": w.detach(), "refines": state["refines"] + 1,
               "mom": opt.state[w]["momentum_buffer"].detach().clone(), "mom_round": ctx.round_idx}
        return ClientUpdate(new, {"r": Message("refined", {"r": torch.tensor([float(w.detach().sum())])})},
                            {"train_loss": float(loss.detach())})

    def evaluate_client(self, payload, state, data, ctx):
        return {"test_acc": float(torch.sigmoid(state["w"].sum())), "refines": float(state["refines"])}
