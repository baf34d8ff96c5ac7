"""Nothing half-written: consolidate, reshard and the engine's save_checkpoint, SIGKILLed at random moments
(seeded), at every rename of their commit, interrupted with Ctrl-C, and run out of space.

After a SIGKILL the output is absent or complete (equal to an uninterrupted run's and ``zckpt verify``
clean), the engine's previous checkpoint still verifies and loads, ``latest`` names a complete checkpoint,
and a rerun succeeds. SIGINT and a full disk (``RLIMIT_FSIZE``; a 1 MiB tmpfs where mounting works) end
with one error line and no temporary files. Trials run in forked children (see ``_kill``) with
``ZCKPT_TEST_WRITE_DELAY`` spreading each write over a few hundred milliseconds.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _kill import (
    DELAY_ENV,
    calibrate,
    exited,
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
from _safety import DS3, Run, cli, copy_case

from zckpt.storage import staging

DELAY = {DELAY_ENV: "0.01"}
RESHARD_DELAY = {DELAY_ENV: "0.002"}
SEED = 20240611


def _no_visible_junk(folder: Path, allowed: set[str]) -> None:
    """Only the allowed names (and hidden temporaries of killed runs) in ``folder``."""
    junk = [p.name for p in folder.iterdir() if p.name not in allowed and not p.name.startswith(".")]
    assert not junk, junk


# ---- consolidate -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return copy_case(DS3, tmp_path_factory.mktemp("src"))


def _ref(src: Path, tmp: Path, name: str, *extra: str) -> dict[str, torch.Tensor]:
    out = tmp / "ref" / name
    r = cli("consolidate", src, out, *extra)
    assert r.code == 0, r.stderr
    return tensors_of(out)


def _old_output(src: Path, out: Path) -> None:
    """An older output at ``out`` (bf16, so it differs from the fp32 one a trial writes over it)."""
    r = cli("consolidate", src, out, "--dtype", "bf16")
    assert r.code == 0, r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("name", ["model.safetensors", "hf", "model.bin"])
def test_consolidate_sigkill_random(name: str, src: Path, tmp_path: Path) -> None:
    """4 seeded kills per output layout; every second trial overwrites an older (bf16) output. When none of
    them landed inside the write (a calibration run slowed by a loaded machine places them late), up to 4
    more kill early in the write phase."""
    ref = _ref(src, tmp_path, name)
    old = _ref(src, tmp_path, "old-" + name, "--dtype", "bf16")
    rng = random.Random(f"{SEED}-{name}")
    cal = tmp_path / "cal"
    cal.mkdir()
    timing = calibrate(lambda: fork(run_cli, ["consolidate", src, cal / name], env=DELAY), cal)
    seen: Counter[str] = Counter()
    mid_write = 0
    for trial in range(8):
        if trial >= 4 and mid_write:
            break
        work = tmp_path / f"t{trial}"
        work.mkdir()
        out = work / name
        args = ["consolidate", src, out]
        if trial % 2:
            _old_output(src, out)
            args.append("--overwrite")
        pid = fork(run_cli, args, env=DELAY)
        when = kill_at(pid, work, timing, rng, early=trial >= 4)
        wait(pid)
        mid_write += bool(temps(work))
        verdict = judge_output(out, ref)
        if trial % 2 and verdict.startswith("CORRUPT") and judge_output(out, old) == "complete":
            verdict = "old"
        seen[verdict] += 1
        assert not verdict.startswith("CORRUPT"), f"trial {trial} killed at {when}: {verdict}"
        _no_visible_junk(work, {name, name + ".sha256", name + ".sha256.json", name + ".crc32.json"})
        r = cli("consolidate", src, out, "--overwrite")
        assert r.code == 0, f"rerun after a kill at {when}: {r.stderr}"
        assert judge_output(out, ref) == "complete"
    print(f"consolidate -> {name}: {dict(seen)}, {mid_write} killed mid-write")
    assert mid_write >= 1, "no kill landed inside the write"


def _die_at_rename(n: int, body: Callable[[], Any]) -> Callable[[], Any]:
    """``body`` with ``os.replace``/``os.rename`` instrumented: SIGKILL self right after the n-th call."""

    def run() -> Any:
        count = [0]

        def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
            def inner(*a: Any, **k: Any) -> Any:
                res = fn(*a, **k)
                count[0] += 1
                if count[0] == n:
                    os.kill(os.getpid(), signal.SIGKILL)
                return res

            return inner

        os.replace = wrap(os.replace)  # type: ignore[assignment]
        os.rename = wrap(os.rename)  # type: ignore[assignment]
        staging._renameat2 = wrap(staging._renameat2)  # the atomic swap / no-replace rename of a folder
        return body()

    return run


def _count_renames(body: Callable[[], Any], log: Path) -> int:
    def run() -> Any:
        count = [0]
        orig_replace, orig_rename = os.replace, os.rename

        def rep(*a: Any, **k: Any) -> Any:
            count[0] += 1
            return orig_replace(*a, **k)

        def ren(*a: Any, **k: Any) -> Any:
            count[0] += 1
            return orig_rename(*a, **k)

        os.replace, os.rename = rep, ren  # type: ignore[assignment]
        real_at2 = staging._renameat2

        def at2(*a: Any, **k: Any) -> Any:
            count[0] += 1
            return real_at2(*a, **k)

        staging._renameat2 = at2
        try:
            return body()
        finally:
            Path(log).write_text(str(count[0]))

    assert wait(fork(run)) == 0
    return int(log.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["model.safetensors", "hf"])
def test_consolidate_killed_after_each_rename(name: str, src: Path, tmp_path: Path) -> None:
    """Deterministic: a SIGKILL right after each rename of the commit, overwriting an older output."""
    ref = _ref(src, tmp_path, name)
    old = _ref(src, tmp_path, "old-" + name, "--dtype", "bf16")

    def setup(work: Path) -> Path:
        work.mkdir()
        _old_output(src, work / name)
        return work / name

    out0 = setup(tmp_path / "count")
    n = _count_renames(lambda: run_cli(["consolidate", src, out0, "--overwrite"]), tmp_path / "n")
    assert n >= 1
    for k in range(1, n + 1):
        out = setup(tmp_path / f"k{k}")
        wait(fork(_die_at_rename(k, lambda out=out: run_cli(["consolidate", src, out, "--overwrite"]))))
        verdict = judge_output(out, ref)
        if verdict != "complete":
            assert verdict == "absent" or judge_output(out, old) == "complete", (
                f"killed after rename {k}: {verdict}"
            )
        r = cli("consolidate", src, out, "--overwrite")
        assert r.code == 0 and judge_output(out, ref) == "complete", r.stderr


def test_sigint_cleans_up(src: Path, tmp_path: Path) -> None:
    """Ctrl-C mid-write (consolidate to each layout, reshard): exit 130, one line, output absent, no
    temporary files left."""
    rng = random.Random(SEED)
    jobs = [
        ["consolidate", src, "model.safetensors"],
        ["consolidate", src, "hf"],
        ["consolidate", src, "model.bin"],
        ["reshard", src, "re", "--world", "3", "--no-progress"],
    ]
    for trial, job in enumerate(jobs):
        work = tmp_path / f"t{trial}"
        work.mkdir()
        log = tmp_path / f"t{trial}.log"
        args = [*job[:2], work / str(job[2]), *job[3:]]
        # every write waits 0.4 s before it starts, and the signal comes at most 0.25 s after the first
        # temporary file is seen: it lands before the first write is through, however few writes the job
        # makes (a 1.5 KiB output is one or two), at a random point of the staging window
        pid = fork(run_cli, args, env={DELAY_ENV: "0.4"}, log=log)
        deadline = time.monotonic() + 60
        while not temps(work):
            assert not exited(pid), "finished before any write was seen"
            assert time.monotonic() < deadline
            time.sleep(0.001)
        time.sleep(rng.uniform(0.0, 0.25))
        os.kill(pid, signal.SIGINT)
        code = wait(pid)
        text = log.read_text()
        assert code == 130, f"exit {code}: {text}"
        assert "Traceback" not in text and text.count("error: ") == 1 and "interrupted" in text, text
        assert not list(work.iterdir()), list(work.iterdir())


def _signal_at_rename(n: int, sig: int, body: Callable[[], Any]) -> Callable[[], Any]:
    """``body`` with the renames instrumented: ``sig`` sent to self right after the n-th (0: just before the
    first one, while the staged files are fsynced)."""

    def run() -> Any:
        count = [0]
        real_fsync_tree = staging._fsync_tree

        def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
            def inner(*a: Any, **k: Any) -> Any:
                res = fn(*a, **k)
                count[0] += 1
                if count[0] == n:
                    os.kill(os.getpid(), sig)
                return res

            return inner

        def fsync_tree(*a: Any) -> Any:
            real_fsync_tree(*a)
            if n == 0:
                os.kill(os.getpid(), sig)
                time.sleep(1)  # its handler runs here (the sleep is cut short), before the renames

        os.replace = wrap(os.replace)  # type: ignore[assignment]
        os.rename = wrap(os.rename)  # type: ignore[assignment]
        staging._renameat2 = wrap(staging._renameat2)
        staging._fsync_tree = fsync_tree
        return body()

    return run


@pytest.mark.parametrize("name", ["model.safetensors", "hf"])
def test_signal_during_the_renames_waits_for_them(name: str, src: Path, tmp_path: Path) -> None:
    """Ctrl-C or SIGTERM while the commit's renames run (fuzz seed 18, cases 114 and 254: "refused but left
    output"): held until the last rename, then the job is done: exit 0, a warning, the output complete over
    the older one. Before the renames: exit 130/143 and the older output untouched."""
    ref = _ref(src, tmp_path, name)
    old = _ref(src, tmp_path, "old-" + name, "--dtype", "bf16")
    n = _count_renames(lambda: run_cli(["consolidate", src, tmp_path / "c" / name]), tmp_path / "n")
    for sig, code in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
        for k in range(n + 1):
            work = tmp_path / f"{sig.name}-{k}"
            work.mkdir()
            _old_output(src, work / name)
            log = tmp_path / f"{sig.name}-{k}.log"
            args = ["consolidate", src, work / name, "--overwrite", "--no-progress"]
            got = wait(fork(_signal_at_rename(k, sig, lambda a=args: run_cli(a)), log=log))
            text = log.read_text()
            assert "Traceback" not in text, text
            if k == 0:
                assert got == code and judge_output(work / name, old) == "complete", (k, got, text)
            else:
                assert got == 0 and "after the output was published" in text, (k, got, text)
                assert judge_output(work / name, ref) == "complete", (k, text)
            assert not temps(work), temps(work)


def test_output_folder_mode_is_not_private(src: Path, tmp_path: Path) -> None:
    """The staging folder (mkdtemp: 0700) becomes the output: it must get the umask's usual mode."""
    r = cli("consolidate", src, tmp_path / "hf")
    assert r.code == 0, r.stderr
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "hf").stat().st_mode & 0o777 == 0o777 & ~umask


