"""Result rows of the GPU tests, appended where the device run collects them."""

from __future__ import annotations

import json
import os

import torch


def record_result(name: str, row: dict) -> None:
    """Append a row to $MEGATRAIN_RESULTS/backend_gpu.jsonl (nothing when it is unset)."""
    out = os.environ.get("MEGATRAIN_RESULTS")
    if out:
        row = {"test": name, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, **row}
        with open(os.path.join(out, "backend_gpu.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
