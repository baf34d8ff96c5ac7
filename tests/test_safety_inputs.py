"""Corrupt and wrong input, for every command and format: one line naming the file (and a hint), a non-zero
exit, no traceback (unless ``ZCKPT_DEBUG=1``), bounded time and memory, and no output left behind.

Inputs: copies of real DeepSpeed fixtures (ZeRO-2 fp16 and ZeRO-3 fp32, world 2), a safetensors file, an HF
folder with two shards and an index, and a torch ``.bin`` — damaged by truncation at several offsets, flipped
bytes, missing / extra / stale rank files, mixed tags, a world size that disagrees with the files, files and
folders swapped, an empty folder. Crafted safetensors headers and broken zip records go to the readers
directly too, under a memory bound (tracemalloc) and a time bound.
"""

from __future__ import annotations

import json
import shutil
import struct
import time
import tracemalloc
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from _fixtures import fixture
from _safety import (
    DS2,
    DS3,
    FIXTURES,
    Run,
    assert_one_line_error,
    cli,
    copy_case,
    leftovers,
    op_str,
    read_pkl,
    rewrite_pkl,
)
from safetensors.torch import load_file, save_file

from tests.fuzz import pickles
from zckpt.codecs.torchzip import load_archive
from zckpt.errors import CorruptCheckpoint, ZckptError
from zckpt.formats import open_checkpoint

TIME_LIMIT_S = 20.0  # generous: the test machine is shared; a hang or a huge allocation takes far longer


def _registered() -> set[str]:
    from zckpt.cli.app import app

    return {c.name or (c.callback.__name__ if c.callback else "") for c in app.registered_commands}


def run_all(inp: Path, tmp: Path, *needles: str, tag: str | None = None) -> dict[str, Run]:
    """Every command on a bad input: each must fail cleanly, naming ``needles``, and leave no output."""
    outdir = tmp / "out"
    outdir.mkdir(exist_ok=True)
    extra = ["--tag", tag] if tag else []
    side = tmp / "diff-side"
    if not side.exists():
        side.mkdir()
        save_file({"a": torch.zeros(2)}, side / "b.safetensors")
    cmds: dict[str, list[str | Path]] = {
        "inspect": ["inspect", inp, *extra],
        "consolidate": ["consolidate", inp, outdir / "model.safetensors", *extra],
        "consolidate-dir": ["consolidate", inp, outdir / "hf", *extra],
        "diff": ["diff", inp, side / "b.safetensors"] + (["--tag-a", tag] if tag else []),
        "verify": ["verify", inp, *extra],
        "reshard": ["reshard", inp, outdir / "resharded", "--world", "1", *extra],
    }
    have = _registered()
    results = {}
    for name, args in cmds.items():
        if str(args[0]) not in have:
            continue
        t0 = time.monotonic()
        r = cli(*args)
        assert time.monotonic() - t0 < TIME_LIMIT_S, f"{name} took too long"
        if name == "verify":  # verify reports problems on stdout (exit 1) or fails like the others (exit 2)
            assert r.code in (1, 2), f"verify: exit {r.code}\n{r.stdout}\n{r.stderr}"
            assert "Traceback" not in r.stdout + r.stderr
            text = (r.stdout + r.stderr).lower()
            for n in needles:
                assert n.lower() in text, f"verify does not name {n!r}:\n{r.stdout}{r.stderr}"
        else:
            assert_one_line_error(r, *needles)
        results[name] = r
    assert not list(outdir.iterdir()), f"output left behind: {list(outdir.iterdir())}"
    assert not leftovers(tmp), leftovers(tmp)
    return results


# ---- inputs ----------------------------------------------------------------------------------------
def make_safetensors(tmp: Path) -> Path:
    f = tmp / "model.safetensors"
    save_file({"a": torch.arange(12.0).view(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)}, f)
    return f


def make_bin(tmp: Path) -> Path:
    f = tmp / "pytorch_model.bin"
    torch.save({"a": torch.arange(12.0).view(3, 4), "b": torch.ones(5)}, f)
    return f


def make_hf_folder(tmp: Path) -> Path:
    d = tmp / "hf"
    d.mkdir()
    save_file({"a": torch.arange(12.0).view(3, 4)}, d / "model-00001-of-00002.safetensors", {"format": "pt"})
    save_file({"b": torch.ones(5)}, d / "model-00002-of-00002.safetensors", {"format": "pt"})
    shards = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    index = {"metadata": {"total_size": 68}, "weight_map": shards}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    (d / "config.json").write_text("{}")
    return d


def truncate(f: Path, at: int) -> None:
    with open(f, "r+b") as h:
        h.truncate(at)


def flip(f: Path, at: int, n: int = 4) -> None:
    data = bytearray(f.read_bytes())
    for i in range(at, min(at + n, len(data))):
        data[i] ^= 0xFF
    f.write_bytes(bytes(data))


def pkl_span(f: Path) -> tuple[int, int]:
    """(offset, size) of data.pkl's bytes inside a torch zip file."""
    with zipfile.ZipFile(f) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith("data.pkl"))
    with open(f, "rb") as h:
        h.seek(info.header_offset + 26)
        n, m = struct.unpack("<HH", h.read(4))
    return info.header_offset + 30 + n + m, info.file_size


