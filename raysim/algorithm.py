"""The algorithm contract: plain Python over explicit state, no Ray.

An :class:`Algorithm` is constructed from its validated hyperparameters and a :class:`Task` on every process that
needs it (the driver for validation, each client runner, the server runner). It never names a backend.

A round is a *step schedule* (``schedule()``, see raysim/steps.py); the default one is the classic exchange built
from the hooks below. Round ``t`` of the default schedule (see ARCHITECTURE.md):

1. server: ``payload = broadcast(server_state, ctx)`` — one payload for the round (put in the object store once);
2. each sampled client: ``down = downlink(payload, client_id)`` (what that client actually downloads; accounted),
   ``client_update(down, client_state, data, ctx) -> ClientUpdate(state, upload, metrics)``;
3. server: ``aggregate(server_state, uploads, ctx) -> (server_state, metrics)``; server-side training (FedTGP's
   prototype generator, SlaugFL's GAN, FedGen's generator, clustering) happens here, on the server runner;
4. evaluation with the next round's payload: ``evaluate_client`` per client, ``evaluate_server`` once.

State is explicit and picklable (dicts of tensors), per-client randomness comes from ``ctx`` (derived from
(seed, round, client, purpose)), and nothing is kept in globals, so clients can run one after another, on any actor,
or — later — vectorised.

Methods with more than one exchange per round (MAFML, FedMD) override ``schedule()``; methods with a phase before
round 1 (SlaugFL, PN-ICFL) return one from ``setup_schedule()``; its steps run once, at round index -1, starting with
the empty payload ``{}``. Client steps get a :class:`Context`, server steps a :class:`ServerContext`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional

import numpy as np
import torch

from raysim.modelstate import load_live
from raysim import rng as rngmod
from raysim.config import TrainConfig
from raysim.data.arrays import ArrayDataset
from raysim.data.federated import ClientData
from raysim.errors import ConfigError
from raysim.messages import Payload
from raysim.models import SplitModel, arch_key, build_model
from raysim.steps import CLASSIC_ROUND, EVALUATION


@dataclass(frozen=True)
class Task:
    """What every algorithm instance may know: shapes, per-client architectures, training settings, the seed and
    the explicitly public data. Never a client's private data."""

    num_classes: int
    input_shape: tuple
    num_clients: int
    archs: tuple  # ArchSpec per client
    train: TrainConfig
    seed: int
    rounds: int
    public: Optional[ArrayDataset] = None
    val_fraction: float = 0.0  # data.val_fraction: whether clients hold a validation split (its size only)

    def build_model(self, client_id: int) -> SplitModel:
        return build_model(self.archs[client_id], self.input_shape, self.num_classes)

    @property
    def homogeneous(self) -> bool:
        return len({arch_key(a) for a in self.archs}) == 1


class ModelCache:
    """A runner's live objects, one per key, on the runner's device: the clients' models (one ``nn.Module`` per
    architecture; a client's weights are loaded into it in place) and whatever else a method keeps live between
    calls (generators, a second model, frozen copies, public data on the device). Runner-local, never state: the
    weights that matter are always loaded from the explicit state or payload."""

    def __init__(self, task: Task, device):
        self.task, self.device, self._models = task, device, {}

    def get(self, key, make: Optional[Callable[[], Any]] = None):
        """The object cached under ``key``, built by ``make()`` on first use (a module is moved to the runner's
        device; anything else is made there by ``make``). Building draws from torch's global RNG: the random stream
        is kept, so that when a cache is first filled never changes the numbers of the client being trained
        (sequential == ray, any actor layout). Without ``make``, ``key`` is an ArchSpec: that architecture's model."""
        if make is None:
            spec = key
            key = ("arch", arch_key(spec))
            make = lambda: build_model(spec, self.task.input_shape, self.task.num_classes)  # noqa: E731
        if key not in self._models:
            with rngmod.keep_global_rng():
                obj = make()
                self._models[key] = obj.to(self.device) if isinstance(obj, torch.nn.Module) else obj
        return self._models[key]


