"""``import deepspeed`` on the engine: a script written for DeepSpeed runs unchanged in the project venv.

The folder above this package (``engine/alias``, not itself a package, so no wheel ships it) is on the
project venv's import path through a ``.pth`` file that ``make setup`` writes; importing ``deepspeed`` there
gives the ``engine`` module itself, and DeepSpeed's submodule names that scripts import
(``deepspeed.comm``, ``deepspeed.accelerator``, ``deepspeed.utils``, ``deepspeed.zero``) are the engine's
modules of the same role. The dev venv with real DeepSpeed (``.venv-ds``) never has this folder on its path.
"""

from __future__ import annotations

import sys

import engine
from engine import accelerator, comm, utils, zero

for _name, _module in (("comm", comm), ("accelerator", accelerator), ("utils", utils), ("zero", zero)):
    sys.modules[f"deepspeed.{_name}"] = _module
sys.modules[__name__] = engine
