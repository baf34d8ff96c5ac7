#!/usr/bin/env python3
"""Run a Python script (``then_sync.py SCRIPT ARGS...``) or module (``then_sync.py -m MODULE ARGS...``)
in this process exactly as ``python`` would, then ``sync`` when it succeeded.

DeepSpeed's converters (``zero_to_fp32.py``, ``zero_to_torch.py``, ``ds_to_universal``) return with their
output still in dirty page cache; zckpt and the copy floor fsync theirs. Timing the converters through this
wrapper charges them the same flush, so every wall time in ``bench/run.py`` is to an output on disk.
"""

from __future__ import annotations

import os
import runpy
import sys


def main() -> None:
    args = sys.argv[1:]
    code: object = 0
    try:
        if args[:1] == ["-m"]:
            sys.argv = [args[1], *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = args
            sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as e:
        code = e.code
    if code in (0, None):
        os.sync()
    raise SystemExit(code)


if __name__ == "__main__":
    main()
