"""The clean checkpoints the fuzzer damages ("bases"), built once and cached on disk.

A base is a folder ``<cache>/bases-<key>/<name>/`` holding ``base.json`` (a ``Base``), the checkpoint under
``ckpt/`` and, for some, a ``donor/`` checkpoint of the same layout with other values (another step of the
same run, or another run) that rank-file replacement and ``latest`` escapes use. Sources:

- real DeepSpeed fixtures (``fixtures/ds/<case>``) copied as they are;
- a short run of the embedded engine (world 1, ZeRO-3, saves at steps 2 and 3) resharded by zckpt into the
  native format (world 3, manifest sha256 over every rank file) and into DeepSpeed ZeRO-2/3 (world 2,
  sidecars removed so it looks like DeepSpeed's own output);
- ``zckpt consolidate`` outputs: a plain ``.safetensors`` (no sidecar), one with its ``.sha256`` sidecar, a
  sharded HF safetensors folder with index and config, a ``.bin``, a sharded HF ``.bin`` folder;
- real torch DCP saves (``fixtures/dcp``, kind ``dcp``): FSDP2 (fp32, bf16 world 3), FSDP1, HSDP, TP, 2-D,
  torchtitan (``step-N`` folders), accelerate (model + optimizer folders), several files per rank, thread
  writers, safetensors items, model only. They come last, so the older kinds' cases keep their bases.

The cache key covers this module and the fixtures used, not zckpt itself: a checkpoint written by an older
zckpt is still a valid input. Building takes ~30 s on 2 cores and runs one process at a time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "fixtures" / "ds"
PY = sys.executable
DEFAULT_CACHE = Path(os.environ.get("ZCKPT_FUZZ_CACHE", Path(tempfile.gettempdir()) / "zckpt-fuzz-cache"))

KINDS = ("deepspeed", "native", "safetensors", "hf", "bin", "hf-bin", "dcp", "megatron")


@dataclass(frozen=True)
class Base:
    """One clean checkpoint to damage (see the module docstring)."""

    name: str
    kind: str
    input: str
    """CLI input, relative to the base folder (``ckpt`` or ``ckpt/model.safetensors``)."""
    world: int | None = None
    tags: tuple[str, ...] = ()
    whole_file_checksums: bool = False
    """Every byte of its tensor files is covered by a checksum (native manifest, ``.sha256`` sidecars)."""
    donor: str | None = None
    """Folder (relative) holding a checkpoint of the same layout with other values, same tag names."""
    donor_what: str = ""

    @property
    def sharded(self) -> bool:
        return self.kind in ("deepspeed", "native")

    def save(self, folder: Path) -> None:
        (folder / "base.json").write_text(json.dumps(dataclasses.asdict(self), indent=1))

    @staticmethod
    def load(folder: Path) -> Base:
        d = json.loads((folder / "base.json").read_text())
        d["tags"] = tuple(d["tags"])
        return Base(**d)


# ---- recipes -----------------------------------------------------------------------------------------
DS_FIXTURES = {  # base name: (fixture, donor fixture of the same stage and world, or None)
    "ds-z3-fp32-w2": ("s3_fp32_w2", "s3_bf16_w2_g2"),
    "ds-z2-fp16-w2": ("s2_fp16_w2", "s2_fp32_w2_g2"),
    "ds-z1-bf16-w2": ("s1_bf16_w2", "s1_bf16opt_w2_g2"),
    "ds-z0-bf16-w2": ("s0_bf16_w2", None),
    "ds-z3-fp16-w3": ("s3_fp16_w3_g2", "s3_bf16_w3_sub_g2"),
    "ds-z3-gpt2-w2": ("gpt2_s3_bf16_w2", None),
}


def _zckpt(*args: str | Path, cwd: Path = ROOT) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ZCKPT_DIRECT_IO": "0"}
    cmd = ["nice", "-n", "10", PY, "-m", "zckpt.cli.app", *map(str, args)]
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"corpus: {' '.join(cmd)} failed:\n{r.stderr}")


def _copy_ds_fixture(case: str, dest: Path) -> None:
    src = FIXTURES / case
    dest.mkdir(parents=True)
    shutil.copy(src / "latest", dest / "latest")
    if (src / "config.json").is_file():
        shutil.copy(src / "config.json", dest / "config.json")
    for d in src.iterdir():
        if d.is_dir() and d.name.startswith("global_step"):
            shutil.copytree(d, dest / d.name)


def _drop_sidecars(folder: Path) -> None:
    for f in folder.rglob("*.sha256"):
        f.unlink()


_ENGINE_RUN = """
import sys
sys.path.insert(0, {tests!r})
import _engine_ref as R
cfg = R.config(3, "fp32")
eng, _ = R.train(0, 1, cfg, 2)
eng.save_checkpoint({out!r}, client_state={{"note": "fuzz"}})
eng, _ = R.train(0, 1, cfg, 1, first=2, engine_=eng)
eng.save_checkpoint({out!r}, client_state={{"note": "fuzz"}})
"""


def _engine_run(out: Path) -> None:
    """A world-1 ZeRO-3 engine run saved at global_step2 and global_step3 (latest)."""
    code = _ENGINE_RUN.format(tests=str(ROOT / "tests"), out=str(out))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(["nice", "-n", "10", PY, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    if r.returncode != 0:
        raise RuntimeError(f"corpus: engine run failed:\n{r.stderr}")


def _reshard_run(run: Path, dest: Path, *extra: str) -> None:
    """Both tags of ``run`` resharded into one save folder ``dest`` (latest -> global_step3)."""
    for tag in ("global_step2", "global_step3"):
        tmp = dest.with_name(dest.name + f".{tag}")
        _zckpt("reshard", run, tmp, "--tag", tag, "--no-progress", *extra)
        dest.mkdir(exist_ok=True)
        shutil.move(tmp / tag, dest / tag)
        shutil.rmtree(tmp)
    (dest / "latest").write_text("global_step3")


def _split_donor(folder: Path) -> None:
    """``folder/ckpt`` holds global_step2 and global_step3: move a copy of step 2, renamed global_step3,
    to ``folder/donor`` (the same rank's files of another step, under the tag the checkpoint uses)."""
    donor = folder / "donor"
    donor.mkdir()
    shutil.copytree(folder / "ckpt" / "global_step2", donor / "global_step3")
    (donor / "latest").write_text("global_step3")


def _build_ds_fixture(folder: Path, name: str) -> Base:
    case, donor = DS_FIXTURES[name]
    _copy_ds_fixture(case, folder / "ckpt")
    if donor is not None:
        _copy_ds_fixture(donor, folder / "donor")
    world = json.loads((FIXTURES / case / "case.json").read_text())["world"]
    return Base(name, "deepspeed", "ckpt", world, ("global_step3",), False,
                "donor" if donor else None, f"fixture {donor} (another run)" if donor else "")  # fmt: skip


def _build_engine_bases(cache: Path, bases: list[Base]) -> None:
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        run = Path(tmp) / "run"
        _engine_run(run)
        specs = {
            "native-run-w3": ("native", 3, ("--to", "native", "--world", "3")),
            "ds-run-z2-w2": ("deepspeed", 2, ("--to", "deepspeed", "--stage", "2", "--world", "2")),
            "ds-run-z3-w2": ("deepspeed", 2, ("--to", "deepspeed", "--stage", "3", "--world", "2")),
        }
        for name, (kind, world, args) in specs.items():
            folder = cache / name
            folder.mkdir()
            _reshard_run(run, folder / "ckpt", *args)
            if kind == "deepspeed":
                _drop_sidecars(folder / "ckpt")
            _split_donor(folder)
            b = Base(name, kind, "ckpt", world, ("global_step2", "global_step3"), kind == "native",
                     "donor", "global_step2 of the same run")  # fmt: skip
            b.save(folder)
            bases.append(b)


def _build_consolidated(cache: Path, bases: list[Base]) -> None:
    """Bases written by ``zckpt consolidate`` (and one native base resharded from a fixture)."""
    specs: list[tuple[str, str, str, str, tuple[str, ...], bool]] = [
        # name, kind, fixture, output (relative to the base folder), extra args, keep sidecars
        ("st-plain", "safetensors", "s3_fp32_w2", "ckpt/model.safetensors", (), False),
        ("st-sidecar", "safetensors", "s2_fp16_w2", "ckpt/model.safetensors", ("--dtype", "fp32"), True),
        ("hf-st", "hf", "gpt2_s3_bf16_w2", "ckpt", ("--max-shard-size", "20KB"), False),
        ("bin", "bin", "s2_fp16_w2", "ckpt/model.bin", (), False),
        ("hf-bin", "hf-bin", "s1_bf16_w2", "ckpt", ("--format", "bin", "--max-shard-size", "600B"), False),
    ]
    for name, kind, case, out, extra, sidecars in specs:
        folder = cache / name
        folder.mkdir()
        _zckpt("consolidate", FIXTURES / case, folder / out, "--no-progress", *extra)
        if not sidecars:
            _drop_sidecars(folder / "ckpt")
        b = Base(name, kind, out, None, (), sidecars)
        b.save(folder)
        bases.append(b)
    folder = cache / "native-fp16-w2"
    folder.mkdir()
    _zckpt(
        "reshard", FIXTURES / "s2_fp16_w2", folder / "ckpt", "--to", "native", "--world", "2", "--no-progress"
    )
    b = Base("native-fp16-w2", "native", "ckpt", 2, ("global_step3",), True)
    b.save(folder)
    bases.append(b)


DCP_FIXTURES = ROOT / "fixtures" / "dcp"
DCP_BASES = {  # base name: (fixture folder, the folder copied as ckpt/)
    "dcp-fsdp2-w2": ("fsdp2_w2", "checkpoint"),
    "dcp-fsdp2-bf16-w3": ("fsdp2_bf16_w3", "checkpoint"),
    "dcp-fsdp1-w2": ("fsdp1_w2", "checkpoint"),
    "dcp-hsdp-w4": ("hsdp_w4", "checkpoint"),
    "dcp-tp-w2": ("tp_w2", "checkpoint"),
    "dcp-tp2d-w4": ("tp2d_w4", "checkpoint"),
    "dcp-torchtitan-w2": ("torchtitan_w2", "checkpoint"),
    "dcp-accelerate-w2": ("accelerate_w2", "checkpoints/checkpoint_0"),
    "dcp-perfile-w2": ("perfile_w2", "checkpoint"),
    "dcp-threads-w2": ("threads_w2", "checkpoint"),
    "dcp-stformat-w2": ("stformat_w2", "checkpoint"),
    "dcp-model-only-w2": ("model_only_w2", "checkpoint"),
}


def _build_dcp(cache: Path, bases: list[Base]) -> None:
    for name, (case, sub) in DCP_BASES.items():
        src = DCP_FIXTURES / case / sub
        if not src.is_dir():
            raise RuntimeError(f"corpus: DCP fixture missing: {src} (fixtures/make_dcp_fixtures.py)")
        folder = cache / name
        folder.mkdir()
        shutil.copytree(src, folder / "ckpt")
        world = json.loads((DCP_FIXTURES / case / "case.json").read_text())["world"]
        b = Base(name, "dcp", "ckpt", world)
        b.save(folder)
        bases.append(b)


MEGATRON_FIXTURES = ROOT / "fixtures" / "megatron"
MEGATRON_BASES = {  # base name (short: Megatron's keys make long error lines already): fixture case
    "mg-distopt": "tp2dp2_bf16_distopt",
    "mg-tp2pp2": "tp2pp2_bf16_llama",
    "mg-tp1": "tp1_fp32_llama",
    "mg-gpt2": "tp2_fp32_gpt2",
}


def _build_megatron(cache: Path, bases: list[Base]) -> None:
    for name, case in MEGATRON_BASES.items():
        src = MEGATRON_FIXTURES / case / "ckpt"
        if not src.is_dir():
            raise RuntimeError(
                f"corpus: Megatron fixture missing: {src} (fixtures/megatron/make_megatron_fixtures.py)"
            )
        folder = cache / name
        folder.mkdir()
        shutil.copytree(src, folder / "ckpt")
        world = json.loads((MEGATRON_FIXTURES / case / "case.json").read_text())["world"]
        b = Base(name, "megatron", "ckpt", world)
        b.save(folder)
        bases.append(b)


def cache_key() -> str:
    h = hashlib.sha256(Path(__file__).read_bytes())
    for case, donor in DS_FIXTURES.values():
        for c in (case, donor):
            if c is not None:
                for f in sorted((FIXTURES / c).rglob("*.pt")):
                    h.update(f.name.encode() + f.read_bytes())
    for case, sub in DCP_BASES.values():
        for f in sorted((DCP_FIXTURES / case / sub).rglob("*")):
            if f.is_file():
                h.update(f.name.encode() + f.read_bytes())
    for case in MEGATRON_BASES.values():
        for f in sorted((MEGATRON_FIXTURES / case / "ckpt").rglob("*")):
            if f.is_file():
                h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:12]


def build(cache: Path = DEFAULT_CACHE) -> list[Base]:
    """Every base, built on first use (into a temporary folder renamed into place) and cached."""
    final = cache / f"bases-{cache_key()}"
    if not (final / "done").is_file():
        cache.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="bases-building-", dir=cache))
        bases: list[Base] = []
        for name in DS_FIXTURES:
            (work / name).mkdir()
            b = _build_ds_fixture(work / name, name)
            b.save(work / name)
            bases.append(b)
        _build_engine_bases(work, bases)
        _build_consolidated(work, bases)
        _build_dcp(work, bases)
        _build_megatron(work, bases)
        (work / "done").write_text("\n".join(b.name for b in bases) + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.rename(work, final)
    return [Base.load(final / n) for n in (final / "done").read_text().split()]


def base_dir(base: Base, cache: Path = DEFAULT_CACHE) -> Path:
    return cache / f"bases-{cache_key()}" / base.name


def by_name(cache: Path = DEFAULT_CACHE) -> dict[str, Base]:
    return {b.name: b for b in build(cache)}