@dataclass
class Context:
    """What every step sees: who, when, where, and the derived random streams. A client step gets exactly this; a
    server step gets a :class:`ServerContext`."""

    round_idx: int
    client_id: int  # rngmod.SERVER on the server
    seed: int
    device: Any
    task: Task
    models: Optional[ModelCache] = None
    step: str = ""  # the schedule step being run
    iteration: int = 0  # repetition index inside a Repeat group

    def __post_init__(self):
        if self.models is None:  # a context built by hand (tests): a cache of its own
            self.models = ModelCache(self.task, self.device)

    def _purpose(self, purpose: str) -> str:
        return rngmod.stream_name(purpose, self.step, self.iteration)

    def rng(self, purpose: str) -> np.random.Generator:
        return rngmod.numpy_rng(self.seed, self.round_idx, self.client_id, self._purpose(purpose))

    def generator(self, purpose: str, device=None) -> torch.Generator:
        """A torch generator for (seed, round, client, purpose); on ``device`` when given (dropout masks are drawn
        on the device the activations live on)."""
        return rngmod.torch_generator(self.seed, self.round_idx, self.client_id, self._purpose(purpose),
                                      device=device if device is not None else "cpu")

    def stream(self, purpose: str) -> rngmod.Counter:
        """The counter-based stream for (seed, round, client, purpose) (:class:`raysim.rng.Counter`): a local
        training's batch orders and dropout masks, computed alike for one client or a whole group."""
        return rngmod.counter(self.seed, self.round_idx, self.client_id, self._purpose(purpose))

    def model(self, client_id: Optional[int] = None) -> SplitModel:
        """The cached live module for a client's architecture (load its weights before use)."""
        cid = self.client_id if client_id is None else client_id
        return self.models.get(self.task.archs[cid])


# the server-held data sets a method may declare in ``Algorithm.server_data``: name -> (the config field that provides
# it, what to set it to). Validated before a run; only declared ones reach the server runner
SERVER_DATA = {
    # carved class-stratified from the training pool before partitioning: disjoint from the clients' data and the
    # test set (the test set reaches evaluation steps only, as their argument)
    "server_val": ("data.server_val", "its size in samples (e.g. 1000; carved class-stratified from the training "
                                      "pool, disjoint from the clients' data and the test set)"),
    # the reported test set itself, for a method's *named option* that reproduces a paper selecting on it (SlaugFL's
    # ``selection: test``): never a class-level declaration, only an instance's (Algorithm.declared_server_data)
    "global_test": (None, "nothing to set: it is the run's test set, handed to the server only by a named option"),
}


@dataclass
class ServerContext(Context):
    """What a server step sees: the common context, the round's failed clients and the server-held data the method
    declared (``Algorithm.server_data``).

    A server step's ``uploads`` are the delivered ones: the engine has already dropped those of clients the
    environment let drop out or arrive late (:mod:`envs`), so the step never needs to know who was kept; when
    nobody delivered, ``uploads`` is empty."""

    failures: list = field(default_factory=list)  # (client_id, reason) of the round's failed clients
    server_data: dict = field(default_factory=dict)  # name (in Algorithm.server_data) -> ArrayDataset
    # server.mode: async, in async_aggregate only: {"rule", "mix" (the weight toward the aggregate), "staleness"
    # {client_id: tau}, "weights" {client_id: s(tau)}, "version", and with FedBuff "bases" {client_id: the server
    # state of its dispatch version} for the stale ones (tau > 0)} (raysim/asyncrules.py); None in synchronous rounds
    asynchronous: Optional[dict] = None

    def next_round(self) -> "ServerContext":
        """The context of the next round's broadcast (a round's last server step builds the next payload with it)."""
        return dataclasses.replace(self, round_idx=self.round_idx + 1, failures=[], step="broadcast")


@dataclass
class ClientUpdate:
    state: Any
    upload: Payload
    metrics: dict = field(default_factory=dict)


@dataclass
class ServerUpdate:
    """What a server step returns: the new server state, the payload for the next client step (None: unchanged)
    and server metrics."""

    state: Any
    payload: Optional[Payload] = None
    metrics: dict = field(default_factory=dict)