# ---- 1. truncation and flipped bytes -------------------------------------------------------------------
def _cuts(size: int) -> list[int]:
    return sorted({0, 1, 7, 100, size // 3, size // 2, size - 23, size - 1})


@pytest.mark.parametrize("case,file", [(DS2, "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
                                       (DS2, "mp_rank_00_model_states.pt"),
                                       (DS3, "zero_pp_rank_1_mp_rank_00_model_states.pt")])  # fmt: skip
def test_deepspeed_truncated(case: str, file: str, tmp_path: Path) -> None:
    size = (FIXTURES / case / "global_step3" / file).stat().st_size
    for at in _cuts(size):
        work = tmp_path / f"cut{at}"
        work.mkdir()
        ck = copy_case(case, work)
        truncate(ck / "global_step3" / file, at)
        run_all(ck, work, file)


def test_zip_end_record_naming_another_disk(tmp_path: Path) -> None:
    """Fuzz seed 43, case 36: a flipped byte in a DeepSpeed file's zip64 end locator made its "total number
    of disks" 141; ``zipfile.is_zipfile`` raised ``BadZipFile`` ("span multiple disks") through every
    command as "unexpected BadZipFile". Now each command names the file in one line."""
    ck = copy_case(DS3, tmp_path)
    f = ck / "global_step3" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    data = bytearray(f.read_bytes())
    loc = data.rfind(b"PK\x06\x07")  # torch.save writes zip64 records: the zip64 end locator
    assert loc > 0 and data[loc + 16 : loc + 20] == b"\1\0\0\0"
    data[loc + 16] = 0x8D  # its "total number of disks" (the fuzz case's flip)
    f.write_bytes(bytes(data))
    runs = run_all(ck, tmp_path, "zero_pp_rank_0_mp_rank_00_model_states.pt", "multiple disks")
    assert set(runs) >= {"inspect", "consolidate", "verify", "reshard"}


@pytest.mark.parametrize("make", [make_safetensors, make_bin], ids=["safetensors", "bin"])
def test_single_file_truncated(make: Callable[[Path], Path], tmp_path: Path) -> None:
    size = make(tmp_path).stat().st_size
    for at in _cuts(size):
        work = tmp_path / f"cut{at}"
        work.mkdir()
        f = make(work)
        truncate(f, at)
        run_all(f, work, f.name)


def test_hf_folder_shard_truncated_or_missing(tmp_path: Path) -> None:
    for at in (0, 5, 60, 100):
        work = tmp_path / f"cut{at}"
        work.mkdir()
        d = make_hf_folder(work)
        truncate(d / "model-00002-of-00002.safetensors", at)
        run_all(d, work, "model-00002-of-00002.safetensors")
    work = tmp_path / "missing"
    work.mkdir()
    d = make_hf_folder(work)
    (d / "model-00001-of-00002.safetensors").unlink()
    run_all(d, work, "model-00001-of-00002.safetensors")


def test_flipped_pickle_bytes(tmp_path: Path) -> None:
    """Bytes flipped inside data.pkl of a rank file: every command stops with a one-line error."""
    rng = torch.Generator().manual_seed(0)
    file = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    off, n = pkl_span(FIXTURES / DS2 / "global_step3" / file)
    spots = [off, off + 2] + [off + int(x) for x in torch.randint(3, n - 1, (6,), generator=rng)]
    failed = 0
    for at in spots:
        work = tmp_path / f"flip{at}"
        work.mkdir()
        ck = copy_case(DS2, work)
        flip(ck / "global_step3" / file, at, 1)
        # a flip may land on a byte whose change still parses (a digit of a float): then verify's CRC check
        # is what catches it; every other command must either fail cleanly or succeed
        r = cli("verify", ck)
        assert r.code == 1 and file in r.stdout and "CRC" in r.stdout, r.stdout + r.stderr
        for args in (["inspect", ck], ["consolidate", ck, work / "o.safetensors"]):
            r = cli(*args)
            if r.code != 0:
                assert_one_line_error(r, file)
                failed += 1
        assert not leftovers(work)
    assert failed >= 4, "most flips in the pickle should be refused"


def test_flipped_tensor_bytes_caught_by_verify(tmp_path: Path) -> None:
    """Flipped tensor bytes do not change structure: inspect still works, verify names the file (CRC-32)."""
    ck = copy_case(DS3, tmp_path)
    f = ck / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    with zipfile.ZipFile(f) as zf:
        rec = max((i for i in zf.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(f, "rb") as h:
        h.seek(rec.header_offset + 26)
        n, m = struct.unpack("<HH", h.read(4))
    flip(f, rec.header_offset + 30 + n + m + 4, 2)
    assert cli("inspect", ck).code == 0
    r = cli("verify", ck)
    assert r.code == 1 and str(f) in r.stdout and "CRC" in r.stdout, r.stdout


def test_safetensors_flipped_header(tmp_path: Path) -> None:
    for at in (0, 3, 8, 9, 20, 40):
        work = tmp_path / f"flip{at}"
        work.mkdir()
        f = make_safetensors(work)
        flip(f, at, 2)
        run_all(f, work, f.name)


# ---- 2. rank files: missing, extra, stale, mixed tags, world size ---------------------------------------
def _ds(tmp: Path, case: str = DS2) -> tuple[Path, Path]:
    ck = copy_case(case, tmp)
    return ck, ck / "global_step3"


def test_missing_rank_files(tmp_path: Path) -> None:
    for case, file in [(DS2, "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
                       (DS2, "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
                       (DS2, "mp_rank_00_model_states.pt"),
                       (DS3, "zero_pp_rank_1_mp_rank_00_model_states.pt"),
                       (DS3, "zero_pp_rank_0_mp_rank_00_model_states.pt")]:  # fmt: skip
        work = tmp_path / f"{case}-{file}"
        work.mkdir()
        ck, td = _ds(work, case)
        (td / file).unlink()
        needle = file if "optim" in file or case == DS3 else td.name
        run_all(ck, work, needle)


def test_extra_rank_file(tmp_path: Path) -> None:
    for case, src, extra in [(DS2, "zero_pp_rank_1_mp_rank_00_optim_states.pt",
                              "zero_pp_rank_2_mp_rank_00_optim_states.pt"),
                             (DS3, "zero_pp_rank_1_mp_rank_00_model_states.pt",
                              "zero_pp_rank_2_mp_rank_00_model_states.pt")]:  # fmt: skip
        work = tmp_path / case
        work.mkdir()
        ck, td = _ds(work, case)
        shutil.copy(td / src, td / extra)
        run_all(ck, work, extra)


def test_stale_rank_file_from_another_run(tmp_path: Path) -> None:
    """Rank 1's optimizer file replaced by rank 1's file of another run with the same stage and world size
    but other settings: the files disagree, and the message names the stale file."""
    ck, td = _ds(tmp_path, DS2)
    other = fixture("ds", "s2_fp32_w2_g2", "global_step3", "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    shutil.copy(other, td / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    run_all(ck, tmp_path, "zero_pp_rank_1_mp_rank_00_optim_states.pt")


OFFOPT_PAIR = ("s3_fp32_w2", "s3_fp32_w2_offopt")  # two real runs that differ only in offload_optimizer


@pytest.mark.parametrize("file", ["zero_pp_rank_1_mp_rank_00_optim_states.pt",
                                  "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                  "zero_pp_rank_1_mp_rank_00_model_states.pt"])  # fmt: skip
@pytest.mark.parametrize("pair", [OFFOPT_PAIR, OFFOPT_PAIR[::-1]])
def test_rank_file_of_a_run_that_differs_only_in_offload(
    pair: tuple[str, str], file: str, tmp_path: Path
) -> None:
    """Issue 24: one ZeRO-3 rank file replaced by the same rank's file of a run with the same model, seed,
    step and layout that differed only in ``offload_optimizer`` (its tensors have the same shapes, its
    optimizer state the same step): every command refuses, naming the file and the config key."""
    ck, td = _ds(tmp_path, pair[0])
    shutil.copy(fixture("ds", pair[1], "global_step3", file), td / file)
    run_all(ck, tmp_path, file, "offload_optimizer")


def test_rank_file_of_another_layout_is_named_in_one_short_line(tmp_path: Path) -> None:
    """Fuzz seed 9/127: rank 0's ZeRO-3 model file replaced by rank 0's of a run with other sub-groups; the
    message quoted both ``param_shapes`` whole (305 characters). Values are shortened to fit one line."""
    ck, td = _ds(tmp_path, "s3_fp16_w3_g2")
    file = "zero_pp_rank_0_mp_rank_00_model_states.pt"
    shutil.copy(fixture("ds", "s3_bf16_w3_sub_g2", "global_step3", file), td / file)
    line = assert_one_line_error(cli("consolidate", ck, tmp_path / "o.safetensors"), file, "param_shapes")
    assert len(line) <= 300, line


def _edit_field(f: Path, where: Callable[[tuple], bool], value: object) -> None:
    """Set the first node of ``f``'s pickle whose path satisfies ``where`` to ``value``."""
    obj = pickles.load_opaque(pickles.read_pickle(f))
    path = next(p for p, _ in pickles.walk(obj, 8) if where(p))
    pickles.rewrite_records(f, {"data.pkl": pickles.dump_opaque(pickles.set_at(obj, path, value))})


def _ends(*steps: tuple[str, object]) -> Callable[[tuple], bool]:
    return lambda p: tuple(p[-len(steps) :]) == steps


_K, _S = "key", "state"
_M1, _O1 = "zero_pp_rank_1_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"
_Z12 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
# (case, file, path, new value, field named): each field DeepSpeed writes the same on every rank of one save
CROSS_FIELDS = {
    "global_steps": (DS3, _M1, _ends((_K, "global_steps")), 4, "global_steps"),
    "global_samples": (DS3, _M1, _ends((_K, "global_samples")), 14, "global_samples"),
    "skipped_steps": (DS3, _M1, _ends((_K, "skipped_steps")), 1, "skipped_steps"),
    "dp_world_size": (DS3, _M1, _ends((_K, "dp_world_size")), 4, "dp_world_size"),
    "lr_scheduler": (DS3, _M1, _ends((_K, "last_batch_iteration")), 1, "lr_scheduler.last_batch_iteration"),
    "buffer_names": (DS3, _M1, _ends((_K, "buffer_names")), ["position_ids"], "buffer_names"),
    "ckpt dims": (DS3, _M1, _ends((_K, "tp_degree")), 2, "checkpoint_parallel_dimensions.tp_degree"),
    "model ds_version": (DS3, _M1, _ends((_K, "ds_version")), "0.19.7", "0.19.7"),
    "optim ds_version": (DS3, _O1, _ends((_K, "ds_version")), "0.19.7", "0.19.7"),
    "optim ds_config": (DS3, _O1, _ends((_K, "gradient_clipping")), 0.5, "ds_config.gradient_clipping"),
    "loss scale": (DS3, _O1, _ends((_S, "cur_scale")), 2.0, "loss_scaler"),
    "overflow": (DS3, _O1, _ends((_K, "overflow")), True, "overflow"),
    "dynamic_loss_scale": (DS3, _O1, _ends((_K, "dynamic_loss_scale")), True, "dynamic_loss_scale"),
    "lr": (DS3, _O1, _ends((_K, "lr")), 0.02, "param_groups"),
    "betas": (DS3, _O1, _ends((_K, "betas")), (0.9, 0.999), "param_groups"),
    "weight_decay": (DS3, _O1, _ends((_K, "weight_decay")), 0.0, "param_groups"),
    "z12 clip_grad": (DS2, _Z12, _ends((_K, "clip_grad")), 2.0, "clip_grad"),
    "z12 loss scaler iter": (DS2, _Z12, _ends((_S, "cur_iter")), 7, "loss_scaler"),
    "z12 inner ds_version": (
        DS2,
        _Z12,
        _ends((_K, "optimizer_state_dict"), (_K, "ds_version")),
        "0.19.7",
        "0.19.7",
    ),  # fmt: skip
    "z12 eps": (DS2, _Z12, _ends((_K, "eps")), 1e-6, "param_groups"),
    "model optimizer": (DS3, _M1, _ends((_K, "optimizer")), 3.5, "optimizer"),
    "z12 param alignment": (
        DS2,
        _Z12,
        _ends((_K, "param_alignment_paddings")),
        [[0, 0, 0, 0, 0, 0, 8, 0]],
        "param_alignment_paddings",
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", list(CROSS_FIELDS))
def test_rank_file_disagreeing_in_one_recorded_field(name: str, tmp_path: Path) -> None:
    """Every field DeepSpeed writes the same on every rank of a save is compared: one rank file of a real
    checkpoint with one such field changed is refused, naming that file, the field and a file that agrees."""
    case, file, where, value, field = CROSS_FIELDS[name]
    ck, td = _ds(tmp_path, case)
    _edit_field(td / file, where, value)
    err = run_all(ck, tmp_path, file, field)["consolidate"].stderr
    others = {p.name for p in td.iterdir()} - {file}
    assert any(o in err for o in others), err  # the file it disagrees with


def test_world_size_does_not_match_files(tmp_path: Path) -> None:
    """Every rank-1 file gone (a world-1 looking folder) while the files record world size 2."""
    ck, td = _ds(tmp_path, DS3)
    for f in td.glob("zero_pp_rank_1_*"):
        f.unlink()
    run_all(ck, tmp_path, "rank 1")


def test_mixed_zero_layouts_in_one_tag(tmp_path: Path) -> None:
    """A ZeRO-2 model file dropped into a ZeRO-3 tag folder (two runs mixed)."""
    ck, td = _ds(tmp_path, DS3)
    shutil.copy(FIXTURES / DS2 / "global_step3" / "mp_rank_00_model_states.pt", td)
    run_all(ck, tmp_path, str(td))


def test_latest_names_missing_tag(tmp_path: Path) -> None:
    ck, td = _ds(tmp_path)
    (ck / "latest").write_text("global_step9")
    r = run_all(ck, tmp_path, "latest", "global_step9")
    assert "global_step3" in r["inspect"].stderr  # the hint lists the tags that exist


def test_several_tags_without_latest(tmp_path: Path) -> None:
    """Two tags and no ``latest``: refused with a hint to pick one; ``--tag`` picks one."""
    ck, td = _ds(tmp_path)
    shutil.copytree(td, ck / "global_step2")
    (ck / "latest").unlink()
    r = cli("inspect", ck)
    assert_one_line_error(r, "global_step2", "global_step3")
    assert "hint: " in r.stderr and "--tag" in r.stderr
    ok = cli("inspect", ck, "--tag", "global_step2")
    assert ok.code == 0, ok.stderr


def test_wrong_tag_option(tmp_path: Path) -> None:
    ck, _ = _ds(tmp_path)
    r = run_all(ck, tmp_path, "global_step7", tag="global_step7")
    assert "global_step3" in r["inspect"].stderr


# ---- 3. wrong level, files and folders swapped, empty, unreadable --------------------------------------
def test_tag_folder_given_instead_of_parent(tmp_path: Path) -> None:
    """Accepted: the tag folder reads as the same checkpoint, and consolidates to the same bytes."""
    ck, td = _ds(tmp_path)
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    assert cli("consolidate", ck, a).code == 0
    r = cli("consolidate", td, b)
    assert r.code == 0, r.stderr
    sa, sb = load_file(a), load_file(b)
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    r = cli("verify", td)
    assert r.code == 0, r.stdout + r.stderr


def test_parent_of_checkpoint_folder(tmp_path: Path) -> None:
    """A folder holding checkpoint folders (one level too high): the hint names one to give."""
    ck, _ = _ds(tmp_path)
    r = run_all(tmp_path, tmp_path, str(tmp_path))
    assert str(ck) in r["inspect"].stderr


def test_empty_folder(tmp_path: Path) -> None:
    d = tmp_path / "empty"
    d.mkdir()
    run_all(d, tmp_path, str(d), "empty")


def test_missing_path(tmp_path: Path) -> None:
    run_all(tmp_path / "nope", tmp_path, "nope")


def test_tag_path_is_a_file(tmp_path: Path) -> None:
    ck, td = _ds(tmp_path)
    shutil.rmtree(td)
    td.write_text("not a folder")
    run_all(ck, tmp_path, "global_step3")


def test_rank_file_is_a_folder(tmp_path: Path) -> None:
    """A folder where a rank file should be (how an unreadable file is simulated: tests run as root, so
    chmod 000 does not stop reads)."""
    ck, td = _ds(tmp_path)
    f = td / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    f.unlink()
    f.mkdir()
    run_all(ck, tmp_path, f.name)


def test_single_rank_file_given(tmp_path: Path) -> None:
    """One DeepSpeed rank file given instead of its checkpoint folder: refused with a hint."""
    ck, td = _ds(tmp_path)
    f = td / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    r = cli("inspect", f)
    assert_one_line_error(r, f.name)
    assert "hint: " in r.stderr


def test_not_a_checkpoint_file(tmp_path: Path) -> None:
    for name, data in [("notes.txt", b"hello"), ("x.safetensors", b""), ("x.bin", b"\x00" * 64),
                       ("x.pt", b"PK\x03\x04" + b"\x00" * 60)]:  # fmt: skip
        work = tmp_path / name.replace(".", "_")
        work.mkdir()
        (work / name).write_bytes(data)
        run_all(work / name, work, name)


# ---- 4. outputs: existing, inside the input, folder vs file --------------------------------------------
def test_output_exists_refused_unless_overwrite(tmp_path: Path) -> None:
    ck, _ = _ds(tmp_path)
    out = tmp_path / "o.safetensors"
    out.write_bytes(b"precious")
    assert_one_line_error(cli("consolidate", ck, out), str(out), "exists")
    assert out.read_bytes() == b"precious"
    r = cli("consolidate", ck, out, "--overwrite")
    assert r.code == 0, r.stderr
    assert set(load_file(out)) and not leftovers(tmp_path)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "keep.txt").write_text("x")
    assert_one_line_error(cli("consolidate", ck, hf), str(hf), "exists")
    assert (hf / "keep.txt").exists()


def test_output_is_a_folder_where_a_file_is_asked(tmp_path: Path) -> None:
    ck, _ = _ds(tmp_path)
    out = tmp_path / "o.safetensors"
    out.mkdir()
    (out / "keep").write_text("x")
    for extra in ([], ["--overwrite"]):
        assert_one_line_error(cli("consolidate", ck, out, *extra), str(out))
        assert (out / "keep").exists()


def test_output_inside_input_refused(tmp_path: Path) -> None:
    ck, td = _ds(tmp_path)
    before = sorted(p.name for p in td.iterdir())
    for out in (ck / "model.safetensors", td / "model.safetensors", td / "hf", ck):
        r = cli("consolidate", ck, out, "--overwrite")
        assert_one_line_error(r, str(out))
    assert sorted(p.name for p in td.iterdir()) == before
    assert not leftovers(tmp_path)
    if "reshard" in _registered():
        assert_one_line_error(cli("reshard", ck, ck / "re", "--world", "1"), "inside")


# ---- 5. crafted safetensors headers: bounded time and memory -------------------------------------------
def _st(header: object, *, raw: bytes | None = None, n: int | None = None, data: bytes = b"\0" * 64) -> bytes:
    h = raw if raw is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(h) if n is None else n) + h + data


_T = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
CRAFTED_ST: dict[str, bytes] = {
    "huge_length": _st({"a": _T}, n=(1 << 63) + 5),
    "length_past_file": _st({"a": _T}, n=10_000),
    "length_100MB": _st({"a": _T}, n=100 << 20),
    "length_1": _st(None, raw=b"{", n=1),
    "seven_bytes": b"\x10\0\0\0\0\0\0",
    "not_json": _st(None, raw=b"\xff\xfe not json at all {{{"),
    "json_list": _st([1, 2, 3]),
    "deep_nesting": _st(None, raw=b"[" * 200_000 + b"]" * 200_000),
    "offsets_past_end": _st({"a": {"dtype": "F32", "shape": [2], "data_offsets": [1000, 1008]}}),
    "offsets_huge": _st({"a": {"dtype": "F32", "shape": [1 << 60], "data_offsets": [0, 1 << 62]}}),
    "overlap": _st({"a": _T, "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}),
    "bad_dtype": _st({"a": {"dtype": "F128", "shape": [2], "data_offsets": [0, 8]}}),
    "negative_offset": _st({"a": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}}),
    "reversed_offsets": _st({"a": {"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}}),
    "size_mismatch": _st({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}),
    "negative_shape": _st({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}),
    "float_shape": _st({"a": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}}),
    "missing_field": _st({"a": {"dtype": "F32", "shape": [2]}}),
    "entry_not_object": _st({"a": [1, 2]}),
    "bad_metadata": _st({"__metadata__": {"x": 1}, "a": _T}),
    "bad_tied_metadata": _st({"__metadata__": {"zckpt.tied": "{not json"}, "a": _T}),
}


@pytest.mark.parametrize("name", list(CRAFTED_ST))
def test_crafted_safetensors_header(name: str, tmp_path: Path) -> None:
    f = tmp_path / "x.safetensors"
    f.write_bytes(CRAFTED_ST[name])
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(ZckptError) as ei:
            ck = open_checkpoint(f)
            for k in ck:  # a header that parses must still not let a read escape the file
                ck.read(k)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.monotonic() - t0 < 5.0
    assert peak < (8 << 20) + len(CRAFTED_ST[name]) * 4, f"{name}: peak {peak} bytes"
    assert str(f) in str(ei.value) and "\n" not in str(ei.value)
    run_all(f, tmp_path, f.name)


# ---- 6. broken zip records --------------------------------------------------------------------------
def _zip_case(tmp: Path, name: str) -> Path:
    f = make_bin(tmp)
    data = bytearray(f.read_bytes())
    with zipfile.ZipFile(f) as zf:
        infos = zf.infolist()
    eocd = data.rfind(b"PK\x05\x06")
    cd = struct.unpack_from("<I", data, eocd + 16)[0]
    rec = next(i for i in infos if i.filename.endswith("data/0"))
    if name == "local_header_signature":
        data[rec.header_offset : rec.header_offset + 4] = b"XXXX"
    elif name == "record_offset_past_end":
        # central directory entry of data/0 pointing past the end of the file
        pos = data.find(b"PK\x01\x02", cd)
        while not data[pos + 46 : pos + 46 + len(rec.filename)].startswith(rec.filename.encode()):
            pos = data.find(b"PK\x01\x02", pos + 4)
        struct.pack_into("<I", data, pos + 42, len(data) + 1000)
    elif name == "record_size_huge":
        pos = data.find(b"PK\x01\x02", cd)
        while not data[pos + 46 : pos + 46 + len(rec.filename)].startswith(rec.filename.encode()):
            pos = data.find(b"PK\x01\x02", pos + 4)
        struct.pack_into("<II", data, pos + 20, 0x7FFFFFFF, 0x7FFFFFFF)
    elif name in ("stored_size_grown", "stored_csize_grown"):
        # one size of the central entry of a small bookkeeping record grows: zipfile's CRC check still passes
        # (it reads only min(sizes) bytes), torch's reader would not; zckpt must refuse the record
        ver = next(i for i in infos if i.filename.endswith("/version"))
        pos = data.find(b"PK\x01\x02", cd)
        while not data[pos + 46 : pos + 46 + len(ver.filename)].startswith(ver.filename.encode()):
            pos = data.find(b"PK\x01\x02", pos + 4)
        at = pos + (24 if name == "stored_size_grown" else 20)
        struct.pack_into("<I", data, at, struct.unpack_from("<I", data, at)[0] + 8)
    elif name == "eocd_count_huge":
        struct.pack_into("<HH", data, eocd + 8, 0xFFFF, 0xFFFF)
    elif name == "cd_offset_garbage":
        struct.pack_into("<I", data, eocd + 16, 0x7FFFFFF0)
    elif name == "compressed_record":
        with zipfile.ZipFile(f) as zf:
            recs = [(i.filename, zf.read(i)) for i in zf.infolist()]
        with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_DEFLATED) as zw:
            for n, b in recs:
                zw.writestr(n, b)
        return f
    elif name == "storage_record_missing":
        with zipfile.ZipFile(f) as zf:
            recs = [(i.filename, zf.read(i)) for i in zf.infolist() if not i.filename.endswith("data/0")]
        with zipfile.ZipFile(f, "w") as zw:
            for n, b in recs:
                zw.writestr(n, b)
        return f
    elif name == "storage_record_short":
        rewrite = tmp / "short"
        rewrite.mkdir()
        torch.save({"a": torch.arange(12.0).view(3, 4), "b": torch.ones(5)}, rewrite / "pytorch_model.bin")
        pkl = read_pkl(rewrite / "pytorch_model.bin")
        # claim 1000 elements for storage "0" (it has 12)
        pkl = pkl.replace(b"K\x0ct", b"M\xe8\x03t", 1) if b"K\x0ct" in pkl else pkl
        rewrite_pkl(f, lambda _: pkl)
        return f
    elif name in ("pkl_garbage", "pkl_truncated", "pkl_bytes_bomb", "pkl_not_dict", "pkl_memo_missing"):
        pk = {
            "pkl_garbage": lambda p: bytes(range(256)) * 4,
            "pkl_truncated": lambda p: p[: len(p) // 2],
            "pkl_bytes_bomb": lambda p: b"\x80\x02\x8e" + struct.pack("<Q", 1 << 62) + b"abc.",
            "pkl_not_dict": lambda p: b"\x80\x02" + op_str("just a string") + b".",
            "pkl_memo_missing": lambda p: b"\x80\x02h\x07.",
        }[name]
        rewrite_pkl(f, pk)
        return f
    else:
        raise AssertionError(name)
    f.write_bytes(bytes(data))
    return f


ZIP_CASES = ["local_header_signature", "record_offset_past_end", "record_size_huge", "stored_size_grown",
             "stored_csize_grown", "eocd_count_huge",
             "cd_offset_garbage", "compressed_record", "storage_record_missing", "storage_record_short",
             "pkl_garbage", "pkl_truncated", "pkl_bytes_bomb", "pkl_not_dict",
             "pkl_memo_missing"]  # fmt: skip


# damage Python's zipfile reads around (it locates the central directory from its own size and ignores the
# entry counts): reading must then give exactly the saved tensors
ZIP_HARMLESS = {"eocd_count_huge", "cd_offset_garbage"}


@pytest.mark.parametrize("name", ZIP_CASES)
def test_broken_zip_records(name: str, tmp_path: Path) -> None:
    f = _zip_case(tmp_path, name)
    tracemalloc.start()
    t0 = time.monotonic()
    err: ZckptError | None = None
    got = {}
    try:
        try:
            ck = open_checkpoint(f)
            got = {k: ck.read(k) for k in ck}
        except ZckptError as e:
            err = e
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.monotonic() - t0 < 5.0
    assert peak < 16 << 20, f"{name}: peak {peak} bytes"
    if name in ZIP_HARMLESS and err is None:
        assert torch.equal(got["a"], torch.arange(12.0).view(3, 4)) and torch.equal(got["b"], torch.ones(5))
        return
    assert err is not None, f"{name}: read without error"
    assert str(f) in str(err)
    run_all(f, tmp_path, f.name)


def test_broken_zip_record_in_a_real_deepspeed_file(tmp_path: Path) -> None:
    """The same damage in a real rank file, through the DeepSpeed reader."""
    ck, td = _ds(tmp_path, DS3)
    f = td / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    rewrite_pkl(f, lambda p: p[: len(p) - 40])
    run_all(ck, tmp_path, f.name)


# ---- 7. debugging ---------------------------------------------------------------------------------
def test_traceback_only_with_zckpt_debug(tmp_path: Path) -> None:
    f = tmp_path / "x.safetensors"
    f.write_bytes(CRAFTED_ST["overlap"])
    assert "Traceback" not in cli("inspect", f).stderr
    r = cli("inspect", f, env={"ZCKPT_DEBUG": "1"})
    assert r.code == 2 and "Traceback" in r.stderr and "error: " in r.stderr


def test_corrupt_checkpoint_is_the_error_type(tmp_path: Path) -> None:
    f = tmp_path / "x.safetensors"
    f.write_bytes(CRAFTED_ST["offsets_past_end"])
    with pytest.raises(CorruptCheckpoint):
        open_checkpoint(f)


# ---- metadata that disagrees with itself (found by fuzz seed 3) ------------------------------------------
def test_native_partitioned_optim_state_shaped_unlike_its_param(tmp_path: Path) -> None:
    """A manifest giving a partitioned optimizer state another shape than its param (with the same chunk
    size, so the rank files' headers agree) is refused naming the manifest."""
    nat = tmp_path / "nat"
    import zckpt

    zckpt.reshard(fixture("ds", DS2), nat, world=2, to="native", progress=False)
    mf = next(nat.glob("*/manifest.json"))
    m = json.loads(mf.read_text())
    o = next(o for o in m["optim_states"] if o["partitioned"] and o["shape"] and o["shape"][0] % 2 == 1)
    o["shape"] = [o["shape"][0] + 1, *o["shape"][1:]]  # same ceil(n/2) chunk on each rank
    mf.write_text(json.dumps(m))
    with pytest.raises(CorruptCheckpoint, match="manifest.json.*partitioned with shape"):
        open_checkpoint(nat)


def _edit_manifest(nat: Path, edit: Callable[[dict], object]) -> Path:
    mf = next(nat.glob("*/manifest.json"))
    m = json.loads(mf.read_text())
    edit(m)
    mf.write_text(json.dumps(m))
    return mf


# issue 24: manifest edits that change the model; each refused by every command, naming manifest + entry
MANIFEST_EDITS: dict[str, tuple[Callable[[dict], object], str]] = {
    "tie dropped": (lambda m: m.update(tied={}), "'head.weight'"),
    "tie to another shape": (lambda m: m["tied"].update({"head.weight": "pos.weight"}), "across shapes"),
    "tie to another dtype": (lambda m: m["tied"].update({"head.weight": "frozen.weight"}), "'frozen.weight'"),
    "tie added": (lambda m: m["tied"].update({"extra.weight": "fc1.weight"}), "'extra.weight'"),
    "tensor reshaped": (lambda m: m["tensors"][0].update(shape=[7, 13]), "'emb.weight' is [7, 13]"),
    "tensor dropped with its data": (
        lambda m: (
            m["tensors"].pop(0)
            and [m["optim_states"].remove(o) for o in list(m["optim_states"]) if o["param"] == "emb.weight"]
        ),
        "'emb.weight'",
    ),  # fmt: skip
    "precision": (lambda m: m.update(precision="fp16"), "precision 'fp16'"),
    "group param without data": (
        lambda m: m["optimizer"]["param_groups"][0]["params"].append("ghost.weight"),
        "'ghost.weight'",
    ),
    "optimizer state without data": (
        lambda m: m["optim_states"].append({**m["optim_states"][0], "param": "ghost.weight"}),
        "'ghost.weight'",
    ),
}


@pytest.mark.parametrize("name", list(MANIFEST_EDITS))
def test_native_manifest_edit_that_changes_the_model(name: str, tmp_path: Path) -> None:
    """A native save of a real DeepSpeed fixture (tied emb/head, frozen bf16 params), then one manifest edit
    that would change the consolidated model: every command refuses it in one line naming the manifest and
    the entry; the unedited copy reads."""
    import zckpt

    nat = tmp_path / "nat"
    zckpt.reshard(fixture("ds", "s3_bf16_w2_g2"), nat, world=2, to="native", progress=False)
    assert open_checkpoint(nat).meta.tied == {"head.weight": "emb.weight"}
    edit, needle = MANIFEST_EDITS[name]
    mf = _edit_manifest(nat, edit)
    run_all(nat, tmp_path, str(mf), needle)


def test_native_manifest_without_model_record_still_reads(tmp_path: Path) -> None:
    """Rank files written before the model record (no ``zckpt.model`` in rank 0's header) still read; the
    manifest's internal checks still apply."""
    from safetensors import safe_open

    import zckpt

    nat = tmp_path / "nat"
    zckpt.reshard(fixture("ds", DS3), nat, world=2, to="native", progress=False)
    r0 = next(nat.glob("*/rank_00000.safetensors"))
    with safe_open(r0, "pt") as f:
        assert "zckpt.model" in (f.metadata() or {})
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    save_file(tensors, r0, metadata={"format": "pt"})  # same keys and data, no record
    import hashlib

    mf = next(nat.glob("*/manifest.json"))
    m = json.loads(mf.read_text())
    data = r0.read_bytes()
    rec = m["files"][r0.name]
    rec["bytes"] = len(data)
    blk = rec["sha256_blocks"]["block"]
    rec["sha256_blocks"]["sha256"] = [
        hashlib.sha256(data[i : i + blk]).hexdigest() for i in range(0, len(data), blk)
    ]
    mf.write_text(json.dumps(m))
    assert sorted(open_checkpoint(nat).keys()) == sorted(open_checkpoint(fixture("ds", DS3)).keys())
    assert cli("verify", nat).code == 0
    _edit_manifest(nat, MANIFEST_EDITS["group param without data"][0])
    run_all(nat, tmp_path, "'ghost.weight'")


@pytest.mark.parametrize("bad", ["12", -1, True, [68], None])  # None: fuzz seed 341/50, verify said OK
def test_hf_index_total_size_not_a_byte_count(bad: object, tmp_path: Path) -> None:
    d = make_hf_folder(tmp_path)
    idx = d / "model.safetensors.index.json"
    j = json.loads(idx.read_text())
    j["metadata"]["total_size"] = bad
    idx.write_text(json.dumps(j))
    run_all(d, tmp_path, "model.safetensors.index.json", "total_size")


def test_output_through_a_link_into_the_input_folder(tmp_path: Path) -> None:
    """An output reaching the input's folder through a symbolic link the input was not named through is
    refused before anything is written; the same folder named through the input's own link, or a link to
    an ancestor, is an ordinary path."""
    real = tmp_path / "real"
    real.mkdir()
    src = make_safetensors(real)
    (tmp_path / "alias").symlink_to(real)
    r = cli("consolidate", src, tmp_path / "alias" / "m.safetensors")
    assert_one_line_error(r, "symbolic link", str(tmp_path / "alias"))
    assert sorted(p.name for p in real.iterdir()) == ["model.safetensors"]
    assert cli("consolidate", tmp_path / "alias" / src.name, tmp_path / "alias" / "m.safetensors").code == 0
    (tmp_path / "up").symlink_to(tmp_path)
    assert cli("consolidate", src, tmp_path / "up" / "real" / "m2.safetensors").code == 0


def test_flipped_bookkeeping_record_of_a_torch_zip(tmp_path: Path) -> None:
    """A flipped byte in a record no tensor read covers (``version``) fails that record's CRC-32 at open."""
    f = make_bin(tmp_path)
    with zipfile.ZipFile(f) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith("/version"))
    with open(f, "rb") as fh:
        fh.seek(info.header_offset + 26)
        n, m = struct.unpack("<HH", fh.read(4))
    flip(f, info.header_offset + 30 + n + m, 1)
    run_all(f, tmp_path, f.name)


def test_sparse_huge_shard_index(tmp_path: Path) -> None:
    """A 64 GiB (sparse) shard index is refused by its size, not read into memory."""
    d = make_hf_folder(tmp_path)
    idx = d / "model.safetensors.index.json"
    with open(idx, "r+b") as f:
        f.truncate(64 << 30)
    run_all(d, tmp_path, "model.safetensors.index.json", "larger than")


def test_swapped_module_tensors_of_a_deepspeed_file(tmp_path: Path) -> None:
    """Two ``module`` tensors of different shapes swapped in a ZeRO-2 model-states pickle (nothing reads them
    for the weights, so only the cross-check against ``param_shapes`` can notice): every command refuses."""
    ck, td = _ds(tmp_path, DS2)
    f = td / "mp_rank_00_model_states.pt"
    obj = pickles.load_opaque(pickles.read_pickle(f))
    walk = pickles.walk(obj, 3)
    mod = [(p, v) for p, v in walk if len(p) == 2 and p[0] == ("key", "module") and pickles.is_tensor(v)]
    shape = {p: tuple(pickles.rebuild_args(v)[2]) for p, v in mod}
    a, b = next((a, b) for a, _ in mod for b, _ in mod if shape[a] != shape[b])
    ta, tb = pickles.get_at(obj, a), pickles.get_at(obj, b)
    obj = pickles.set_at(pickles.set_at(obj, a, tb), b, ta)
    pickles.rewrite_records(f, {"data.pkl": pickles.dump_opaque(obj)})
    run_all(ck, tmp_path, f.name, "shape")


def test_flipped_module_weight_of_a_zero0_file(tmp_path: Path) -> None:
    """ZeRO-0 names its fp32 masters by comparing them with the 16-bit ``module`` weights: a flipped bit in a
    weight must fail that record's CRC-32, not turn into "masters not matched" and a checkpoint without an
    optimizer."""
    ck = copy_case(fixture("ds", "s0_bf16_w2").name, tmp_path)
    f = ck / "global_step3" / "mp_rank_00_model_states.pt"
    obj = load_archive(str(f))[1]
    t = max((v for v in obj["module"].values() if v.numel), key=lambda v: v.numel)
    flip(f, t.byte_offset + t.dtype.itemsize * (t.numel // 2), 1)
    run_all(ck, tmp_path, f.name, "CRC-32")


@pytest.mark.parametrize("bad", [[], None, "x"])
def test_hf_index_metadata_not_an_object(bad: object, tmp_path: Path) -> None:
    """transformers indexes ``metadata`` as an object: a list or null there is a damaged index."""
    d = make_hf_folder(tmp_path)
    idx = d / "model.safetensors.index.json"
    j = json.loads(idx.read_text())
    j["metadata"] = bad
    idx.write_text(json.dumps(j))
    runs = run_all(d, tmp_path, "model.safetensors.index.json", "metadata")
    assert "not listed" not in runs["verify"].stdout  # the shards are not blamed for the index


def test_optimizer_partition_replaced_by_a_number(tmp_path: Path) -> None:
    """One rank's ``exp_avg_sq`` partition replaced by a float (NaN) in a ZeRO-2 optimizer file: a scalar
    where the other rank holds elements is refused, not kept as a scalar state or dropped."""
    ck, td = _ds(tmp_path, DS2)
    f = td / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    obj = pickles.load_opaque(pickles.read_pickle(f))
    path = next(p for p, v in pickles.walk(obj, 8) if p[-1] == ("key", "exp_avg_sq") and pickles.is_tensor(v))
    obj = pickles.set_at(obj, path, float("nan"))
    pickles.rewrite_records(f, {"data.pkl": pickles.dump_opaque(obj)})
    run_all(ck, tmp_path, f.name, "exp_avg_sq")


def test_zero0_param_missing_one_optimizer_state(tmp_path: Path) -> None:
    """ZeRO-0: one param's ``exp_avg`` removed from the torch optimizer state. Dropping ``exp_avg`` for every
    param (a note, exit 0) would hand a resumed run fresh moments: the file is refused instead."""
    ck = copy_case(fixture("ds", "s0_bf16_w2").name, tmp_path)
    f = ck / "global_step3" / "mp_rank_00_model_states.pt"
    obj = pickles.load_opaque(pickles.read_pickle(f))
    path = next(p for p, _ in pickles.walk(obj, 8) if p[-1] == ("key", "exp_avg") and p[-2] == ("key", 1))
    pickles.rewrite_records(f, {"data.pkl": pickles.dump_opaque(pickles.delete_at(obj, path))})
    run_all(ck, tmp_path, f.name, "exp_avg")


@pytest.mark.parametrize("value", [-1, -1.0])
def test_zero0_per_element_state_replaced_by_a_scalar(value: float, tmp_path: Path) -> None:
    """Fuzz seed 19/35: ZeRO-0, one param's ``exp_avg_sq`` replaced by the number -1. It was read as a scalar
    state of that param (the others hold theirs per element), exit 0: ``reshard`` wrote it so. Refused,
    naming the file and the state."""
    ck = copy_case(fixture("ds", "s0_bf16_w2").name, tmp_path)
    f = ck / "global_step3" / "mp_rank_00_model_states.pt"
    obj = pickles.load_opaque(pickles.read_pickle(f))
    path = next(
        p
        for p, v in pickles.walk(obj, 8)
        if p[-1] == ("key", "exp_avg_sq") and p[-2] == ("key", 1) and pickles.is_tensor(v)
    )
    pickles.rewrite_records(f, {"data.pkl": pickles.dump_opaque(pickles.set_at(obj, path, value))})
    run_all(ck, tmp_path, f.name, "exp_avg_sq")


_SHARE = "'emb.weight' and 'head.weight' share one storage, but `shared_params` does not tie them"


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("s0_bf16_w2", _SHARE),
        ("s1_bf16_w2", _SHARE),
        ("s2_fp16_w2", "'head.weight' is neither a trainable param"),  # fp16 ZeRO-2: no param_shapes entry
    ],
)
def test_tied_module_tensors_missing_from_shared_params(case: str, says: str, tmp_path: Path) -> None:
    """Fuzz seed 26/106: a ZeRO-0 file's ``shared_params`` (None: ties are read from the module's shared
    storages) set to ``{}``. ``consolidate`` wrote ``head.weight`` as a weight of its own, its tie to
    ``emb.weight`` lost, exit 0. Module tensors sharing one storage must be tied in ``shared_params`` when a
    file has it (ZeRO-1/2: the real tie entry removed)."""
    ck = copy_case(fixture("ds", case).name, tmp_path)
    f = ck / "global_step3" / "mp_rank_00_model_states.pt"
    obj = pickles.load_opaque(pickles.read_pickle(f))
    assert obj["shared_params"] in (None, {"head.weight": "emb.weight"}), obj["shared_params"]
    obj["shared_params"] = {}
    pickles.rewrite_records(f, {"data.pkl": pickles.dump_opaque(obj)})
    run_all(ck, tmp_path, f.name, says)


def test_zero0_param_group_index_with_no_state(tmp_path: Path) -> None:
    """Fuzz seed 9/97: ZeRO-0, one index of the torch optimizer's ``param_groups[0].params`` changed to a
    number no state is kept under: one param's state would be orphaned and ``reshard`` dropped every
    param's moments with a note, exit 0. Refused, naming the file and the index."""
    ck = copy_case(fixture("ds", "s0_bf16_w2").name, tmp_path)
    f = ck / "global_step3" / "mp_rank_00_model_states.pt"
    obj = pickles.load_opaque(pickles.read_pickle(f))
    path = next(p for p, v in pickles.walk(obj, 8) if p[-1] == ("idx", 7) and p[-2] == ("key", "params"))
    pickles.rewrite_records(f, {"data.pkl": pickles.dump_opaque(pickles.set_at(obj, path, 2**31))})
    run_all(ck, tmp_path, f.name, "param index 7")


@pytest.mark.parametrize(
    ("case", "pattern", "holder"),
    [
        ("s0_bf16_w2", "mp_rank_00_model_states.pt", "optimizer_state_dict"),  # ZeRO-0: the torch optimizer's
        (
            DS2,
            "zero_pp_rank_*_optim_states.pt",
            "base_optimizer_state",
        ),  # every rank's file (one alone differs
        (DS3, "zero_pp_rank_*_optim_states.pt", "optimizer_state_dict"),  # from the others: caught before)
    ],
)
def test_optimizer_state_dict_without_its_state(case: str, pattern: str, holder: str, tmp_path: Path) -> None:
    """Fuzz seed 13/199: the torch optimizer state dict's ``state`` renamed. torch always saves it (empty
    before the first step), so its absence is damage; read as "no moments", ``reshard`` wrote a checkpoint
    without Adam state, exit 0. Refused, naming the (first) file and ``state``."""
    ck = copy_case(fixture("ds", case).name, tmp_path)
    files = sorted((ck / "global_step3").glob(pattern))
    for f in files:
        obj = pickles.load_opaque(pickles.read_pickle(f))
        path = next(p for p, _ in pickles.walk(obj, 8) if p[-2:] == (("key", holder), ("key", "state")))
        obj = pickles.rename_at(obj, path, "state_renamed")
        pickles.rewrite_records(f, {"data.pkl": pickles.dump_opaque(obj)})
    run_all(ck, tmp_path, files[0].name, ".state is missing")


@pytest.mark.parametrize("key", ["group_paddings", "param_slice_mappings", "param_alignment_paddings"])
@pytest.mark.parametrize(
    ("case", "file"),
    [
        (DS2, "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
        ("s1_bf16_w2", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    ],
)
def test_zero12_optimizer_file_without_a_key_deepspeed_always_writes(
    case: str, file: str, key: str, tmp_path: Path
) -> None:
    """Fuzz seed 13/111: ``group_paddings`` removed from a ZeRO-2 optimizer file. zckpt derives the padding
    and cross-checks its math against ``param_slice_mappings``, so outputs were right, but verify said OK on
    a file DeepSpeed could not load (and without the mappings the cross-check is skipped). From DeepSpeed
    0.10 on both are always written: refused, naming the file and the key (ZeRO-2, bf16 ZeRO-1 optimizer).
    Fuzz seed 17/241: likewise ``param_alignment_paddings``, which DeepSpeed's ZeRO-1/2 optimizer writes from
    0.19.8 on and reads as "no alignment padding" when absent (verify said OK)."""
    ck = copy_case(fixture("ds", case).name, tmp_path)
    f = ck / "global_step3" / file
    obj = pickles.load_opaque(pickles.read_pickle(f))
    path = next(
        p for p, _ in pickles.walk(obj, 8) if p[-2:] == (("key", "optimizer_state_dict"), ("key", key))
    )
    pickles.rewrite_records(f, {"data.pkl": pickles.dump_opaque(pickles.delete_at(obj, path))})
    run_all(ck, tmp_path, f.name, f"{key} is missing")


@pytest.mark.parametrize("case", ["s1_bf16_w2", "s1_bf16opt_w2_g2", DS2, "s3_bf16_w2_g2"])
def test_trainable_param_renamed_in_module(case: str, tmp_path: Path) -> None:
    """Fuzz seed 14/241: a trainable param's key renamed in ``module`` (bf16 ZeRO-1). ZeRO-1 names its
    frozen params only in ``module``, so the renamed key read as a frozen param and consolidate wrote the
    model plus a stray tensor, exit 0. DeepSpeed saves the module's whole state dict (ZeRO-3 params as empty
    placeholders), so a ``param_shapes`` name missing from ``module`` is damage: refused, naming the model
    file."""
    ck = copy_case(fixture("ds", case).name, tmp_path)
    files = sorted((ck / "global_step3").glob("*model_states.pt"))  # every rank's (ZeRO-3), consistently
    for f in files:
        obj = pickles.load_opaque(pickles.read_pickle(f))
        path = next(p for p, _ in pickles.walk(obj, 8) if p[-2:] == (("key", "module"), ("key", "fc1.bias")))
        obj = pickles.rename_at(obj, path, "fc1.bias_renamed")
        pickles.rewrite_records(f, {"data.pkl": pickles.dump_opaque(obj)})
    run_all(ck, tmp_path, files[0].name, "'fc1.bias' (in `param_shapes`) is not in `module`")


def test_zero3_rank_file_with_buffers_swapped(tmp_path: Path) -> None:
    """Fuzz seed 19/28: two buffers of different shapes swapped in rank 1's ZeRO-3 model file. zckpt reads
    buffers from rank 0's file, so verify said OK; every rank saves the whole buffer, so their dtypes and
    shapes are now compared across the files (with the module's names and kinds)."""
    ck = copy_case(DS3, tmp_path)
    f = ck / "global_step3" / _M1
    obj = pickles.load_opaque(pickles.read_pickle(f))
    paths = {
        name: next(p for p, _ in pickles.walk(obj, 8) if p[-2:] == (("key", "module"), ("key", name)))
        for name in ("position_ids", "scale")
    }
    a, b = (pickles.get_at(obj, paths[n]) for n in ("position_ids", "scale"))
    obj = pickles.set_at(pickles.set_at(obj, paths["position_ids"], b), paths["scale"], a)
    pickles.rewrite_records(f, {"data.pkl": pickles.dump_opaque(obj)})
    run_all(ck, tmp_path, _M1, "module entries")


@pytest.mark.parametrize("case", ["s1_bf16_w2", DS2])
def test_tied_alias_renamed_in_shared_params(case: str, tmp_path: Path) -> None:
    """Fuzz seed 19/76: ``shared_params``' alias ``head.weight`` renamed (ZeRO-1): the real alias then read as
    a ZeRO-1 frozen param and the tie pointed from a name no file holds, exit 0. DeepSpeed's aliases are the
    module's own duplicate names: an alias (or source) not in ``module`` is refused, naming the model file."""
    ck = copy_case(fixture("ds", case).name, tmp_path)
    f = ck / "global_step3" / "mp_rank_00_model_states.pt"
    obj = pickles.load_opaque(pickles.read_pickle(f))
    path = next(
        p for p, _ in pickles.walk(obj, 8) if p[-2:] == (("key", "shared_params"), ("key", "head.weight"))
    )
    obj = pickles.rename_at(obj, path, "head.renamed")
    pickles.rewrite_records(f, {"data.pkl": pickles.dump_opaque(obj)})
    run_all(ck, tmp_path, f.name, "'head.renamed', which is not in `module`")


@pytest.mark.parametrize("case", ["s1_bf16_w2", DS2])
def test_param_shape_larger_than_its_group_names_the_model_file(case: str, tmp_path: Path) -> None:
    """Fuzz seed 19/123: a ``param_shapes`` dim set to 2**70 (ZeRO-1/2) was refused naming the optimizer file
    whose partition it overran; the shape is the model file's, which is now named."""
    ck = copy_case(fixture("ds", case).name, tmp_path)
    f = ck / "global_step3" / "mp_rank_00_model_states.pt"
    where = _ends((_K, "param_shapes"), ("idx", 0), (_K, "fc1.weight"), ("arg", 0), ("idx", 1))
    _edit_field(f, where, 1 << 70)
    run_all(ck, tmp_path, f.name, "param_shapes")


def test_param_slice_mapping_missing_a_field(tmp_path: Path) -> None:
    """A ``fragment_address`` in ``param_slice_mappings`` without its ``start``: one line naming the file,
    not an AttributeError from printing the damaged record."""
    ck, td = _ds(tmp_path, DS2)
    f = td / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    obj = pickles.load_opaque(pickles.read_pickle(f))
    path = next(p for p, _ in pickles.walk(obj, 8) if p[-1] == ("state", "start"))
    pickles.rewrite_records(f, {"data.pkl": pickles.dump_opaque(pickles.delete_at(obj, path))})
    run_all(ck, tmp_path, f.name, "fragment_address")


@pytest.mark.parametrize("kind", ["dangling", "loop"])
def test_latest_as_a_link_to_no_file_is_named(tmp_path: Path, kind: str) -> None:
    """Fuzz seed 9 case 249: a save folder whose ``latest`` is a symbolic link leading nowhere (target gone,
    or a loop) was reported as "not a checkpoint, but holds 1 (global_step3)": every command now names
    ``latest`` and what is wrong with it, for DeepSpeed and native saves alike (exit 2, one line)."""
    import zckpt

    nat = tmp_path / "native"
    zckpt.reshard(fixture("ds", DS2), nat, world=2, to="native", progress=False)
    ds = tmp_path / "ds"
    shutil.copytree(fixture("ds", DS2), ds)
    for save in (ds, nat):
        latest = save / "latest"
        latest.unlink()
        latest.symlink_to(save / "gone" if kind == "dangling" else "latest")
        for argv in (("inspect", save), ("consolidate", save, tmp_path / "o.safetensors")):
            assert_one_line_error(cli(*argv), str(latest), "symbolic link", "leads to no file")
        assert not (tmp_path / "o.safetensors").exists()
        r = cli("verify", save)  # a report: the problem line names latest, exit 1
        assert r.code == 1 and f"{latest}: a symbolic link" in r.stdout and "Traceback" not in r.stderr, r


@pytest.mark.parametrize(
    ("case", "key"),
    [
        ("s2_fp16_w2", "mp_world_size"),  # fuzz seed 302/18: reshard wrote the renamed record out, exit 0
        ("s2_fp16_w2", "dp_world_size"),
        ("s3_fp32_w2", "frozen_param_fragments"),  # fuzz seed 303/108: verify said OK (None: none frozen)
        ("s0_bf16_w2", "mp_world_size"),
    ],
)
def test_model_states_without_a_key_deepspeed_always_writes(case: str, key: str, tmp_path: Path) -> None:
    """A model-states key DeepSpeed 0.10+ writes in every save (None where unused) renamed in rank 0's file
    (the only model file under ZeRO-0/1/2, so no other rank's copy disagrees). ``mp_world_size`` is what
    tells a tensor-parallel rank from a whole model; without it ``reshard`` carried the renamed record into
    its output as the run's own state, and ``verify`` passed the file. Refused, naming the file and key."""
    ck = copy_case(fixture("ds", case).name, tmp_path)
    f = sorted((ck / "global_step3").glob("*model_states.pt"))[0]
    obj = pickles.load_opaque(pickles.read_pickle(f))
    assert key in obj
    obj = pickles.rename_at(obj, next(p for p, _ in pickles.walk(obj, 1) if p == (("key", key),)), key + "_x")
    pickles.rewrite_records(f, {"data.pkl": pickles.dump_opaque(obj)})
    run_all(ck, tmp_path, f.name, f"{key} is missing")


@pytest.mark.parametrize(
    ("case", "key", "value"),
    [
        ("s0_bf16_w2", "zero_optimization", "oops"),  # fuzz seed 415/25: reshard failed with a TypeError
        ("s3_fp32_w2", "train_micro_batch_size_per_gpu", "two"),
        ("s2_fp16_w2", "gradient_accumulation_steps", 0),
    ],
)
def test_ds_config_deepspeed_never_starts_with_is_refused(
    case: str, key: str, value: object, tmp_path: Path
) -> None:
    """``ds_config`` is the config DeepSpeed started with: ``zero_optimization`` an object (or a legacy
    boolean), batch sizes positive numbers, in every rank's file alike. One set to another value (a string,
    0) was written by no run; ``reshard --to deepspeed`` rewrites these keys for the new world and failed
    with "unexpected TypeError". Refused by every command, naming the file and the key."""
    ck = copy_case(fixture("ds", case).name, tmp_path)
    for f in sorted((ck / "global_step3").glob("*model_states.pt")):  # every rank alike: no odd one out
        obj = pickles.load_opaque(pickles.read_pickle(f))
        obj = pickles.set_at(obj, (("key", "ds_config"), ("key", key)), value)
        pickles.rewrite_records(f, {"data.pkl": pickles.dump_opaque(obj)})
    run_all(ck, tmp_path, "model_states.pt", f"ds_config.{key}")


def test_ds_config_with_legacy_boolean_zero_optimization_reshards(tmp_path: Path) -> None:
    """``"zero_optimization": true`` is a config DeepSpeed accepts (its legacy form), so ``check_config``
    lets it through; ``reshard --to deepspeed`` set the output's stage inside it and failed with "unexpected
    TypeError". The output's ``ds_config.zero_optimization`` is now ``{"stage": N}``, the weights
    unchanged."""
    import zckpt

    ck = copy_case(fixture("ds", DS2).name, tmp_path)
    for f in sorted((ck / "global_step3").glob("*.pt")):
        obj = pickles.load_opaque(pickles.read_pickle(f))
        if isinstance(obj, dict) and "ds_config" in obj:
            obj = pickles.set_at(obj, (("key", "ds_config"), ("key", "zero_optimization")), True)
            pickles.rewrite_records(f, {"data.pkl": pickles.dump_opaque(obj)})
    out = tmp_path / "out"
    r = cli("reshard", ck, out, "--world", "1", "--to", "deepspeed")
    assert r.code == 0, r
    m = torch.load(
        next((out / "global_step3").glob("*model_states.pt")), map_location="cpu", weights_only=False
    )
    assert m["ds_config"]["zero_optimization"] == {"stage": 2}
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    zckpt.consolidate(fixture("ds", DS2), a, progress=False)
    zckpt.consolidate(out, b, progress=False)
    want, got = load_file(str(a)), load_file(str(b))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize(
    ("case", "rank"),
    [("s3_fp16_w3_g2", 1), ("s3_fp16_w3_g2", 0), ("s3_fp32_w2", 0), ("s2_fp16_w2", 0), ("s0_bf16_w2", 0)],
)
def test_shared_params_not_a_mapping_is_refused(case: str, rank: int, tmp_path: Path) -> None:
    """DeepSpeed writes ``shared_params`` as a dict in every model-states file of a ZeRO-1/2/3 save (the tied
    names in rank 0's, ``{}`` in the others') and None under ZeRO-0. Fuzz seed 411/0: rank 1's ``{}`` of a
    ZeRO-3 world-3 save set to None, and ``verify`` said OK (only rank 0's entries are read). Refused in
    any rank's file, naming it: None where DeepSpeed writes a dict, a list where it writes None."""
    ck = copy_case(fixture("ds", case).name, tmp_path)
    f = sorted((ck / "global_step3").glob("*model_states.pt"))[rank]
    obj = pickles.load_opaque(pickles.read_pickle(f))
    zero0 = case.startswith("s0_")
    assert obj["shared_params"] is None if zero0 else isinstance(obj["shared_params"], dict)
    obj = pickles.set_at(obj, (("key", "shared_params"),), ["head.weight"] if zero0 else None)
    pickles.rewrite_records(f, {"data.pkl": pickles.dump_opaque(obj)})
    run_all(ck, tmp_path, f.name, "shared_params")


@pytest.mark.parametrize(
    ("case", "rank"), [("s3_fp16_w3_g2", 0), ("s3_fp16_w3_g2", 1), ("s3_fp32_w2", 0), ("s3_fp32_w2", 1)]
)
def test_optimizer_state_renamed_names_the_file_at_odds(case: str, rank: int, tmp_path: Path) -> None:
    """Fuzz seed 321/25: ``exp_avg_sq`` renamed in rank 0's optimizer file of a world-2 save was reported as
    rank 1's file lacking the renamed state. The file at odds is named: with world 3 the one rank that
    renamed it; with world 2 (a tie) both files, either of which may be the altered one."""
    ck = copy_case(fixture("ds", case).name, tmp_path)
    files = sorted((ck / "global_step3").glob("*optim_states.pt"))
    obj = pickles.load_opaque(pickles.read_pickle(files[rank]))
    path = next(p for p, _ in pickles.walk(obj, 8) if p[-1] == ("key", "exp_avg_sq"))
    pickles.rewrite_records(files[rank], {"data.pkl": pickles.dump_opaque(pickles.rename_at(obj, path, "v"))})
    run_all(ck, tmp_path, files[rank].name, "optimizer state")


@pytest.mark.parametrize(
    "listed_in", ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"]
)
def test_hf_bin_index_places_a_stored_tied_alias(listed_in: str, tmp_path: Path) -> None:
    """Sharded ``.bin`` as transformers 4.x / huggingface_hub write them: a tied alias (``head.weight``,
    sharing ``emb.weight``'s storage) is saved in its owner's shard and listed there. Listed under the other
    shard (fuzz seed 331/86), the index and the shards disagree: refused, naming the index and the alias;
    listed where it is stored, read with the alias tied."""
    d = tmp_path / "hf"
    d.mkdir()
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(13, 7, generator=g)
    shards = {
        "pytorch_model-00001-of-00002.bin": {"emb.weight": emb, "head.weight": emb},
        "pytorch_model-00002-of-00002.bin": {"fc.weight": torch.randn(7, 7, generator=g)},
    }
    for name, sd in shards.items():
        torch.save(sd, d / name)
    wm = {k: name for name, sd in shards.items() for k in sd} | {"head.weight": listed_in}
    (d / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    if listed_in == "pytorch_model-00001-of-00002.bin":
        ck = open_checkpoint(d)
        assert ck.meta.tied == {"head.weight": "emb.weight"}
        assert cli("verify", d).code == 0
        return
    run_all(d, tmp_path, "pytorch_model.bin.index.json", "'head.weight'")


def test_torch_file_rewritten_under_its_sidecar_is_refused(tmp_path: Path) -> None:
    """A ``.bin`` zckpt wrote has a ``.crc32.json`` sidecar over all its bytes. Its pickle rewritten (fuzz
    seed 411/72: a tensor's stride changed) with every zip record's CRC-32 made to match, the file 4,816 bytes
    where the sidecar records 6,029, was read as another model, exit 0: only ``verify`` read torch zip
    files against their sidecars. A sidecar recording another size stops every command at open, naming the
    file; ``verify`` reports it. (Reads of tensors check their records' CRCs, not the sidecar's blocks: a
    block would be read whole where a job needs part of it.)"""
    import zckpt

    f = tmp_path / "model.bin"
    zckpt.consolidate(fixture("ds", DS2), f, progress=False)
    assert (tmp_path / "model.bin.crc32.json").is_file()
    clean = tmp_path / "clean.safetensors"
    zckpt.consolidate(fixture("ds", DS2), clean, progress=False)
    obj = pickles.load_opaque(pickles.read_pickle(f))
    pickles.rewrite_records(f, {"data.pkl": pickles.dump_opaque({**obj, "fuzz_extra": 1})})
    with zipfile.ZipFile(f) as z:  # each zip record's CRC-32 matches its bytes: the archive alone looks whole
        assert z.testzip() is None
    for argv in (("consolidate", f, tmp_path / "o.safetensors"), ("diff", f, clean), ("inspect", f)):
        assert_one_line_error(cli(*argv), str(f), "records")
    assert not (tmp_path / "o.safetensors").exists()
    r = cli("verify", f)
    assert r.code == 1 and str(f) in r.stdout, r