# ---- reshard -----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_reshard_sigkill_random(src: Path, tmp_path: Path) -> None:
    ref_dir = tmp_path / "ref"
    r = cli("reshard", src, ref_dir, "--world", "3")
    assert r.code == 0, r.stderr
    ref = tensors_of(ref_dir)
    cal = tmp_path / "cal"
    cal.mkdir()
    timing = calibrate(
        lambda: fork(
            run_cli, ["reshard", src, cal / "out", "--world", "3", "--no-progress"], env=RESHARD_DELAY
        ),
        cal,
    )
    rng = random.Random(f"{SEED}-reshard")
    seen: Counter[str] = Counter()
    for trial in range(4):
        work = tmp_path / f"t{trial}"
        work.mkdir()
        out = work / "out"
        pid = fork(run_cli, ["reshard", src, out, "--world", "3", "--no-progress"], env=RESHARD_DELAY)
        when = kill_at(pid, work, timing, rng)
        wait(pid)
        verdict = judge_output(out, ref)
        seen[verdict] += 1
        assert not verdict.startswith("CORRUPT"), f"trial {trial} killed at {when}: {verdict}"
        _no_visible_junk(work, {"out"})
        r = cli("reshard", src, out, "--world", "3", "--overwrite", "--no-progress")
        assert r.code == 0, r.stderr
        assert judge_output(out, ref) == "complete"
    print(f"reshard: {dict(seen)}")


