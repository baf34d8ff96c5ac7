"""Evaluate a consolidated model file in plain PyTorch (no engine, no zckpt) on the demo's eval batch."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
from gpt import EVAL_STEP, GPT, GPTConfig, encoded_corpus, global_batch  # noqa: E402


def main(path: str) -> None:
    model = GPT(GPTConfig())
    sd = load_file(path)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    # The tied head is stored once (as wte.weight) and re-tied by the model itself.
    assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)
    model.eval()
    x, y = global_batch(encoded_corpus(), EVAL_STEP, 32, GPTConfig().block_size)
    with torch.no_grad():
        print(f"plain PyTorch eval loss of {path}: {model(x, y).item():.6f}")


if __name__ == "__main__":
    main(sys.argv[1])
