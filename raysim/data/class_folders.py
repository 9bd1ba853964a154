"""Labelled images from a folder with one sub-folder per class index, ``root/<class index>/<image>`` (SlaugFL's
candidate data, ``algorithm.params.candidate_dir``), converted to a task's channels and size; pixels in [0, 1].

Unlike the ``imagefolder`` dataset format (raysim/data/formats.py: train/ and test/ splits, class names sorted into
labels, uint8 pixels), the folder names *are* the labels of the task, so a folder may hold a subset of its classes."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from raysim.errors import DamagedFileError, DataError, read_problem

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")


def load_class_folders(root: str, input_shape, num_classes: int,
                       key: str = "algorithm.params.candidate_dir") -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y): every image of ``root/<c>/`` for the class indices c < ``num_classes`` (sorted folder and file
    names; other folders and files are skipped), converted to ``input_shape`` (C, H, W) with C 1 (grey) or 3 (RGB),
    float32 pixels in [0, 1], and int64 labels c. ``key`` names the config field in errors."""
    from PIL import Image

    xs, ys = [], []
    ch, h, w = (int(v) for v in input_shape)
    for sub in sorted(Path(root).expanduser().iterdir()):
        if not sub.is_dir() or not sub.name.isdigit() or int(sub.name) >= num_classes:
            continue
        for f in sorted(sub.iterdir()):
            if f.suffix.lower() not in IMAGE_EXTENSIONS:
                continue
            try:
                with Image.open(f) as im:
                    img = im.convert("L" if ch == 1 else "RGB").resize((w, h))
            except Exception as e:  # truncated, bytes changed, a directory named like an image, unreadable
                raise DamagedFileError(f, read_problem(e), f"replace or remove the image (images are read from {key})",
                                       key) from None
            arr = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0)
            xs.append(arr.unsqueeze(0) if ch == 1 else arr.permute(2, 0, 1))
            ys.append(int(sub.name))
    if not xs:
        raise DataError(key, f"no labelled images under {root} (expected <class index>/<image>, class index < "
                             f"{num_classes})")
    return torch.stack(xs), torch.as_tensor(ys, dtype=torch.int64)
