"""Unreadable input (issue 24): a folder or file this process may not read is reported as "permission denied"
naming it, in one line, by every reader (DeepSpeed tag folder and save folder, ``latest``, rank files; native
tag folder, manifest, rank file; HF folder, index, shard; a single file; a DCP ``.metadata``), never as a
missing tag or an unknown format.

Tests run as root in CI, and root reads a ``chmod 000`` file anyway. The commands therefore run in a child
process that file permissions bind: as root, one whose bounding set lacks ``CAP_DAC_OVERRIDE`` and
``CAP_DAC_READ_SEARCH`` (dropped with ``prctl`` before ``exec``, so the child's root has no permission
override left); the child first proves that it cannot open a ``chmod 000`` file, else the test fails.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from _fixtures import fixture
from _safety import DS3, ROOT, Run, assert_one_line_error, copy_case

import zckpt

PR_CAPBSET_DROP = 24
CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 1, 2

_CHILD = r"""
import json, os, sys
from _safety import cli
canary, cases = sys.argv[1], json.loads(sys.argv[2])
try:
    open(canary, "rb").close()
    sys.exit(97)  # permissions do not bind this process: the test would prove nothing
except PermissionError:
    pass
out = []
for target, mode, args in cases:
    old = os.stat(target).st_mode & 0o7777
    os.chmod(target, mode)
    try:
        r = cli(*args)
    finally:
        os.chmod(target, old)
    out.append([r.code, r.stdout, r.stderr])
print("RESULTS " + json.dumps(out))
"""


def _drop_dac() -> None:
    """``preexec_fn`` as root: no permission override after ``exec`` (bounding set without the DAC caps)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def run_unreadable(tmp: Path, cases: list[tuple[Path, int, list[str | Path]]]) -> list[Run]:
    """Each ``(target, mode, zckpt args)``: ``chmod mode target``, run the command, restore the mode -- in one
    child process that file permissions apply to (see the module doc)."""
    canary = tmp / "canary"
    canary.write_bytes(b"x")
    canary.chmod(0)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    plan = json.dumps([[str(t), m, [str(a) for a in args]] for t, m, args in cases])
    r = subprocess.run(
        [sys.executable, "-c", _CHILD, str(canary), plan],
        env=env,
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=_drop_dac if os.geteuid() == 0 else None,
    )
    assert r.returncode != 97, "the child can still read a chmod 000 file: this test would prove nothing"
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULTS "))
    return [Run(c, o, e) for c, o, e in json.loads(line[len("RESULTS ") :])]


def _check(run: Run, target: Path, verify: bool) -> None:
    if verify:  # problems on stdout, exit 1 (or a refusal, exit 2)
        assert run.code in (1, 2), run
        text = run.stdout + run.stderr
        assert "Traceback" not in text
        assert "permission denied" in text.lower() and str(target) in text, text
    else:
        assert run.code == 2, run
        assert_one_line_error(run, "permission denied", str(target))


def test_unreadable_folders_and_files_say_permission_denied(tmp_path: Path) -> None:
    ds = copy_case(DS3, tmp_path / "ds")
    nat = tmp_path / "nat"
    zckpt.reshard(ds, nat, world=2, to="native", progress=False)
    hf = tmp_path / "hf"
    zckpt.consolidate(ds, hf, max_shard_size="1KB", progress=False)
    single = tmp_path / "model.safetensors"
    shutil.copy(fixture("ds", DS3, "ref_fp32.safetensors"), single)
    dcp = next(p.parent for p in sorted(fixture("dcp").rglob(".metadata")))
    shutil.copytree(dcp, tmp_path / "dcp")
    dcp = tmp_path / "dcp"
    out = tmp_path / "out.safetensors"
    tag, ntag = ds / "global_step3", nat / "global_step3"
    shard = sorted(hf.glob("model-*-of-*.safetensors"))[-1]
    cases: list[tuple[Path, int, list[str | Path], bool]] = [
        (tag, 0o000, ["consolidate", ds, out], False),  # the reported class: not "no such tag"
        (tag, 0o000, ["verify", ds], True),
        (tag, 0o000, ["inspect", ds, "--tag", "global_step3"], False),
        (tag, 0o000, ["inspect", tag], False),
        (tag, 0o444, ["consolidate", ds, out], False),  # listable, not enterable
        (tag, 0o444, ["verify", ds], True),
        (ds, 0o000, ["inspect", ds], False),
        (ds / "latest", 0o000, ["consolidate", ds, out], False),
        (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt", 0o000, ["consolidate", ds, out], False),
        (tag / "zero_pp_rank_1_mp_rank_00_model_states.pt", 0o000, ["inspect", ds], False),
        (ntag, 0o000, ["consolidate", nat, out], False),
        (ntag, 0o000, ["verify", nat], True),
        (nat / "latest", 0o000, ["inspect", nat], False),
        (ntag / "manifest.json", 0o000, ["inspect", nat], False),
        (ntag / "manifest.json", 0o000, ["verify", ntag], True),
        (ntag / "rank_00001.safetensors", 0o000, ["consolidate", nat, out], False),
        (hf, 0o000, ["inspect", hf], False),
        (hf / "model.safetensors.index.json", 0o000, ["consolidate", hf, out], False),
        (shard, 0o000, ["consolidate", hf, out], False),
        (single, 0o000, ["inspect", single], False),
        (dcp / ".metadata", 0o000, ["inspect", dcp], False),
    ]
    runs = run_unreadable(tmp_path, [(t, m, a) for t, m, a, _ in cases])
    for (target, _, args, verify), run in zip(cases, runs, strict=True):
        try:
            _check(run, target, verify)
        except AssertionError as e:
            raise AssertionError(f"zckpt {' '.join(map(str, args))} with {target} unreadable: {e}") from None
    assert not out.exists()