# ---- out of space --------------------------------------------------------------------------------------
def _big_input(tmp: Path) -> Path:
    from safetensors.torch import save_file

    f = tmp / "big.safetensors"
    save_file({"w": torch.arange(64 * 1024, dtype=torch.float32), "b": torch.ones(10)}, f)
    return f


@pytest.mark.parametrize("name", ["model.safetensors", "hf", "model.bin"])
def test_file_size_limit(name: str, tmp_path: Path) -> None:
    """RLIMIT_FSIZE below the output size (SIGXFSZ ignored, so writes fail with EFBIG): one error line
    naming the output, exit 2, no output and no temporary files."""
    f = _big_input(tmp_path)
    work = tmp_path / "w"
    work.mkdir()
    log = tmp_path / "log"
    code = wait(fork(run_cli, ["consolidate", f, work / name], log=log, fsize_limit=100_000))
    text = log.read_text()
    assert code == 2, text
    assert "Traceback" not in text and text.count("error: ") == 1, text
    err = next(ln for ln in text.splitlines() if ln.startswith("error: "))
    assert str(work / name) in err and "File too large" in err, err
    assert "hint: " in text
    assert not list(work.iterdir()), list(work.iterdir())


def test_reshard_file_size_limit(src: Path, tmp_path: Path) -> None:
    log = tmp_path / "log"
    code = wait(
        fork(
            run_cli,
            ["reshard", src, tmp_path / "out", "--world", "3", "--no-progress"],
            log=log,
            fsize_limit=1500,
        )
    )
    text = log.read_text()
    assert code == 2 and "Traceback" not in text and text.count("error: ") == 1, text
    assert [p.name for p in tmp_path.iterdir()] == ["log"] or sorted(p.name for p in tmp_path.iterdir()) == [
        "log"
    ]


