"""Typed, size-accounted messages.

Everything a client uploads or downloads is a :class:`Message`: a kind (what the method says it sends, e.g.
``"prototypes"``) and a flat dict of tensors. Sizes are computed from the tensors themselves, so the accounting is
exactly what crosses the (simulated) wire. A :data:`Payload` is a dict of named messages.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Mapping, Optional, Sequence

import torch


class Rows(Mapping):
    """Row ``row`` of a group's stacked tensors (``stacks``: name -> [K, ...]) as a mapping name -> tensor: what the
    vectorised executor's uploads and states hold, so that a group's uploads stay stacked until they are reduced (a
    partial aggregate of rows of one stack is one reduction: :func:`stacked_rows`, :func:`raysim.shared_maths.
    weighted_average_states`). Reading an entry gives a view of its row; nothing is copied. Pickled (a transport, a
    spilled or checkpointed state) or deep-copied as a plain dict of its own rows' copies, never the whole stack.
    The stacks must not change after the rows are handed out (the executor's trained parameters do not)."""

    __slots__ = ("stacks", "row")

    def __init__(self, stacks: Mapping[str, torch.Tensor], row: int):
        self.stacks, self.row = stacks, int(row)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.stacks[name][self.row]

    def __iter__(self) -> Iterator[str]:
        return iter(self.stacks)

    def __len__(self) -> int:
        return len(self.stacks)

    def __contains__(self, name) -> bool:
        return name in self.stacks

    def entries(self) -> Iterator[tuple[int, int, bool]]:
        """(numel, element size, is floating) of each entry, from the stacks (no view made)."""
        for t in self.stacks.values():
            yield t.numel() // max(1, t.shape[0]), t.element_size(), t.is_floating_point()

    def __reduce__(self):
        return dict, ({k: v[self.row].clone() for k, v in self.stacks.items()},)

    def __repr__(self) -> str:
        return f"Rows(row {self.row} of {len(self.stacks)} stacks)"


class Layered(Mapping):
    """``top``'s entries over ``base``'s (a client's own state under the parts a broadcast replaces: FedPer's start),
    without copying either; :func:`row_source` sees through it to rows of a stack."""

    __slots__ = ("top", "base")

    def __init__(self, top: Mapping, base: Mapping):
        self.top, self.base = top, base

    def __getitem__(self, name: str):
        return self.top[name] if name in self.top else self.base[name]

    def __iter__(self) -> Iterator[str]:
        yield from self.base
        yield from (k for k in self.top if k not in self.base)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, name) -> bool:
        return name in self.top or name in self.base

    def __reduce__(self):
        return dict, ({k: self[k] for k in self},)


def row_source(mapping: Mapping, name: str):
    """(stacks, row) when ``mapping[name]`` is row ``row`` of ``stacks[name]`` (a :class:`Rows`, possibly under a
    :class:`Layered` top that does not hold ``name``), else None."""
    while isinstance(mapping, Layered):
        mapping = mapping.top if name in mapping.top else mapping.base
    return (mapping.stacks, mapping.row) if isinstance(mapping, Rows) else None


def rows_of(stacks: Mapping[str, torch.Tensor]) -> list[Rows]:
    """Every row of ``stacks`` (name -> [K, ...]) as a :class:`Rows` mapping, in row order."""
    k = next(iter(stacks.values())).shape[0] if stacks else 0
    return [Rows(stacks, j) for j in range(k)]


def stacked_rows(mappings: Sequence[Mapping]) -> Optional[tuple[Mapping[str, torch.Tensor], list[int]]]:
    """(the stacks, the row of each mapping) when every mapping is a :class:`Rows` of one and the same stacks, else
    None: the caller then reduces the rows of the stacks in one operation instead of one per mapping."""
    if not mappings or not all(isinstance(m, Rows) for m in mappings):
        return None
    stacks = mappings[0].stacks
    if any(m.stacks is not stacks for m in mappings):
        return None
    return stacks, [m.row for m in mappings]


def stacked_segments(mappings: Sequence[Mapping]) -> Optional[list[tuple[Mapping[str, torch.Tensor], list[int]]]]:
    """When every mapping is a :class:`Rows`: [(stacks, rows)] for each run of consecutive mappings that are rows of
    the same stacks (a group trained in chunks gives one run per chunk), in order; else None."""
    if not mappings or not all(isinstance(m, Rows) for m in mappings):
        return None
    out: list = []
    for m in mappings:
        if out and out[-1][0] is m.stacks:
            out[-1][1].append(m.row)
        else:
            out.append((m.stacks, [m.row]))
    return out