@dataclass(frozen=True)
class FrozenForward:
    """A frozen model the objective reads on every batch (MOON's global and previous models), for a vectorised group:
    ``module`` (in the mode it should run in, eval for a frozen copy) under ``weights`` -- a mapping name -> tensor
    shared by the group, or the key of the ``LocalStart.rows`` entry that holds each client's own -- called as
    ``module(xb, **kwargs)`` without autograd. The executor computes the group's outputs at every step (one grouped
    forward with the stacked weights where the model has a grouped form, ``vmap`` otherwise) and hands
    ``row_objective`` each client's outputs as ``rows[name]`` (name: its key in ``LocalStart.frozen``)."""

    module: Any
    weights: Any
    kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class StepDraws:
    """A client's random inputs of each local step (FedGen's noise and sampled labels), for a vectorised group:
    ``fn(batch_size, generator) -> {name: tensor}`` makes the same calls on ``generator`` (the client's own stream,
    ``generator`` here) in the same order as the per-client objective does at a step of that batch size. The executor
    calls it for every client before each of its steps and hands ``row_objective`` the client's draws in its rows
    (the shape probe calls it on a throw-away generator). ``group``: optionally, ``group(draws, yb) -> {name:
    tensor}``, more inputs computed from the group's stacked draws and labels ([K, ...]) at once, without autograd
    and outside ``vmap`` (FedGen: its frozen generator's outputs), added to the rows too. ``stacked``: optionally,
    for counter-based streams (:class:`raysim.rng.Counter`), ``stacked(batch_size, draws, cache) -> {name: [K,
    ...]}``, the whole group's draws at once (``draws``: the group's StepDraws, each with its stream and ``inputs``;
    ``cache``: a dict kept for these clients over their training, for what is computed once), the same bits as ``fn``
    per client, advancing each stream as ``fn`` does; ``inputs``: what ``stacked`` needs of this client."""

    fn: Any
    generator: Any
    group: Any = None
    stacked: Any = None
    inputs: Any = None


@dataclass
class LocalStart:
    """What ``client_init`` prepares for local training: the labels to train on (FedPU: observed labels) and
    whatever the objective needs from the payload (global prototypes, anchor weights, ...)."""

    y: Any = None  # None: data.y_train
    x: Any = None  # None: data.x_train; else the inputs to train on (SlaugFL: the client's own data plus its one-off
    # synthetic augmentation, kept in the client's state and never sent anywhere)
    aux: dict = field(default_factory=dict)
    # the weights the client starts from (name -> tensor: a state dict, or the parameters at least), loaded into the
    # live model by whoever runs the step (:meth:`LocalTraining.begin`; the vectorised executor stacks a group's in
    # one operation per parameter instead of loading each). None: client_init loaded the live model itself
    weights: Any = None
    # the objective's per-client inputs (name -> tensor, or -> a mapping name -> tensor such as a state dict, or rows
    # of a group's stacks): the vectorised executor stacks a group's [K, ...] (one operation per tensor) and hands
    # each client its own rows through ``LocalTraining.row_objective``; the per-client loop never reads them
    rows: dict = field(default_factory=dict)
    # frozen models whose outputs on each batch the objective reads (name -> FrozenForward): a vectorised group's are
    # computed for the whole group at every step and reach ``row_objective`` as ``rows[name]``
    frozen: dict = field(default_factory=dict)
    # the objective's random inputs of each step (StepDraws), drawn by a vectorised group's executor before each step
    # and handed to ``row_objective`` in the rows; None: none
    draws: Any = None


