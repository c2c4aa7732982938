"""What every benchmark records with its figures: the machine it ran on, and the JSON file."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import torch


def machine() -> dict:
    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "torch": torch.__version__}


def write_json(path: str, result: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
