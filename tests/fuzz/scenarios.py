"""Mutations of the invocation rather than the files: where the output goes, and signals mid-run.

- ``paths``: output = another tag of the input's save folder (with ``--overwrite``), output == input,
  output inside the input, output containing the input, output reached through a symlink into the input,
  bare ``reshard`` run from inside a tag folder (and, as a control, from the save folder), two concurrent
  consolidates into one output, ``--overwrite`` over an earlier sharded output with more shards;
- ``signals``: SIGINT at a random moment of start-up, SIGINT or SIGTERM mid-write (once the staging folder
  exists, writes slowed), SIGKILL mid-write followed by a normal re-run (the killed run's staging folder
  must not stay behind).

Each returns a ``Mutation`` whose ``scenario`` (``plain``, ``concurrent``, ``signal``, ``kill-rerun``) and
``argv`` tell the runner what to run; ``checks`` adds checks such as ``no-stale-shards``; ``params`` holds
``ref_command``, the standard command whose clean output an exit-0 run must reproduce.
"""

from __future__ import annotations

import random
import signal
from pathlib import Path

from tests.fuzz.mutation import Mutation, Mutator, NotApplicable, Op, fresh_copy, new

SHARDED = ("deepspeed", "native")
ALL = ("deepspeed", "native", "safetensors", "hf", "bin", "hf-bin")
NO_PROGRESS = "--no-progress"


def _out_name(rng: random.Random) -> str:
    return rng.choice(("model.safetensors", "hf", "model.bin"))


def _plain(op: str, argv: list[str], *, must_refuse: bool, cwd: str | None = None, ref: str | None = None,
           setup: list[list[str]] | None = None, checks: tuple[str, ...] = ()) -> Mutator:  # fmt: skip
    def mutate(case_dir: Path, rng: random.Random) -> Mutation:
        base, root = fresh_copy(case_dir)
        if op.startswith("out-is-other-tag") and len(base.tags) < 2:
            raise NotApplicable(root, "needs two tags")
        if op == "out-symlink-into-input":
            target = root / base.input
            (root / "link").symlink_to(target if target.is_dir() else target.parent)
        m = new("paths", op, " ".join(argv), base, root, must_refuse=must_refuse, scenario="plain",
                argv=list(argv), cwd=cwd, setup=list(setup or []), checks=checks)  # fmt: skip
        m.params["ref_command"] = ref
        return m

    return mutate


def _consolidate_twice(op: str, first: list[str], then: list[str], ref: str) -> Mutator:
    """An earlier output (``first``), then the command judged, with ``--overwrite``."""
    return _plain(op, then, must_refuse=False, ref=ref, setup=[first], checks=("no-stale-shards",))


def _concurrent(case_dir: Path, rng: random.Random) -> Mutation:
    base, root = fresh_copy(case_dir)
    name = _out_name(rng)
    argv = ["consolidate", "{in}", f"{{root}}/out/{name}", NO_PROGRESS]
    m = new("paths", "concurrent-consolidates", f"two at once: {' '.join(argv)}", base, root,
            scenario="concurrent", argv=argv)  # fmt: skip
    m.params["ref_command"] = {"model.safetensors": "consolidate", "model.bin": "consolidate-bin"}.get(name)
    return m


def _signal(op: str, signum: int, trigger: str) -> Mutator:
    """``trigger``: "time" (a random moment of the first second: start-up) or "staging" (a random moment
    after the staging folder appeared: mid-write, writes slowed)."""

    def mutate(case_dir: Path, rng: random.Random) -> Mutation:
        base, root = fresh_copy(case_dir)
        at = round(rng.uniform(0.05, 1.0) if trigger == "time" else rng.uniform(0.0, 0.3), 2)
        argv = ["consolidate", "{in}", "{root}/out/hf", "--max-shard-size", "2KB", NO_PROGRESS]
        when = f"{at}s after start" if trigger == "time" else f"{at}s after the staging folder appeared"
        m = new("signals", op, f"{signal.Signals(signum).name} {when}: {' '.join(argv)}", base, root,
                scenario="signal", argv=argv)  # fmt: skip
        m.params.update(signal=signum, at=at, trigger=trigger, ref_command="consolidate-hf")
        return m

    return mutate