def _entries(tensors: Mapping) -> Iterator[tuple[int, int, bool]]:
    if isinstance(tensors, Rows):
        yield from tensors.entries()
        return
    for t in tensors.values():
        yield t.numel(), t.element_size(), t.is_floating_point()


@dataclass(frozen=True)
class Message:
    kind: str
    tensors: Mapping[str, torch.Tensor] = field(default_factory=dict)
    meta: Mapping[str, object] = field(default_factory=dict)  # small scalars (ints, strings), not accounted

    def __post_init__(self):
        if isinstance(self.tensors, Rows):  # rows of stacked tensors: the stacks are checked, no row is read
            items = self.tensors.stacks.items()
        else:
            items = self.tensors.items()
        for name, t in items:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"message {self.kind!r}: entry {name!r} is {type(t).__name__}, expected a torch.Tensor")

    @property
    def num_floats(self) -> int:
        return sum(n for n, _, fp in _entries(self.tensors) if fp)

    @property
    def num_bytes(self) -> int:
        return sum(n * size for n, size, _ in _entries(self.tensors))

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def to(self, device) -> "Message":
        return Message(self.kind, {k: v.to(device) for k, v in self.tensors.items()}, self.meta)


Payload = dict  # dict[str, Message]


def payload_sizes(payload: Mapping[str, Message]) -> dict[str, tuple[int, int]]:
    """kind -> (floats, bytes), summed over the payload's messages."""
    out: dict[str, tuple[int, int]] = {}
    for msg in payload.values():
        f, b = out.get(msg.kind, (0, 0))
        out[msg.kind] = (f + msg.num_floats, b + msg.num_bytes)
    return out


def tensor_bytes(obj) -> int:
    """The bytes of every tensor inside ``obj`` (messages, dicts, lists, tuples): what a transport moves for it, its
    pickling overhead left out (the Ray backend's object-store accounting)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, Message):
        return obj.num_bytes
    if isinstance(obj, Rows):
        return sum(n * size for n, size, _ in obj.entries())
    if isinstance(obj, Mapping):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def state_message(kind: str, state_dict: Mapping[str, torch.Tensor]) -> Message:
    """A model (or part of one) as a message: its tensors copied (one copy each, outside autograd), on their device
    -- a client runner's uploads stay on its device until they leave its process (the Ray client actor moves them to
    the host: :func:`payload_to`). Pass ``model.state_dict(keep_vars=True)``: the parameters themselves, no detached
    views made only to be copied.

    The copy matters: ``model.state_dict()`` aliases the runner's live module, which the next client's weights are
    loaded into in place, so without it every upload of a runner would end up holding the last client's weights."""
    with torch.no_grad():
        return Message(kind, {k: v.clone() for k, v in state_dict.items()})


def payload_to(payload, device):
    """A payload (a dict of :class:`Message`, or a dict of such payloads by client) with every tensor on
    ``device``; the very same object when all already are (no copies)."""
    device = torch.device(device)

    def moved(obj):
        if isinstance(obj, Message):
            ts = obj.tensors.stacks if isinstance(obj.tensors, Rows) else obj.tensors
            return obj if all(t.device == device for t in ts.values()) else obj.to(device)
        if isinstance(obj, Mapping):
            new = {k: moved(v) for k, v in obj.items()}
            return obj if all(new[k] is obj[k] for k in obj) else new
        if isinstance(obj, torch.Tensor):
            return obj if obj.device == device else obj.to(device)
        return obj

    return moved(payload)


MESSAGE_TAG = "__raysim_message__"


def to_plain(obj):
    """Payloads and uploads as tensors and plain containers (what checkpoint files hold: raysim.io.files.load_file
    reads nothing else): each :class:`Message` becomes a tagged dict; :func:`from_plain` rebuilds it. A message of
    another class (a method's own subclass) is refused: it would come back as a plain Message."""
    if isinstance(obj, Message):
        if type(obj) is not Message:
            raise TypeError(f"{type(obj).__name__} messages cannot be written to a checkpoint file")
        return {MESSAGE_TAG: obj.kind, "tensors": dict(obj.tensors), "meta": dict(obj.meta)}
    if isinstance(obj, Mapping):
        return {k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_plain(v) for v in obj)
    return obj


def from_plain(obj):
    if isinstance(obj, dict):
        if MESSAGE_TAG in obj:
            return Message(obj[MESSAGE_TAG], dict(obj["tensors"]), dict(obj["meta"]))
        return {k: from_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(from_plain(v) for v in obj)
    return obj
