#!/usr/bin/env python3
"""torch's own DCP converter, as a bench row: ``dcp_to_torch_save(DCP_DIR, OUT)`` (loads the whole checkpoint
into memory, then ``torch.save``s one pickle), then fsync ``OUT`` (zckpt and the copy floor fsync theirs).

    python bench/dcp_to_torch_save.py DCP_DIR OUT.pt
"""

from __future__ import annotations

import os
import sys

from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def main() -> None:
    src, out = sys.argv[1], sys.argv[2]
    dcp_to_torch_save(src, out)
    fd = os.open(out, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


if __name__ == "__main__":
    main()
