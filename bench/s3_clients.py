"""Client comparison for zckpt's object-store backend (docs/object-storage.md): fsspec+s3fs vs obstore
against a local moto server. Ranged-GET throughput with N in flight, multipart upload, error mapping.

    AWS_EC2_METADATA_DISABLED=true python bench/s3_clients.py [--mib 64] [--range-mib 4]
"""

from __future__ import annotations

import argparse
import os
import socket
import time

os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--range-mib", type=int, default=4)
    args = ap.parse_args()
    from moto.server import ThreadedMotoServer

    port = _free_port()
    srv = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    srv.start()
    url = f"http://127.0.0.1:{port}"
    os.environ.update(AWS_ENDPOINT_URL=url, AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s",
                      AWS_DEFAULT_REGION="us-east-1")  # fmt: skip
    try:
        import boto3

        s3 = boto3.client("s3")
        s3.create_bucket(Bucket="bench")
        data = os.urandom(args.mib << 20)
        s3.put_object(Bucket="bench", Key="obj", Body=data)
        rs = args.range_mib << 20
        ranges = [(a, min(a + rs, len(data))) for a in range(0, len(data), rs)]
        rows = []
        from concurrent.futures import ThreadPoolExecutor

        def timed(name: str, n: int, get: object) -> None:
            t = time.perf_counter()
            with ThreadPoolExecutor(n) as pool:
                out = list(pool.map(get, ranges))  # type: ignore[arg-type]
            dt = time.perf_counter() - t
            assert b"".join(out) == data
            rows.append((name, n, args.mib / dt))

        import s3fs

        for n in (1, 4, 16):
            fs = s3fs.S3FileSystem(anon=False, skip_instance_cache=True)
            timed("s3fs cat_file", n, lambda ab, fs=fs: fs.cat_file("bench/obj", start=ab[0], end=ab[1]))
        import obstore
        from obstore.store import S3Store

        st = S3Store("bench", endpoint=url, allow_http=True, region="us-east-1")
        for n in (1, 4, 16):
            timed(
                "obstore get_range", n, lambda ab: bytes(obstore.get_range(st, "obj", start=ab[0], end=ab[1]))
            )  # noqa: E501
        for name, n, mbs in rows:
            print(f"ranged GET {args.range_mib} MiB  {name:20s} in flight {n:2d}: {mbs:7.1f} MiB/s")
        # multipart upload of the same bytes, 8 MiB parts
        t = time.perf_counter()
        with fs.open("bench/up-s3fs", "wb", block_size=8 << 20) as f:
            for i in range(0, len(data), 1 << 20):
                f.write(data[i : i + (1 << 20)])
        print(f"multipart upload s3fs    : {args.mib / (time.perf_counter() - t):7.1f} MiB/s")
        t = time.perf_counter()
        with obstore.open_writer(st, "up-obs", buffer_size=8 << 20) as w:
            for i in range(0, len(data), 1 << 20):
                w.write(data[i : i + (1 << 20)])
        print(f"multipart upload obstore : {args.mib / (time.perf_counter() - t):7.1f} MiB/s")
        # error mapping: a missing key, a missing bucket
        for what, fn in (
            ("s3fs missing key", lambda: fs.cat_file("bench/nope", 0, 10)),
            ("s3fs missing bucket", lambda: fs.cat_file("nobucket/x", 0, 10)),
            ("obstore missing key", lambda: obstore.get_range(st, "nope", start=0, end=10)),
            ("obstore missing bucket",
             lambda: obstore.get_range(S3Store("nobucket", endpoint=url, allow_http=True), "x", start=0, end=1)),  # noqa: E501
        ):  # fmt: skip
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - we print what each client raises
                print(f"{what:24s}: {type(e).__module__}.{type(e).__name__}: {str(e).splitlines()[0][:90]}")
    finally:
        srv.stop()


if __name__ == "__main__":
    main()