@dataclass(frozen=True)
class TrainedGroup:
    """Clients of one architecture that the vectorised executor trained together, as ``client_final_group`` sees
    them: ``trained`` maps each parameter name, and each batch-norm running statistic (``running_mean``, ...), to
    [K, ...] (client k's trained weights and statistics are row k); ``model`` is the live module of their
    architecture (its own weights and buffers are not theirs); the rest are per client, in row order."""

    model: Any
    trained: dict
    starts: list
    payloads: list
    states: list
    datas: list
    ctxs: list
    # the starts' per-client inputs (``LocalStart.rows``) as the executor stacked them (key -> [K, ...], or -> a
    # mapping name -> [K, ...]); empty when the objective has none
    rows: dict = field(default_factory=dict)

    def state_stacks(self) -> dict:
        """The group's trained state dicts as stacks (name -> [K, ...], the live model's state-dict order): the
        trained parameters and batch-norm running statistics (each client's own), and any other buffer (which no
        training forward updates) copied once and repeated as a view."""
        k = next(iter(self.trained.values())).shape[0]
        out = {}
        for name, t in self.model.state_dict(keep_vars=True).items():
            out[name] = self.trained[name] if name in self.trained else t.detach().clone().unsqueeze(0).expand(
                k, *t.shape)
        return out


# What an accuracy metric measures (issue 52): which model predicts, and over which classes. A method declares the
# kind of each metric it reports (:meth:`Algorithm.measures`); ``val_<x>`` is ``test_<x>``'s model on the validation
# split. ``raysim list`` prints them, and ``raysim report`` / ``compare`` refuse to compare one metric name across
# methods whose kinds differ unless told to (FedAvg's test_acc is the global model, FedProto's the client's own).
MEASURES = {
    "global": "the global model",
    "global_real_classes": "the global model, argmax over the real classes only",
    "personalised": "the client's own model",
    "cluster": "its cluster's model",
    "prototype_own": "nearest global prototype, among the client's own classes",
    "prototype_all": "nearest global prototype, among all classes",
    "cluster_prototype": "nearest prototype of its cluster",
    "local_prototype": "nearest of its own class prototypes",
}


def metric_kind(measures: dict, metric: str) -> Optional[str]:
    """The kind (a key of :data:`MEASURES`) of ``metric`` in a method's declaration; ``val_<x>`` takes ``test_<x>``'s
    (the same model on the validation split); None where the method does not declare it."""
    if metric in measures:
        return measures[metric]
    if metric.startswith("val_"):
        return measures.get("test_" + metric[len("val_"):])
    return None