def _full_disk_checks(mnt: Path, rr: Run, name: str) -> None:
    assert rr.code == 2 and "Traceback" not in rr.stderr, rr.stderr
    assert "No space left on device" in rr.stderr and str(mnt / name) in rr.stderr, rr.stderr


def test_tmpfs_full(tmp_path: Path) -> None:
    """A real full disk: a 1 MiB tmpfs. Mounted here when this process may (root, as in CI), else inside a
    user and mount namespace of its own (``unshare -Urm``, the CLI run there as a subprocess); a machine
    where neither can mount fails the test rather than skipping it."""
    from safetensors.torch import save_file

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    f = tmp_path / "big.safetensors"
    save_file({"w": torch.zeros(600 * 1024, dtype=torch.float32)}, f)  # 2.4 MB > 1 MiB
    names = ("model.safetensors", "hf")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode == 0:
        try:
            for name in names:
                _full_disk_checks(mnt, cli("consolidate", f, mnt / name), name)
                assert not list(mnt.iterdir()), list(mnt.iterdir())
        finally:
            subprocess.run(["umount", str(mnt)], check=False)
        return
    _tmpfs_full_in_namespace(mnt, f, names, r.stderr.decode().strip())


def _tmpfs_full_in_namespace(mnt: Path, f: Path, names: tuple[str, ...], why: str) -> None:
    """The same checks where this user may not mount: each consolidate in a namespace with the tmpfs."""
    import shlex
    import sys

    for name in names:
        script = (
            f"mount -t tmpfs -o size=1m tmpfs {shlex.quote(str(mnt))} || exit 97; "
            f"{shlex.quote(sys.executable)} -m zckpt consolidate {shlex.quote(str(f))} "
            f"{shlex.quote(str(mnt / name))}; rc=$?; ls -A {shlex.quote(str(mnt))} >&2; exit $rc"
        )
        try:
            p = subprocess.run(["unshare", "-Urm", "sh", "-c", script], capture_output=True, text=True)
        except FileNotFoundError:
            pytest.fail(f"cannot mount a 1 MiB tmpfs ({why}) and there is no unshare: run as root")
        if p.returncode == 97 or "unshare:" in p.stderr:
            pytest.fail(f"cannot mount a 1 MiB tmpfs here ({why}; unshare -Urm: {p.stderr.strip()})")
        _full_disk_checks(mnt, Run(p.returncode, p.stdout, p.stderr), name)
        assert p.stderr.strip().splitlines()[-1].startswith(("error:", "hint:")), p.stderr  # ls: empty


