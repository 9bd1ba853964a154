"""Typed, size-accounted messages.

Everything a client uploads or downloads is a :class:`Message`: a kind (what the method says it sends, e.g.
``"prototypes"``) and a flat dict of tensors. Sizes are computed from the tensors themselves, so the accounting is
exactly what crosses the (simulated) wire. A :data:`Payload` is a dict of named messages.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch


@dataclass(frozen=True)
class Message:
    kind: str
    tensors: Mapping[str, torch.Tensor] = field(default_factory=dict)
    meta: Mapping[str, object] = field(default_factory=dict)  # small scalars (ints, strings), not accounted

    def __post_init__(self):
        for name, t in self.tensors.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"message {self.kind!r}: entry {name!r} is {type(t).__name__}, expected a torch.Tensor")

    @property
    def num_floats(self) -> int:
        return sum(t.numel() for t in self.tensors.values() if t.is_floating_point())

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

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
            return obj if all(t.device == device for t in obj.tensors.values()) else obj.to(device)
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