class Algorithm:
    """Base class. Subclasses set ``name``, ``Params`` (a frozen dataclass of hyperparameters) and implement the
    hooks. The defaults describe a method that communicates nothing."""

    name: ClassVar[str] = "base"
    paper: ClassVar[str] = ""
    # whether the method reads the model's embedding or its body/head split (prototypes, personal heads, ...): a
    # user model without a known split (raysim.adapt.WholeModel) is refused for such methods when a run is prepared.
    # Methods that only use logits and whole state dicts set it to False.
    needs_embedding: ClassVar[bool] = True
    # the server-held data sets the server steps read (names in SERVER_DATA, e.g. ("server_val",)): a config without
    # one is refused before the run (a ConfigError naming its field); only these reach the server, as
    # ``ctx.server_data[name]``
    server_data: ClassVar[tuple] = ()
    # the message kinds the method's clients may send to the server (the privacy boundary, ``declared_uploads``);
    # None: undeclared
    uploads: ClassVar[Optional[frozenset]] = None
    # the client metrics the progress bar shows (the latest evaluated mean of each the run has reported)
    headline: ClassVar[tuple] = ("test_acc",)
    # ``backend.vectorize: auto`` runs the method's group forms on a CPU too, not only on a GPU: its client steps are
    # many small ones (per round, per client) whose per-step host work and torch's portable kernels dominate the
    # per-client form there, while its group form computes every hosted client's step as one (MAFML: 0.8-0.9x its
    # plain loop against 1.8-2.0x; benchmarks/PERFORMANCE.md). Where its group forms decline (other architectures, ...), the
    # per-client steps run: the same numbers as ``vectorize: false``.
    vectorize_on_cpu: ClassVar[bool] = False
    @classmethod
    def measures(cls, params: Optional[dict] = None) -> dict:
        """metric -> the kind of model it evaluates (a key of :data:`MEASURES`), for ``params`` (the config's
        ``algorithm.params``; the defaults where None): what ``raysim list`` prints and what ``raysim report`` /
        ``compare`` check before they put one metric of two methods side by side. Empty: undeclared."""
        return {}

    @classmethod
    def _param(cls, params: Optional[dict], name: str):
        """``name`` from a config's ``algorithm.params``, else the method's default."""
        if params and name in params:
            return params[name]
        return {f.name: f.default for f in dataclasses.fields(cls.Params)}.get(name)

    def declared_server_data(self) -> tuple:
        """The server-held data sets this instance's server steps read: the class's ``server_data``, plus what a named
        option of its params adds (``global_test``: the test set, for an option that reproduces a paper selecting on
        it; reported as such beside the default)."""
        return tuple(self.server_data)

    def declared_uploads(self) -> Optional[set]:
        """The message kinds this method's clients may send to the server (the privacy boundary: tests check that
        nothing else, and never a client's data, reaches the server): the class's ``uploads``. None: undeclared."""
        return None if self.uploads is None else set(self.uploads)

    @dataclass(frozen=True)
    class Params:
        pass

    def __init__(self, params: "Algorithm.Params", task: Task):
        self.params = params
        self.task = task

    # -- validation -------------------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ConfigError when the task does not suit the method (e.g. FedAvg with mixed architectures)."""

    def require_homogeneous(self) -> None:
        if not self.task.homogeneous:
            raise ConfigError("model.per_client", f"{self.name} averages whole models, so every client needs the same "
                                                  f"architecture; remove model.per_client or use a prototype method")

    # -- schedules ----------------------------------------------------------------------------------------------
    def schedule(self) -> tuple:
        """One round as steps (raysim.steps). Default: client_update on the sampled clients, then aggregate +
        broadcast of the next round's payload."""
        return CLASSIC_ROUND

    def setup_schedule(self) -> Optional[tuple]:
        """Steps run once before round 0 (round index -1), or None."""
        return None

    def evaluation_schedule(self) -> tuple:
        return EVALUATION

    def initial_payload(self, server_state: Any, ctx: ServerContext) -> Payload:
        """The payload the round ``ctx.round_idx`` starts with, built from the server state alone (run start and
        resume). Must equal what the previous round's last server step left, or download the same (``downlink``)."""
        return self.broadcast(server_state, ctx)

    def classic_aggregate(self, server_state: Any, uploads: dict, ctx: ServerContext) -> ServerUpdate:
        """The default schedule's server step: ``aggregate`` of the delivered uploads (skipped when nobody
        delivered), then ``broadcast`` of the next round's payload."""
        metrics = {}
        if uploads:
            server_state, metrics = self.aggregate(server_state, uploads, ctx)
        return ServerUpdate(server_state, self.broadcast(server_state, ctx.next_round()), dict(metrics))

    # -- server -------------------------------------------------------------------------------------------------
    def init_server_state(self, ctx: ServerContext) -> Any:
        return {}

    def broadcast(self, server_state: Any, ctx: ServerContext) -> Payload:
        return {}

    def aggregate(self, server_state: Any, uploads: dict, ctx: ServerContext) -> tuple[Any, dict]:
        return server_state, {}

    def merge_uploads(self, uploads: dict) -> Optional[dict]:
        """The default schedule's merge (``ServerStep.merge``): one upload that ``aggregate`` treats as the uploads
        of ``uploads`` (client id -> upload, sorted) together, or None when this method's aggregation is not a
        merge of sums (the default). A method whose ``aggregate`` is a weighted sum defines it (FedAvg: the sample-
        weighted average with the summed sample count); with ``backend.partial_aggregate`` each client runner then
        sends one merged upload per step. A subclass that overrides ``aggregate`` without its own merge is never
        merged (:func:`upload_merger`). The per-client message accounting is unchanged: it is made before merging."""
        return None

    @classmethod
    def settings_without_effect(cls, env: bool) -> tuple[str, ...]:
        """The ``backend`` switches (``vectorize``, ``partial_aggregate``) that cannot change this method's numbers
        (``env``: the run has an env section); they are left out of a run's identity with a notice."""
        return inert_switches(cls, env)

    # (a method with its own schedule() whose server steps merge only as the classic round's do overrides it with
    # ``inert_switches(cls, env, classic=True)``: FedAvg)

    def evaluate_server(self, server_state: Any, test: ArrayDataset, ctx: ServerContext) -> dict:
        return {}

    # -- client -------------------------------------------------------------------------------------------------
    def init_client_state(self, ctx: Context) -> Any:
        return {}

    def downlink(self, payload: Payload, client_id: int, ctx: Optional[Context] = None) -> Payload:
        """What ``client_id`` downloads of the payload (accounted). Runs inside the client's failure guard."""
        return payload

    def client_update(self, payload: Payload, state: Any, data: ClientData, ctx: Context) -> ClientUpdate:
        """Every method defines its local step; the base class has none."""
        raise TypeError(f"{type(self).__name__} does not define client_update")

    def evaluate_client(self, payload: Payload, state: Any, data: ClientData, ctx: Context) -> dict:
        return {}


