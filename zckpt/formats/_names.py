"""File names of the formats that code below formats/ is told about (it knows none itself):
``PUBLISH_ORDER``, which files of a checkpoint zckpt writes make it complete, for publishing into an object
store (``zckpt.storage.remote_staging.PublishOrder``: the HF index, the native ``manifest.json``, DCP's
``.metadata``, written after every data file; ``latest``, written last of all), and ``HF_WEIGHT_BASES``,
the weight files zckpt writes into an HF folder.
"""

from __future__ import annotations

import re

from zckpt.storage.remote_staging import PublishOrder

PUBLISH_ORDER = PublishOrder(
    completing=re.compile(r"(^|/)(manifest\.json|\.metadata|[^/]*\.index\.json)$"),
    pointer=re.compile(r"(^|/)latest$"),
)

HF_WEIGHT_BASES = ("model.safetensors", "pytorch_model.bin")
"""The weight files zckpt writes into an HF folder (transformers' SAFE_WEIGHTS_NAME, WEIGHTS_NAME)."""
