"""Object-store benchmark: consolidate a ZeRO-3 checkpoint straight from an S3 bucket (a local server)
against "download the folder with the same client, then consolidate locally".

    AWS_EC2_METADATA_DISABLED=true .venv/bin/python bench/s3_bench.py [--input bench/data/gpt16m_z3_w2]
        [--server moto|s3rver] [--link-mbit 1000] [--repeat 3]

``--server``: moto (the tests' server, in a process of its own; it builds the whole object for every ranged
GET and serialises the requests of one object, so a ranged read costs the object's size), or s3rver
(Node.js, ``bench/s3rver/package.json``, installed there by ``npm ci`` on first use; it streams a range from
the object's file, so a ranged GET costs its range, as on S3). Both are real S3 API servers on 127.0.0.1
that the client talks HTTP to.

The inputs are built by ``.venv-ds/bin/python bench/make_inputs.py --only gpt16m_z3_w2 gpt100m_z3_w2`` (real
DeepSpeed, 16M / 100M GPT, ZeRO-3, world 2, one AdamW step); a DCP folder (``.metadata``) works too.
``--tree``: the zckpt tree the commands import, for a before/after on one server.
``--link-mbit``: both jobs' requests (the direct consolidate and the download) go through one proxy that
carries at most that many megabits per second of response bodies in all, relayed as they arrive (a network
link to the store); without it, both go straight to the server. Figures per job: wall time (each of
``--repeat`` runs, the two jobs alternating which goes first, and their median), peak RSS of the zckpt
process, local disk written, and (through a counting proxy in front of the server, in a run of its own)
requests made and bytes fetched, against the bytes the output needs (the fp32 masters and the model-state
files, not the Adam moments); the load average before and after. ``zckpt verify`` of the bucket runs once
through the counting proxy and once after each pair of runs; its fetch speed (bytes fetched over its median
wall: it reads every byte of every object) is set against consolidate's (issue 42: at least 0.8 of it).
Results go to stdout as one JSON object (``bench/RESULTS.md`` quotes them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import _s3  # noqa: E402  (the tests' server and proxy)


def _du(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size


def _zckpt(args: list[str], env: dict[str, str]) -> tuple[float, int]:
    """Run the CLI in a child; (wall seconds, child's peak RSS in bytes). It runs in the tree it imports
    (the first ``PYTHONPATH`` entry): ``python -c`` puts its working folder first on ``sys.path``."""
    t = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-c", _RSS + _FAST_EXIT + "main()", *args],
        env=env,
        cwd=env["PYTHONPATH"].split(os.pathsep)[0],
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t
    if p.returncode != 0:
        raise SystemExit(f"zckpt {' '.join(args)} failed: {p.stderr}")
    return wall, _rss(p.stderr)


_RSS = """import atexit, re, sys
def _peak():
    print("PEAK_RSS", re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read())[1], file=sys.stderr)
    sys.stderr.flush()
atexit.register(_peak)
sys.argv[0] = "zckpt"
"""
"""Prepended to a child's code: it reports its own peak RSS (KiB, ``VmHWM``: ``ru_maxrss`` would carry this
parent's peak across ``exec``) on stderr at exit."""


_FAST_EXIT = """from zckpt.cli import app
_exit = app._fast_exit
def _fast_exit(code):
    _peak()
    _exit(code)
app._fast_exit = _fast_exit
from zckpt.cli.app import main
"""
"""Then the CLI as a user runs it, ending with its ``os._exit`` (no interpreter teardown: torch's and the
store client's took 0.5-2.5 s, which the bench counted before), reporting its peak RSS just before."""


def _rss(stderr: str) -> int:
    return max(int(ln.split()[1]) for ln in stderr.splitlines() if ln.startswith("PEAK_RSS")) * 1024