# ---- engine save_checkpoint ---------------------------------------------------------------------------
# World 1: the engine is trained once, in this process (no process group), and each trial forks a child that
# only saves it. World 2: each trial forks two ranks that train 3 steps and save (gloo, file:// store).
def _save(eng: Any, save_dir: Path, tag: str, delay: str | None) -> int:
    if delay:
        os.environ[DELAY_ENV] = delay
    try:
        eng.save_checkpoint(str(save_dir), tag=tag)
    except OSError as e:  # reported briefly: under RLIMIT_FSIZE a traceback would not fit the log either
        print(f"OSError: {e.strerror}")
        return 7
    return 0


def _rank_child(save_dir: Path, saves: list[tuple[int, str]], delay: str | None, rank: int, world: int,
                store: Path) -> int:  # fmt: skip
    """One rank of a world-``world`` run: train, saving tag t after s steps for each (s, t) in ``saves``."""
    import torch.distributed as dist
    from _engine_ref import config, train

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    eng, done = None, 0
    for steps, tag in saves:
        eng, _ = train(rank, world, config(3), steps - done, first=done, engine_=eng)
        done = steps
        if _save(eng, save_dir, tag, delay):
            return 7
    return 0


def _spawn_world(world: int, tmp: Path, save_dir: Path, saves: list[tuple[int, str]], delay: str | None
                 ) -> list[int]:  # fmt: skip
    run = f"{os.getpid()}-{random.random():.9f}"
    store = tmp / f"store-{run}"
    return [
        fork(_rank_child, save_dir, saves, delay, r, world, store, log=tmp / f"log-{run}-r{r}")
        for r in range(world)
    ]


def _all_ok(pids: list[int], tmp: Path) -> None:
    codes = [wait(p, 120) for p in pids]
    if any(codes):
        logs = "\n".join(f.read_text()[-3000:] for f in sorted(tmp.glob("log-*")))
        raise AssertionError(f"engine children exited {codes}:\n{logs}")
    for f in tmp.glob("log-*"):
        f.unlink()