def _kill_rerun(case_dir: Path, rng: random.Random) -> Mutation:
    base, root = fresh_copy(case_dir)
    at = round(rng.uniform(0.0, 0.3), 2)
    cmd = rng.choice((["consolidate", "{in}", "{root}/out/hf", "--max-shard-size", "2KB", NO_PROGRESS],
                      ["consolidate", "{in}", "{root}/out/model.safetensors", NO_PROGRESS]))  # fmt: skip
    m = new("signals", "sigkill-then-rerun", f"SIGKILL {at}s after the staging folder appeared, then the "
            f"same again: {' '.join(cmd)}", base, root, scenario="kill-rerun", argv=cmd)  # fmt: skip
    m.params.update(signal=signal.SIGKILL, at=at, trigger="staging",
                    ref_command="consolidate-hf" if "hf" in cmd[2] else "consolidate")  # fmt: skip
    return m


TAG3, TAG2 = "{root}/ckpt/global_step3", "{root}/ckpt/global_step2"
BIG = "{root}/out/model.safetensors"
FOLDERS = ("deepspeed", "native", "hf", "hf-bin")
# name: (argv, must refuse, base kinds, cwd)
_PLAIN: dict[str, tuple[list[str], bool, tuple[str, ...], str | None]] = {
    "out-is-other-tag": (["consolidate", TAG3, TAG2, "--overwrite", NO_PROGRESS], True, SHARDED, None),
    "out-is-other-tag-reshard": (["reshard", TAG3, TAG2, "--world", "2", "--overwrite", NO_PROGRESS], True,
                                 SHARDED, None),
    "out-equals-input": (["consolidate", "{in}", "{in}", "--overwrite", NO_PROGRESS], True, ALL, None),
    "out-equals-input-reshard": (["reshard", "{in}", "{in}", "--world", "2", "--overwrite", NO_PROGRESS],
                                 True, SHARDED, None),
    "out-inside-input": (["consolidate", "{in}", "{in}/sub/model.safetensors", NO_PROGRESS], True, FOLDERS,
                         None),
    "out-contains-input": (["consolidate", "{in}", "{root}/ckpt/..", "--overwrite", NO_PROGRESS], True, ALL,
                           None),
    "out-symlink-into-input": (["consolidate", "{in}", "{root}/link/inner.safetensors", NO_PROGRESS], True,
                               ALL, None),
    "bare-reshard-in-tag": (["reshard", "--world", "2", NO_PROGRESS], False, SHARDED, "ckpt/global_step3"),
    "bare-reshard-in-save-dir": (["reshard", "--world", "2", NO_PROGRESS], False, SHARDED, "ckpt"),
}  # fmt: skip


def _ops() -> dict[str, list[Op]]:
    paths = [Op(name, _plain(name, argv, must_refuse=refuse, cwd=cwd), kinds,
                min_tags=2 if "other-tag" in name else 1)
             for name, (argv, refuse, kinds, cwd) in _PLAIN.items()]  # fmt: skip
    small = ["consolidate", "{in}", BIG, "--max-shard-size", "300B", NO_PROGRESS]
    paths += [
        Op("concurrent-consolidates", _concurrent, ALL),
        Op("overwrite-fewer-shards", _consolidate_twice("overwrite-fewer-shards", small, [
            "consolidate", "{in}", BIG, "--max-shard-size", "2KB", "--overwrite", NO_PROGRESS], "-"), ALL),
        Op("overwrite-sharded-with-one-file", _consolidate_twice("overwrite-sharded-with-one-file", small, [
            "consolidate", "{in}", BIG, "--overwrite", NO_PROGRESS], "consolidate"), ALL),
    ]  # fmt: skip
    signals = [
        Op("sigint-startup", _signal("sigint-startup", signal.SIGINT, "time"), ALL),
        Op("sigint-mid-write", _signal("sigint-mid-write", signal.SIGINT, "staging"), ALL),
        Op("sigterm-mid-write", _signal("sigterm-mid-write", signal.SIGTERM, "staging"), ALL),
        Op("sigkill-then-rerun", _kill_rerun, ALL),
    ]
    return {"paths": paths, "signals": signals}


FAMILIES: dict[str, list[Op]] = _ops()