@dataclass
class S3rver:
    """s3rver in a child process on a free port, objects in a temporary folder; its fixed credentials."""

    url: str
    _proc: subprocess.Popen[bytes]
    _dir: str
    creds = {
        "AWS_ACCESS_KEY_ID": "S3RVER",
        "AWS_SECRET_ACCESS_KEY": "S3RVER",
        "AWS_DEFAULT_REGION": "us-east-1",
    }

    @classmethod
    def start(cls) -> S3rver:
        home = REPO / "bench" / "s3rver"
        exe = home / "node_modules" / ".bin" / "s3rver"
        if not exe.exists():
            if shutil.which("npm") is None:
                raise SystemExit("--server s3rver needs Node.js and npm (or use --server moto)")
            subprocess.run(["npm", "ci", "--silent", "--no-audit", "--no-fund"], cwd=home, check=True)
        port, data = _s3.free_port(), tempfile.mkdtemp(prefix="zckpt-s3rver-")
        argv = [str(exe), "-d", data, "-a", "127.0.0.1", "-p", str(port), "--silent", "--no-vhost-buckets"]
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return cls(f"http://127.0.0.1:{port}", proc, data)
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"s3rver did not start (exit {proc.poll()})") from None
                time.sleep(0.1)

    def client(self) -> object:
        import boto3

        c = self.creds
        return boto3.client("s3", endpoint_url=self.url, aws_access_key_id=c["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=c["AWS_SECRET_ACCESS_KEY"],
                            region_name=c["AWS_DEFAULT_REGION"])  # fmt: skip

    def stop(self) -> None:
        self._proc.terminate()
        self._proc.wait(timeout=30)
        shutil.rmtree(self._dir, ignore_errors=True)


def _download(url: str, to: Path, env: dict[str, str]) -> tuple[float, int]:
    """The whole folder with the same client (obstore, 8 objects in flight), in a child process."""
    code = f"""
import os, sys
sys.path.insert(0, {str(REPO)!r})
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import obstore
from zckpt.storage import objstore
from zckpt.storage.objstore import write as objwrite
st = objstore.ObjectStore()  # the same client zckpt's commands make (its options, credentials)
to = Path({str(to)!r})
urls = objwrite.list_keys(st, {url!r})
def get(u):
    v = objstore.parse(u)
    dst = to / u[len({url!r}) + 1:]
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(dst, "wb") as f:
        for chunk in obstore.get(st.client(v), v.key).stream(min_chunk_size=8 << 20):
            f.write(chunk)
with ThreadPoolExecutor(8) as pool:
    list(pool.map(get, urls))
"""
    t = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-c", _RSS + code], env=env, check=True, capture_output=True, text=True
    )
    return time.perf_counter() - t, _rss(p.stderr)


def _fresh(work: Path, *stems: str) -> None:
    """Remove a job's earlier outputs (``<stem>.safetensors`` and its sidecars, the ``dl`` folder)."""
    for stem in stems:
        shutil.rmtree(work / stem, ignore_errors=True)
        for f in work.glob(f"{stem}.safetensors*"):
            f.unlink()