@pytest.fixture(scope="module")
def engine_refs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Checkpoints written without kills, world 1 and 2: tag a after 2 steps, tag b after 3; and the world-1
    engines themselves (after 2 and after 3 steps), held in this process for forked trials."""
    base = tmp_path_factory.mktemp("engine-ref")
    from _engine_ref import config, train

    refs: dict[str, Any] = {}
    d1 = base / "w1"
    e2, _ = train(0, 1, config(3), 2)
    e2.save_checkpoint(str(d1), tag="a")
    e3, _ = train(0, 1, config(3), 3)
    e3.save_checkpoint(str(d1), tag="b")
    refs["w1"] = {"dir": d1, "a": tensors_of(d1, "a"), "b": tensors_of(d1, "b"), "engines": (e2, e3)}
    d2 = base / "w2"
    _all_ok(_spawn_world(2, base, d2, [(2, "a"), (3, "b")], None), base)
    refs["w2"] = {"dir": d2, "a": tensors_of(d2, "a"), "b": tensors_of(d2, "b")}
    return refs


def _with_a(ref: dict[str, Any], sd: Path) -> Path:
    """A save dir holding tag a only, ``latest`` naming it."""
    shutil.copytree(ref["dir"], sd)
    shutil.rmtree(sd / "b")
    (sd / "latest").write_text("a")
    return sd


def _judge_engine(save_dir: Path, ref: dict[str, Any]) -> str:
    latest = (save_dir / "latest").read_text().strip()
    assert latest in ("a", "b"), latest
    prev_ok = verify_ok(save_dir, "a") and same(tensors_of(save_dir, "a"), ref["a"])
    assert prev_ok, "previous checkpoint damaged"
    assert verify_ok(save_dir), f"latest names {latest}, which does not verify"
    assert same(tensors_of(save_dir), ref[latest]), f"latest names {latest}, whose values are wrong"
    return latest


def _load_child(save_dir: Path, want_steps: int) -> int:
    from _engine_ref import config, train

    eng, _ = train(0, 1, config(3), 0)
    path, _ = eng.load_checkpoint(str(save_dir))
    return 0 if path is not None and eng.global_steps == want_steps else 3


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_engine_save_sigkill_random(world: int, engine_refs: dict[str, Any], tmp_path: Path) -> None:
    """Save tag b into a folder whose latest names a; SIGKILL a rank at a random moment (world 2: rank 1;
    rank 0, then stuck in a collective, is killed 1 s later). latest names a or b, the one it names verifies
    and holds the right values, a is intact and loads in the engine, and a rerun of the save succeeds."""
    ref = engine_refs[f"w{world}"]
    rng = random.Random(f"{SEED}-engine-{world}")
    e3 = ref["engines"][1] if world == 1 else None
    pids: list[int] = []

    def start(sd: Path, delay: str | None) -> list[int]:
        if world == 1:
            return [fork(_save, e3, sd, "b", delay)]
        return _spawn_world(world, tmp_path, sd, [(3, "b")], delay)

    cal = _with_a(ref, tmp_path / "cal")

    def start_cal() -> int:
        pids[:] = start(cal, "0.02")
        return pids[-1]

    timing = calibrate(start_cal, cal / "b")
    _all_ok(pids[:-1], tmp_path)
    seen: Counter[str] = Counter()
    for trial in range(3 if world == 1 else 2):
        sd = _with_a(ref, tmp_path / f"t{trial}")
        (sd / "b").mkdir()
        pids = start(sd, "0.02")
        when = kill_at(pids[-1], sd / "b", timing, rng)
        wait(pids[-1], 60)
        for p in pids[:-1]:
            wait(p, 1.0)
        latest = _judge_engine(sd, ref)
        seen[f"{latest}@{when}"] += 1
        if world == 1:
            assert wait(fork(_load_child, sd, 2 if latest == "a" else 3), 120) == 0, "latest does not load"
        _all_ok(start(sd, None), tmp_path)
        assert _judge_engine(sd, ref) == "b"
    print(f"engine world {world}: {dict(seen)}")


def test_engine_save_file_size_limit(engine_refs: dict[str, Any], tmp_path: Path) -> None:
    """The engine's save hits RLIMIT_FSIZE: it raises, leaves no temporary file, and latest still names a."""
    ref = engine_refs["w1"]
    sd = _with_a(ref, tmp_path / "sd")
    log = tmp_path / "log"
    code = wait(fork(_save, ref["engines"][1], sd, "b", None, log=log, fsize_limit=600), 120)
    assert code == 7 and "File too large" in log.read_text(), log.read_text()
    assert not temps(sd), temps(sd)
    assert (sd / "latest").read_text() == "a" and verify_ok(sd)


def test_engine_resave_same_tag_killed_between_renames(engine_refs: dict[str, Any], tmp_path: Path) -> None:
    """Deterministic: save tag a again (latest names a) from the 3-step engine, SIGKILL right after each
    rename; latest must still name a checkpoint that verifies (the old a or the new one)."""
    ref = engine_refs["w1"]
    e3 = ref["engines"][1]
    for k in range(1, 4):
        sd = _with_a(ref, tmp_path / f"k{k}")
        wait(fork(_die_at_rename(k, lambda sd=sd: _save(e3, sd, "a", None))), 120)
        assert (sd / "latest").read_text().strip() == "a"
        assert verify_ok(sd), f"killed after rename {k}: latest names a checkpoint that does not verify"


