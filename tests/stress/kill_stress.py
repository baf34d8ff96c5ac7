#!/usr/bin/env python3
"""Kill stress (not part of ``make test``): N seeded trials that SIGKILL a zckpt write at a random moment and
check what is left, then print one summary line of outcomes.

    .venv/bin/python tests/stress/kill_stress.py [--trials 200] [--seed 1] [--delay 0.01] [--engine]

Each trial picks a job — ``consolidate`` to a .safetensors file, an HF folder or a .bin (half of them
overwriting an older bf16 output), ``reshard`` to world 3, or (``--engine``) the engine's ``save_checkpoint``
of tag b over a folder whose ``latest`` names tag a — runs it in a forked child with
``ZCKPT_TEST_WRITE_DELAY`` stretching each write, kills it (1 in 4 uniformly over the run, else inside the
write phase), and judges: ``absent``, ``complete`` (equal to an uninterrupted run and ``zckpt verify``
clean), ``old`` (the overwritten output, intact) or ``CORRUPT``. Then reruns the job and checks the rerun is
complete. Exit status 1 if any trial was CORRUPT or a rerun failed.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent.parent)]

from _kill import (  # noqa: E402
    DELAY_ENV,
    calibrate,
    fork,
    judge_output,
    kill_at,
    run_cli,
    same,
    temps,
    tensors_of,
    verify_ok,
    wait,
)
from _safety import DS3, cli, copy_case  # noqa: E402

LAYOUTS = ("model.safetensors", "hf", "model.bin")


def _save(eng: object, save_dir: Path, tag: str, delay: str | None) -> int:
    import os

    if delay:
        os.environ[DELAY_ENV] = delay
    eng.save_checkpoint(str(save_dir), tag=tag)  # type: ignore[attr-defined]
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--delay", type=float, default=0.01, help="seconds slept before each write")
    ap.add_argument("--engine", action="store_true", help="include engine save_checkpoint trials")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    env = {DELAY_ENV: str(args.delay)}
    root = Path(tempfile.mkdtemp(prefix="zckpt-kill-stress-"))
    t_start = time.monotonic()
    src = copy_case(DS3, root / "src")

    # references (uninterrupted) and calibrations
    refs, olds, timings = {}, {}, {}
    for name in LAYOUTS:
        for dtype, table in (("fp32", refs), ("bf16", olds)):
            out = root / "ref" / dtype / name
            assert cli("consolidate", src, out, "--dtype", dtype).code == 0
            table[name] = tensors_of(out)
        cal = root / "cal" / name
        cal.mkdir(parents=True)
        timings[name] = calibrate(
            lambda n=name, c=cal: fork(run_cli, ["consolidate", src, c / n], env=env), cal
        )
    assert cli("reshard", src, root / "ref" / "re", "--world", "3").code == 0
    refs["reshard"] = tensors_of(root / "ref" / "re")
    cal = root / "cal" / "reshard"
    cal.mkdir(parents=True)
    re_env = {DELAY_ENV: str(args.delay / 5)}
    timings["reshard"] = calibrate(
        lambda: fork(run_cli, ["reshard", src, cal / "o", "--world", "3", "--no-progress"], env=re_env), cal
    )
    jobs = [*LAYOUTS, "reshard"]
    if args.engine:
        from _engine_ref import config, train

        base = root / "ref" / "engine"
        e2, _ = train(0, 1, config(3), 2)  # trained once here; forked children only save
        e2.save_checkpoint(str(base), tag="a")
        e3, _ = train(0, 1, config(3), 3)
        e3.save_checkpoint(str(base), tag="b")
        refs["engine-a"], refs["engine-b"] = tensors_of(base, "a"), tensors_of(base, "b")
        cal = root / "cal" / "engine"
        shutil.copytree(base, cal)
        shutil.rmtree(cal / "b")
        (cal / "latest").write_text("a")
        timings["engine"] = calibrate(lambda: fork(_save, e3, cal, "b", str(args.delay)), cal)
        jobs.append("engine")

    tally: Counter[str] = Counter()
    per_job: dict[str, Counter[str]] = {j: Counter() for j in jobs}
    mid = 0
    failures: list[str] = []
    for i in range(args.trials):
        job = jobs[i % len(jobs)]
        work = root / f"t{i}"
        work.mkdir()
        overwrite = False
        if job in LAYOUTS:
            out = work / job
            cmd = ["consolidate", src, out]
            overwrite = rng.random() < 0.5
            if overwrite:
                assert cli("consolidate", src, out, "--dtype", "bf16").code == 0
                cmd.append("--overwrite")
            pid = fork(run_cli, cmd, env=env)
            watch = work
        elif job == "reshard":
            out = work / "out"
            cmd = ["reshard", src, out, "--world", "3", "--no-progress"]
            pid = fork(run_cli, cmd, env=re_env)
            watch = work
        else:
            out = work / "sd"
            shutil.copytree(root / "ref" / "engine", out)
            shutil.rmtree(out / "b")
            (out / "latest").write_text("a")
            pid = fork(_save, e3, out, "b", str(args.delay))
            watch = out
        when = kill_at(pid, watch, timings[job], rng)
        wait(pid)
        mid += bool(temps(watch))
        if job == "engine":
            latest = (out / "latest").read_text().strip()
            ok = verify_ok(out, "a") and same(tensors_of(out, "a"), refs["engine-a"])
            ok = ok and verify_ok(out) and same(tensors_of(out), refs[f"engine-{latest}"])
            verdict = f"latest={latest}" if ok else "CORRUPT: latest or previous checkpoint broken"
            rerun_ok = wait(fork(_save, e3, out, "b", None), 300) == 0
            rerun_ok = rerun_ok and verify_ok(out) and same(tensors_of(out), refs["engine-b"])
        else:
            ref = refs["reshard" if job == "reshard" else job]
            verdict = judge_output(out, ref)
            if overwrite and verdict.startswith("CORRUPT") and judge_output(out, olds[job]) == "complete":
                verdict = "old"
            r = cli(*cmd[:3], "--overwrite", *cmd[3:]) if "--overwrite" not in cmd else cli(*cmd)
            rerun_ok = r.code == 0 and judge_output(out, ref) == "complete"
        key = verdict.split(":")[0]
        tally[key] += 1
        per_job[job][key] += 1
        if verdict.startswith("CORRUPT") or not rerun_ok:
            failures.append(f"trial {i} {job} killed at {when}: {verdict}; rerun ok: {rerun_ok}")
        shutil.rmtree(work, ignore_errors=True)

    for f in failures:
        print(f)
    jobs_s = "; ".join(f"{j}: {dict(c)}" for j, c in per_job.items())
    print(
        f"kill_stress: trials={args.trials} seed={args.seed} delay={args.delay}s "
        f"outcomes={dict(tally)} killed_mid_write={mid} corrupt_or_rerun_failed={len(failures)} "
        f"time={time.monotonic() - t_start:.0f}s | {jobs_s}"
    )
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