# -- optional capabilities: what a method opts into beyond the base contract ----------------------------------------
# A mixin is listed before the method's base class (``class FedAvg(Asynchronous, LocalTraining)``). (Merging uploads
# stays a hook of every method, ``merge_uploads``: the classic schedule names it.)


class Asynchronous:
    """Opt-in to asynchronous aggregation (``server.mode: async``, FedBuff / FedAsync): the method's server state is
    moved toward the ``aggregate`` of the arrived uploads by :meth:`async_mix` (:meth:`async_aggregate`). Methods
    whose server step is not one aggregate of uploads (multi-exchange schedules, setup phases, control variates) do
    not opt in and refuse async with one line naming server.mode (raysim/asyncrules.py reads ``asynchronous``)."""

    asynchronous: ClassVar[bool] = True

    def async_aggregate(self, server_state: Any, uploads: dict, ctx: ServerContext) -> ServerUpdate:
        """The asynchronous server step (``server.mode: async``): the method's own ``aggregate`` of the arrived
        uploads (FedBuff's buffer, or FedAsync's one update) is the target, and the server state moves toward it by ``ctx.asynchronous["mix"]`` (FedBuff: server_lr * mean s(tau); FedAsync:
        alpha * s(tau); raysim/asyncrules.py) through :meth:`async_mix`; then the next version's broadcast.

        FedBuff (Nguyen et al. 2022) applies each client's delta against the version it was dispatched with: a stale
        upload (``ctx.asynchronous["bases"]``) is first rebased onto the current state (:meth:`async_rebase`), so
        for a weighted-mean aggregate ``target - x`` is the weighted mean of ``y_i - x_{v_i}`` and the step is
        ``x + eta_g * mean s(tau) * mean_i (y_i - x_{v_i})``."""
        metrics = {}
        if uploads:
            bases = (ctx.asynchronous or {}).get("bases") or {}
            uploads = {c: self.async_rebase(u, bases[c], server_state, ctx) if c in bases else u
                       for c, u in uploads.items()}
            target, metrics = self.aggregate(server_state, uploads, ctx)
            server_state = self.async_mix(server_state, target, float(ctx.asynchronous["mix"]), ctx)
        return ServerUpdate(server_state, self.broadcast(server_state, ctx.next_round()), dict(metrics))

    def async_rebase(self, upload: Payload, base_state: Any, server_state: Any, ctx: ServerContext) -> Payload:
        """FedBuff: ``upload`` as if the client had trained from the current ``server_state`` instead of
        ``base_state`` (the state of its dispatch version): its delta ``upload - base_state`` added to the current
        state. The default leaves the upload as it is — right for uploads that are observations rather than a
        trained copy of the server state (FedProto's and FedTGP's prototypes: the client's own model produced them);
        methods that upload a trained copy of the state (FedAvg's model, FedPer's shared part) override it."""
        return upload

    def async_mix(self, server_state: Any, target: Any, weight: float, ctx: ServerContext) -> Any:
        """``server_state + weight * (target - server_state)`` on every floating tensor (other leaves take the
        target's value). Methods whose state is not a plain point to interpolate override it (FedProto: per class
        and only where both have a prototype; FedTGP: the generator, then its prototypes)."""
        from raysim.shared_maths import mix_trees

        return mix_trees(server_state, target, weight)


