"""Run a command and report the peaks of its resident memory by kind, sampled from ``/proc/<pid>/status``
every 50 ms: ``RssAnon`` (heap, buffers), ``RssFile`` (mapped file pages: page-cache views), and ``VmHWM``
(the total high-water mark that the benches report as peak RSS).

    python bench/rss_split.py -- zckpt diff A B --no-progress
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path


def main() -> None:
    cmd = sys.argv[sys.argv.index("--") + 1 :] if "--" in sys.argv else sys.argv[1:]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    peak: dict[str, int] = {"RssAnon": 0, "RssFile": 0, "VmHWM": 0}
    at: dict[str, float] = {}
    while p.poll() is None:
        try:
            text = Path(f"/proc/{p.pid}/status").read_text()
        except OSError:
            break
        for k in peak:
            m = re.search(rf"^{k}:\s+(\d+) kB", text, re.M)
            if m and int(m[1]) > peak[k]:
                peak[k], at[k] = int(m[1]), time.perf_counter() - t0
        time.sleep(0.05)
    wall = time.perf_counter() - t0
    shown = ", ".join(f"{k} {v >> 10} MB at {at.get(k, 0):.1f} s" for k, v in peak.items())
    print(f"RSS-SPLIT rc {p.wait()} wall {wall:.2f} s: {shown}: {' '.join(cmd)}", flush=True)


if __name__ == "__main__":
    main()
