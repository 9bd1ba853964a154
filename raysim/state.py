"""Checkpoints: the server state, every client's state and the round counter, in one torch file per checkpoint."""
from __future__ import annotations

import os
from pathlib import Path

import torch


def save_checkpoint(path: Path, round_idx: int, server_state, client_states: dict, extra: dict | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"round_idx": round_idx, "server_state": server_state, "client_states": client_states,
                "extra": extra or {}}, tmp)
    os.replace(tmp, path)
    return path


def load_checkpoint(path: Path) -> dict:
    return torch.load(Path(path), map_location="cpu", weights_only=False)