def _needed(src: Path) -> int:
    """The bytes the output needs: the stored bytes of every model tensor (the fp32 masters, frozen params,
    buffers) plus the whole model-state files (read for their metadata), or a DCP folder's ``.metadata``."""
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
    if (src / ".metadata").is_file():  # a DCP folder: its index is read whole
        files.add(str(src / ".metadata"))
    return data + sum(os.path.getsize(f) for f in files)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input", default=str(REPO / "bench" / "data" / "gpt16m_z3_w2"))
    ap.add_argument("--link-mbit", type=float, default=0.0,
                    help="time both jobs through a proxy carrying at most this many Mbit/s in all (a network "
                    "link to the store; 0: straight to the local server)")  # fmt: skip
    ap.add_argument("--repeat", type=int, default=3, help="timed runs of each job (median reported)")
    ap.add_argument("--server", choices=("moto", "s3rver"), default="moto", help="the S3 server (see above)")
    ap.add_argument("--tree", help="the zckpt tree the timed commands import (an A/B; default: this one)")
    ap.add_argument("--append", metavar="MD", help="also append the result as a section of this Markdown")
    args = ap.parse_args()
    src = Path(args.input)
    if not (src / "latest").is_file() and not (src / ".metadata").is_file():
        raise SystemExit(f"{src}: build it first: .venv-ds/bin/python bench/make_inputs.py --only {src.name}")
    tree = Path(args.tree).resolve() if args.tree else REPO
    load0 = os.getloadavg()
    srv = _s3.start_child() if args.server == "moto" else S3rver.start()
    creds = S3rver.creds if args.server == "s3rver" else _s3.CREDS
    proxy = _s3.FaultProxy(srv.url, p503=0, pdrop=0, ptrunc=0)
    link = _s3.FaultProxy(srv.url, p503=0, pdrop=0, ptrunc=0, rate=args.link_mbit * 1e6 / 8)
    work = Path(tempfile.mkdtemp(prefix="zckpt-s3bench-"))
    out: dict[str, Any] = {"input": src.name, "input_bytes": _du(src), "link_mbit": args.link_mbit or None,
                           "server": args.server, "cores": os.cpu_count(),
                           "load_before": [round(x, 1) for x in load0]}  # fmt: skip
    try:
        c = srv.client()
        c.create_bucket(Bucket="bench")  # type: ignore[attr-defined]
        url = _s3.upload(c, src, "bench", src.name)
        base = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])]),
            **dict(_s3.env_for(link.url if args.link_mbit else srv.url)),
            **creds,
        }
        counted = {**base, "AWS_ENDPOINT_URL": proxy.url}
        # bytes and requests, counted by the proxy (an oracle independent of zckpt's own counters)
        _zckpt(["consolidate", url, str(work / "counted.safetensors"), "--no-progress"], counted)
        needed = _needed(src)
        direct: dict[str, Any] = {
            "requests": proxy.counts["requests"],
            "bytes_fetched": proxy.counts["bytes"],
            "bytes_needed": needed,
            "fetched_over_needed": round(proxy.counts["bytes"] / needed, 3),
            "wall_s": [],
        }
        # verify of the bucket: every byte of every object, counted the same way
        vstart = dict(proxy.counts)
        _zckpt(["verify", url, "--no-progress"], counted)
        ver: dict[str, Any] = {
            "requests": proxy.counts["requests"] - vstart["requests"],
            "bytes_fetched": proxy.counts["bytes"] - vstart["bytes"],
            "wall_s": [],
        }
        dl: dict[str, Any] = {"download_s": [], "consolidate_s": [], "wall_s": []}
        for i in range(args.repeat):
            for job in ("direct", "download")[:: 1 if i % 2 == 0 else -1]:
                _fresh(work, "direct" if job == "direct" else "local", "dl")
                if job == "direct":
                    wall, rss = _zckpt(
                        ["consolidate", url, str(work / "direct.safetensors"), "--no-progress"], base
                    )
                    direct["wall_s"].append(round(wall, 2))
                    direct.update(peak_rss=rss, local_disk=_du(work / "direct.safetensors"))
                    continue
                dl_wall, dl_rss = _download(url, work / "dl", base)
                wall2, rss2 = _zckpt(
                    ["consolidate", str(work / "dl"), str(work / "local.safetensors"), "--no-progress"], base
                )
                dl["download_s"].append(round(dl_wall, 2))
                dl["consolidate_s"].append(round(wall2, 2))
                dl["wall_s"].append(round(dl_wall + wall2, 2))
                dl.update(peak_rss_download=dl_rss, peak_rss_consolidate=rss2,
                          local_disk=_du(work / "dl") + _du(work / "local.safetensors"))  # fmt: skip
            vwall, vrss = _zckpt(["verify", url, "--no-progress"], base)
            ver["wall_s"].append(round(vwall, 2))
            ver["peak_rss"] = max(vrss, ver.get("peak_rss", 0))
            same = (work / "direct.safetensors").read_bytes() == (work / "local.safetensors").read_bytes()
            out["identical_output"] = same and out.get("identical_output", True)
        direct["median_s"] = statistics.median(direct["wall_s"])
        dl["median_s"] = statistics.median(dl["wall_s"])
        ver["median_s"] = statistics.median(ver["wall_s"])
        # fetch speeds: what each command fetched over its wall (verify must fetch every byte of the bucket)
        ver["fetch_mbs"] = round(ver["bytes_fetched"] / ver["median_s"] / 1e6, 1)
        direct["fetch_mbs"] = round(direct["bytes_fetched"] / direct["median_s"] / 1e6, 1)
        ver["of_consolidate_fetch"] = round(ver["fetch_mbs"] / direct["fetch_mbs"], 2)
        out["direct"], out["download_then_consolidate"], out["verify"] = direct, dl, ver
        out["wall_ratio"] = round(direct["median_s"] / dl["median_s"], 3)
        out["wall_ratio_each"] = [
            round(a / b, 3) for a, b in zip(direct["wall_s"], dl["wall_s"], strict=True)
        ]
    finally:
        proxy.stop()
        link.stop()
        srv.stop()
        shutil.rmtree(work, ignore_errors=True)
    out["load_after"] = [round(x, 1) for x in os.getloadavg()]
    print(json.dumps(out, indent=1))
    if args.append:
        with open(args.append, "a") as f:
            f.write(_section(out, " ".join(sys.argv[1:])))


