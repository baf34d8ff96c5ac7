"""Object-store benchmark: consolidate a ZeRO-3 checkpoint straight from an S3 bucket (a local moto server)
against "download the folder with the same client, then consolidate locally".

    AWS_EC2_METADATA_DISABLED=true .venv/bin/python bench/s3_bench.py [--input bench/data/gpt16m_z3_w2]

The input is built by ``.venv-ds/bin/python bench/make_inputs.py --only gpt16m_z3_w2`` (real DeepSpeed, 16M
GPT, ZeRO-3, world 2, one AdamW step). Figures per job: wall time, peak RSS of the zckpt process, local disk
written, and (through a counting proxy in front of the server) requests made and bytes fetched, against the
bytes the output needs (the fp32 masters and the model-state files, not the Adam moments). Results go to
stdout as one JSON object (``bench/RESULTS.md`` quotes them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import _s3  # noqa: E402  (the tests' server and proxy)


def _du(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size


def _zckpt(args: list[str], env: dict[str, str]) -> tuple[float, int]:
    """Run the CLI in a child; (wall seconds, child's peak RSS in bytes)."""
    t = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-c", _RSS + "from zckpt.cli.app import main; main()", *args],
        env={**env, "ZCKPT_FAST_EXIT": "0"},
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t
    if p.returncode != 0:
        raise SystemExit(f"zckpt {' '.join(args)} failed: {p.stderr}")
    return wall, _rss(p.stderr)


_RSS = """import atexit, re, sys
atexit.register(lambda: print("PEAK_RSS", re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read())[1],
                              file=sys.stderr))
sys.argv[0] = "zckpt"
"""
"""Prepended to a child's code: it reports its own peak RSS (KiB, ``VmHWM``: ``ru_maxrss`` would carry this
parent's peak across ``exec``) on stderr at exit."""


def _rss(stderr: str) -> int:
    return int(next(ln.split()[1] for ln in stderr.splitlines() if ln.startswith("PEAK_RSS"))) * 1024


def _download(url: str, to: Path, env: dict[str, str]) -> tuple[float, int]:
    """The whole folder with the same client (obstore, 8 objects in flight), in a child process."""
    code = f"""
import os, sys
sys.path.insert(0, {str(REPO)!r})
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import obstore
from zckpt.io import objstore
to = Path({str(to)!r})
urls = objstore.list_keys({url!r})
def get(u):
    v = objstore.parse(u)
    dst = to / u[len({url!r}) + 1:]
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(dst, "wb") as f:
        for chunk in obstore.get(objstore._store(v), v.key).stream(min_chunk_size=8 << 20):
            f.write(chunk)
with ThreadPoolExecutor(8) as pool:
    list(pool.map(get, urls))
"""
    t = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-c", _RSS + code], env=env, check=True, capture_output=True, text=True
    )
    return time.perf_counter() - t, _rss(p.stderr)


def _needed(src: Path) -> int:
    """The bytes the output needs: the stored bytes of every model tensor (the fp32 masters, frozen params,
    buffers) plus the whole model-state files (read for their metadata)."""
    import zckpt

    with zckpt.open(src) as ck:
        data = sum(
            p.numel * p.dtype.itemsize
            for e in ck.entries.values()
            if e.role.name != "OPTIM"
            for p in e.pieces
            if p.file
        )
        files = {f for f in ck.meta.files if f.endswith("model_states.pt")}
    return data + sum(os.path.getsize(f) for f in files)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input", default=str(REPO / "bench" / "data" / "gpt16m_z3_w2"))
    ap.add_argument("--link-mbps", type=float, default=0.0,
                    help="time both jobs through a proxy carrying at most this many MB/s in all (a network "
                    "link to the store; 0: straight to the local server)")  # fmt: skip
    args = ap.parse_args()
    src = Path(args.input)
    if not (src / "latest").is_file():
        raise SystemExit(f"{src}: build it first: .venv-ds/bin/python bench/make_inputs.py --only {src.name}")
    srv = _s3.start()
    proxy = _s3.FaultProxy(srv.url, p503=0, pdrop=0, ptrunc=0)
    link = _s3.FaultProxy(srv.url, p503=0, pdrop=0, ptrunc=0, rate=args.link_mbps * 1e6)
    work = Path(tempfile.mkdtemp(prefix="zckpt-s3bench-"))
    out: dict[str, object] = {"input": src.name, "input_bytes": _du(src), "link_mbps": args.link_mbps or None}
    try:
        c = srv.client()
        c.create_bucket(Bucket="bench")  # type: ignore[attr-defined]
        url = _s3.upload(c, src, "bench", src.name)
        base = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            **dict(_s3.env_for(link.url if args.link_mbps else srv.url)),
        }
        counted = {**base, "AWS_ENDPOINT_URL": proxy.url}
        # bytes and requests, counted by the proxy (an oracle independent of zckpt's own counters)
        _zckpt(["consolidate", url, str(work / "counted.safetensors"), "--no-progress"], counted)
        needed = _needed(src)
        out["direct"] = {
            "requests": proxy.counts["requests"],
            "bytes_fetched": proxy.counts["bytes"],
            "bytes_needed": needed,
            "fetched_over_needed": round(proxy.counts["bytes"] / needed, 3),
        }
        # wall, RSS, local disk: from the bucket
        wall, rss = _zckpt(["consolidate", url, str(work / "direct.safetensors"), "--no-progress"], base)
        out["direct"].update(wall_s=round(wall, 2), peak_rss=rss, local_disk=_du(work / "direct.safetensors"))  # type: ignore[attr-defined]
        # download, then consolidate locally
        dl_wall, dl_rss = _download(url, work / "dl", base)
        wall2, rss2 = _zckpt(
            ["consolidate", str(work / "dl"), str(work / "local.safetensors"), "--no-progress"], base
        )
        out["download_then_consolidate"] = {
            "download_s": round(dl_wall, 2),
            "consolidate_s": round(wall2, 2),
            "wall_s": round(dl_wall + wall2, 2),
            "peak_rss_download": dl_rss,
            "peak_rss_consolidate": rss2,
            "local_disk": _du(work / "dl") + _du(work / "local.safetensors"),
        }
        same = (work / "direct.safetensors").read_bytes() == (work / "local.safetensors").read_bytes()
        out["identical_output"] = same
        out["wall_ratio"] = round(wall / (dl_wall + wall2), 3)
    finally:
        proxy.stop()
        link.stop()
        srv.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