def test_every_output_file_is_fsynced_before_its_rename(src: Path, tmp_path: Path, monkeypatch: Any) -> None:
    """Staged files are made durable at commit, all of them (index, sidecars, ``latest`` included),
    before the first rename; a sink outside any staging folder is fsynced when it closes."""
    from zckpt import consolidate, reshard
    from zckpt.storage.sink import HashingSink

    events: list[tuple[str, str]] = []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(a: Any, b: Any, *args: Any, **kw: Any) -> None:
        events.append(("rename", str(a)))
        real_rename(a, b, *args, **kw)

    def replace(a: Any, b: Any, *args: Any, **kw: Any) -> None:
        events.append(("rename", str(a)))
        real_replace(a, b, *args, **kw)

    real_at2 = staging._renameat2

    def at2(a: Any, b: Any, flags: int) -> bool:
        events.append(("rename", str(a)))
        return real_at2(a, b, flags)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(staging, "_renameat2", at2)
    for run, out in (
        (lambda o: consolidate(src, o, max_shard_size="100KB", progress=False), tmp_path / "sharded"),
        (lambda o: consolidate(src, o, progress=False), tmp_path / "one.safetensors"),
        (lambda o: reshard(src, o, world=3, progress=False), tmp_path / "w3"),
    ):
        events.clear()
        run(out)
        first_rename = next(i for i, (k, _) in enumerate(events) if k == "rename")
        synced = {p for k, p in events[:first_rename] if k == "fsync"}
        found = out.rglob("*") if out.is_dir() else out.parent.glob(out.name + "*")
        final = [p for p in found if p.is_file()]
        assert len(final) >= 2, final
        for p in final:  # each final file was fsynced under its staged name before anything moved
            rel = p.relative_to(out if out.is_dir() else out.parent)
            assert any(s.endswith(f"/{rel}") and ".zckpt-tmp-" in s for s in synced), (out, rel)
    events.clear()
    with HashingSink(tmp_path / "loose.bin") as sink:
        sink.write(b"x" * 10)
    assert ("fsync", str(tmp_path / "loose.bin")) in events


# ---- reshard --to dcp ----------------------------------------------------------------------------------
def _metadata_folders_complete(work: Path) -> None:
    """Any folder under ``work`` (the hidden staging folder of a killed run included) whose ``.metadata``
    parses verifies clean: a ``.metadata`` never makes an incomplete folder look complete."""
    from zckpt.errors import ZckptError
    from zckpt.formats.dcp.metadata import load_metadata

    for md in work.rglob(".metadata"):
        try:
            load_metadata(md.parent)
        except ZckptError:
            continue  # cut while being written: unreadable, so it marks nothing complete
        assert verify_ok(md.parent), f"{md} parses but its folder does not verify"


def _kill_near_metadata(pid: int, work: Path, rng: random.Random) -> str:
    """SIGKILL within 0-250 ms of the moment a ``.metadata`` appears under ``work`` (being written in the
    staging folder, or the folder being published): the moments a timed kill rarely hits."""
    deadline = time.monotonic() + 120
    while not any(work.rglob(".metadata")) and time.monotonic() < deadline and not exited(pid):
        time.sleep(0.0005)
    at = rng.uniform(0, 0.25)
    time.sleep(at)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return "after-exit"
    return f"metadata+{at:.3f}s"