def _section(r: dict[str, Any], argv: str) -> str:
    """One run of this bench as a ``bench/RESULTS.md`` section (the columns of its earlier sections)."""
    d, dl, v = r["direct"], r["download_then_consolidate"], r["verify"]
    mb = 1e6
    link = f"{r['link_mbit']:g} Mbit/s" if r["link_mbit"] else "raw"
    return (
        f"\n## {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC — object storage — "
        f"`bench/s3_bench.py {argv}`\n\n"
        f"{r['cores']} cores, load {r['load_before'][0]} → {r['load_after'][0]}; outputs byte-identical: "
        f"{r['identical_output']}; local disk {d['local_disk'] / mb:,.1f} MB against "
        f"{dl['local_disk'] / mb:,.1f} MB.\n\n"
        "| input (size; what the output needs) | server, link | from the bucket: requests, bytes (× needed), "
        "wall (runs), peak RSS | download (runs) + consolidate (runs) = median | ratio (each run) |\n"
        "|---|---|---|---|---|\n"
        f"| {r['input']} ({r['input_bytes'] / 1e9:.2f} GB; {d['bytes_needed'] / mb:,.1f} MB) | "
        f"{r['server']}, {link} | {d['requests']}, {d['bytes_fetched'] / mb:,.1f} MB "
        f"({d['fetched_over_needed']}×), "
        f"{d['median_s']:.2f} s ({' '.join(map(str, d['wall_s']))}), {d['peak_rss'] / 2**20:.0f} MB | "
        f"{' '.join(map(str, dl['download_s']))} + {' '.join(map(str, dl['consolidate_s']))} = "
        f"{dl['median_s']:.2f} s | {r['wall_ratio']} ({' '.join(map(str, r['wall_ratio_each']))}) |\n"
        f"\n`zckpt verify` of the bucket: {v['requests']} requests, {v['bytes_fetched'] / mb:,.1f} MB, "
        f"{v['median_s']:.2f} s ({' '.join(map(str, v['wall_s']))}), "
        f"{v['peak_rss'] / 2**20:.0f} MB peak RSS: "
        f"{v['fetch_mbs']:,.0f} MB/s fetched against consolidate's {d['fetch_mbs']:,.0f} MB/s "
        f"(**{v['of_consolidate_fetch']}**).\n"
    )


if __name__ == "__main__":
    main()