class ReportsClusters:
    """Opt-in for clustered methods: ``evaluate_client`` reports each client's cluster as the metric ``cluster``;
    with ground-truth domains in the data (FederatedData.domains) the driver then adds the ARI of the assignment
    (ClusterAgreement)."""

    reports_clusters: ClassVar[bool] = True


# A client step ``fn`` may also have a *group form* ``<fn>_group(payloads, states, datas, ctxs)``: the same step
# for several clients of one runner at once (lists in the same order), returning one ClientUpdate per client,
# or None when it cannot take this group (the per-client loop runs). With ``backend.vectorize: true`` the runner
# calls it instead of ``fn`` per client. It promises the per-client results within the vectorised executor's
# stated tolerance, draws only from each client's own ``ctx.generator`` streams (never torch's global RNG) and
# does not modify its arguments; if it raises, the runner runs the per-client loop, so a failing client fails
# alone. Example: MAFML's ``local_group`` / ``step_global_group`` (all nodes' LeNets as one grouped network).


class LocalTraining(Algorithm):
    """A method whose client step is local minibatch training of the client's model, split FedJAX-style into

    * ``client_init(model, payload, state, data, ctx) -> LocalStart``: load the starting weights into the live
      ``model`` and unpack what the objective needs from the payload;
    * ``objective(start) -> loss_fn(model, xb, yb, epoch) -> (loss, parts)``: the local objective, a pure function
      of the model's parameters, buffers and dropout generator, the batch, the local epoch (0-based) and the
      payload-derived ``start.aux``;
    * optionally ``row_objective(start) -> loss_fn(model, xb, yb, epoch, rows)``: the same objective with the
      client's own inputs (``start.rows``) as an argument, for a vectorised group whose clients differ in them
      (MOON's previous model, SCAFFOLD's control variate): ``rows`` holds the client's rows of the stacks, and the loss
      must equal ``objective(start_i)``'s for client i given ``rows = start_i.rows``;
    * ``client_final(model, start, payload, state, data, ctx) -> (new_state, upload)``;
    * optionally ``client_final_group(group) -> [(new_state, upload)]``, the batch form of ``client_final`` for a
      group the vectorised executor trained together (:class:`TrainedGroup`): states and uploads may hold rows of the
      stacks (:class:`raysim.messages.Rows`), so a group's uploads stay stacked until they are reduced. None (the
      default): ``client_final`` per client.

    The per-client loop (:func:`raysim.training.local_sgd`) runs the steps with explicit counter-based streams (batch
    order ``"batches"``, dropout masks ``"dropout"``: :meth:`Context.stream`, the bits the vectorised executor draws
    for a whole group at once); with ``train.persist_optimizer`` the optimiser state (momentum) is
    kept in the client state under ``"opt"`` and continues next round. A vectorised executor batches the same three
    functions over many clients."""

    def live_model(self, ctx: Context):
        """The runner's live module for this client's architecture (weights are loaded into it)."""
        return ctx.model()

    def client_init(self, model, payload, state, data, ctx: Context) -> LocalStart:
        raise TypeError(f"{type(self).__name__} does not define client_init")

    def objective(self, start: LocalStart):
        raise TypeError(f"{type(self).__name__} does not define objective")

    def row_objective(self, start: LocalStart):
        """The objective with per-client inputs (class docstring): ``loss_fn(model, xb, yb, epoch, rows)``, where
        ``rows`` has ``start.rows``'s structure and holds one client's values (inside ``vmap``: its rows of the
        group's stacks). The vectorised executor uses it for a start with ``rows``; None (the default): none."""
        return None

    def client_final(self, model, start: LocalStart, payload, state, data, ctx: Context) -> tuple[Any, Payload]:
        raise TypeError(f"{type(self).__name__} does not define client_final")

    def client_final_group(self, group: TrainedGroup) -> Optional[list]:
        """The batch form of ``client_final`` (class docstring); None: ``client_final`` runs per client."""
        return None

    def begin(self, model, payload, state, data, ctx: Context) -> LocalStart:
        """``client_init``, then the start's declared weights (``LocalStart.weights``) loaded into the live model:
        what the per-client loop runs before the local steps."""
        start = self.client_init(model, payload, state, data, ctx)
        if start.weights is not None:
            load_live(model, start.weights)  # model.load_state_dict(start.weights), lighter (raysim.modelstate)
        return start

    def vectorizable(self, start: LocalStart) -> bool:
        """Opt-in to the vectorised executor (``backend.vectorize``): True promises that ``objective(start)`` depends
        only on what every client of the step shares (the broadcast payload) and on the client's own inputs declared
        in ``start.rows`` (then ``row_objective(start)`` takes them as an argument), so that one loss function serves a
        group of clients trained together, and that it is pure (no side effects, no generator or other state of its
        own; the epoch comes as an argument). Default False: the client runs in the per-client loop."""
        return False

    def client_update(self, payload, state, data, ctx: Context) -> ClientUpdate:
        from raysim.training import TrainOptions, local_sgd

        model = self.live_model(ctx)
        start = self.begin(model, payload, state, data, ctx)
        cfg = self.task.train
        opt_state = (state or {}).get("opt") if cfg.persist_optimizer else None
        y = data.y_train if start.y is None else start.y
        x = data.x_train if start.x is None else start.x
        metrics, opt_state = local_sgd(model, self.objective(start), x, y, TrainOptions(
            cfg, ctx.stream("batches"), ctx.stream("dropout"), optimizer_out=cfg.persist_optimizer), opt_state)
        new_state, upload = self.client_final(model, start, payload, state, data, ctx)
        if cfg.persist_optimizer:
            new_state = {**(new_state or {}), "opt": opt_state}
        return ClientUpdate(new_state, upload, metrics)