@pytest.mark.slow
def test_reshard_to_dcp_sigkill_random(tmp_path: Path) -> None:
    """Issue 24: 20 SIGKILLs at random moments of ``reshard --to dcp`` (a real torchtitan DCP save as source:
    tensors, opaque values copied byte for byte) leave no output or a complete one that verify passes. Half
    the kills are timed over the run, half land just after ``.metadata`` appears (written last, staged)."""
    src = Path(__file__).resolve().parents[1] / "fixtures" / "dcp" / "torchtitan_w2" / "checkpoint" / "step-3"
    assert (src / ".metadata").is_file(), f"fixture missing: {src}"
    args = ["reshard", src, None, "--world", "3", "--to", "dcp", "--no-progress"]
    ref_dir = tmp_path / "ref"
    r = cli(*[ref_dir if a is None else a for a in args])
    assert r.code == 0, r.stderr
    ref = tensors_of(ref_dir)
    cal = tmp_path / "cal"
    cal.mkdir()
    delay = {DELAY_ENV: "0.0002"}  # ~7000 small writes: ~1.5 s of write phase
    timing = calibrate(lambda: fork(run_cli, [cal / "out" if a is None else a for a in args], env=delay), cal)
    rng = random.Random(f"{SEED}-reshard-dcp")
    seen: Counter[str] = Counter()
    for trial in range(20):
        work = tmp_path / f"t{trial}"
        work.mkdir()
        out = work / "out"
        pid = fork(run_cli, [out if a is None else a for a in args], env=delay)
        when = kill_at(pid, work, timing, rng) if trial % 2 else _kill_near_metadata(pid, work, rng)
        wait(pid)
        verdict = judge_output(out, ref)
        seen[verdict] += 1
        assert not verdict.startswith("CORRUPT"), f"trial {trial} killed at {when}: {verdict}"
        if verdict == "complete":
            assert (out / ".metadata").is_file() and not temps(out)
        _metadata_folders_complete(work)
        _no_visible_junk(work, {"out"})
    work = tmp_path / "t0"
    r = cli(*[work / "out" if a is None else a for a in args], "--overwrite")
    assert r.code == 0, r.stderr
    assert judge_output(work / "out", ref) == "complete" and not temps(work)
    print(f"reshard --to dcp: {dict(seen)}")


# ---- Ctrl-C during reshard --to dcp (issue 40.7) ----------------------------------------------------------
def _sigint_at_frame_crc(n: int, args: list[Any]) -> Callable[[], int]:
    """``zckpt reshard --to dcp`` with SIGINT sent to itself inside the n-th chunk-archive frame (``_frame``
    computes a CRC-32 over an anonymous mapping of zeros): the signal's ``KeyboardInterrupt`` surfaces while
    views of that mapping are alive, where it turned into ``BufferError: cannot close exported pointers
    exist`` (exit 2, "a bug in zckpt")."""

    def run() -> int:
        from zckpt.formats.dcp import write as dcp_write

        dcp_write._frame.cache_clear()  # this child computes every frame itself
        real, calls = dcp_write.zlib, [0]

        class Zlib:
            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

            @staticmethod
            def crc32(data: Any, *a: Any) -> int:
                calls[0] += 1
                if calls[0] == n:
                    os.kill(os.getpid(), signal.SIGINT)
                return int(real.crc32(data, *a))

        dcp_write.zlib = Zlib()  # type: ignore[assignment]
        return run_cli(args)

    return run


def test_sigint_during_reshard_to_dcp_exits_130(tmp_path: Path) -> None:
    """Ctrl-C at each chunk-archive frame of ``reshard --to dcp`` (deterministic points), and at random
    moments of its write phase (writes stretched): exit 130, one "interrupted" line, no traceback, and no
    output or temporary file left."""
    src = copy_case("s1_bf16_w2", tmp_path / "src")
    frames = 4  # the fixture's output needs more than this many distinct frames: each one is a point
    trials = [f"frame{k}" for k in range(1, frames + 1)] + [f"random{k}" for k in range(4)]
    rng = random.Random(SEED)
    for name in trials:
        work = tmp_path / name
        work.mkdir()
        log = tmp_path / f"{name}.log"
        args = ["reshard", src, work / "out", "--world", "3", "--to", "dcp", "--no-progress"]
        if name.startswith("frame"):
            pid = fork(_sigint_at_frame_crc(int(name[5:]), args), log=log)
        else:
            pid = fork(run_cli, args, env={DELAY_ENV: "0.05"}, log=log)
            deadline = time.monotonic() + 60
            while not temps(work):
                assert not exited(pid), "finished before any write was seen"
                assert time.monotonic() < deadline
                time.sleep(0.001)
            time.sleep(rng.uniform(0.0, 0.3))
            os.kill(pid, signal.SIGINT)
        code = wait(pid)
        text = log.read_text()
        assert code == 130, f"{name}: exit {code}: {text}"
        assert "Traceback" not in text and "BufferError" not in text, text
        assert text.count("error: ") == 1 and "interrupted" in text, text
        assert not list(work.iterdir()), (name, list(work.iterdir()))