def upload_merger(algorithm: "Algorithm", step) -> Optional[Callable[[dict], Optional[dict]]]:
    """The merge a server step declares (``ServerStep.merge``), or None when it declares none, or when the class
    that defines the merge sits above the one that defines the aggregation it stands for (a subclass changed the
    aggregation and its parent's merge no longer describes it: e.g. SCAFFOLD or VHL under FedAvg)."""
    return getattr(algorithm, step.merge) if _merge_applies(type(algorithm), step) else None


def _merge_applies(cls: type, step) -> bool:
    """Whether the merge ``step`` declares describes class ``cls``'s aggregation (:func:`upload_merger`)."""
    name = getattr(step, "merge", None)
    if not name:
        return False
    targets = [step.method] + (["aggregate"] if step.method == "classic_aggregate" else [])

    def owner(attr):
        return next((c for c in cls.__mro__ if attr in vars(c)), None)

    m = owner(name)
    return not (m is None or m is Algorithm or any(owner(t) is None or not issubclass(m, owner(t)) for t in targets))


def inert_switches(cls: type, env: bool, classic: Optional[bool] = None) -> tuple[str, ...]:
    """The ``backend`` switches that cannot change method ``cls``'s numbers (dropped from a run's identity, with a
    notice: :meth:`raysim.config.ExperimentConfig.inert_backend`). ``vectorize``: a method that is not
    ``LocalTraining`` and has no group form ``<fn>_group`` always runs the per-client loop. ``partial_aggregate``:
    with an env section (it decides after a step which uploads arrive; merged uploads cannot be split) or when the
    method keeps the classic schedule and its merge does not apply (:func:`upload_merger`: SCAFFOLD under FedAvg).
    ``classic``: the method's schedules merge only where the classic round does (default: when it keeps
    ``Algorithm.schedule``); a method with its own ``schedule()`` keeps ``partial_aggregate`` unless its
    ``settings_without_effect`` says so (its steps are known only to an instance: FedAvg's says it)."""
    out = []
    groups = any(n.endswith("_group") and callable(getattr(cls, n, None)) for n in dir(cls))
    if not issubclass(cls, LocalTraining) and not groups:
        out.append("vectorize")
    classic = getattr(cls, "schedule", None) is Algorithm.schedule if classic is None else classic
    if env or (classic and not any(_merge_applies(cls, s) for s in CLASSIC_ROUND if hasattr(s, "merge"))):
        out.append("partial_aggregate")
    return tuple(out)
