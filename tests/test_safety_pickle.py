"""No code from checkpoints: pickle payloads planted into real DeepSpeed files and torch state dicts are
refused by ``inspect`` and ``consolidate`` with one line naming the global and the file, before anything runs.

Each payload would create a marker file if any part of it executed (``os.system``, ``exec``/``eval``,
``subprocess.Popen``, ``functools.partial``, nested ``__reduce__`` in a dict in a list, INST and STACK_GLOBAL
opcodes, a global from a module whose import creates the marker). The tests assert the command fails, the
error names the global and the file, the marker does not exist, the module was never imported and no output
was written. ``--trust-pickle`` loads a benign foreign class with a warning.
"""

from __future__ import annotations

import datetime
import io
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from _safety import (
    DS2,
    DS3,
    FIXTURES,
    PY,
    ROOT,
    add_key,
    assert_one_line_error,
    cli,
    copy_case,
    leftovers,
    op_call,
    op_dict,
    op_global,
    op_list,
    op_str,
    prepend,
    read_pkl,
    rewrite_pkl,
)

from zckpt.codecs.pickle_safe import SafeUnpickler
from zckpt.errors import UnsafePickle

EVIL_MODULE = "zckpt_evil_on_import"


def _touch(m: Path) -> str:
    return f"touch {m}"


def _py_touch(m: Path) -> str:
    return f"open({str(m)!r}, 'w').close()"


# name -> (opcodes pushing the payload object given the marker path, the global the error must name)
PAYLOADS: dict[str, tuple[Callable[[Path], bytes], str]] = {
    "os.system": (lambda m: op_call(op_global("os", "system"), op_str(_touch(m))), "os.system"),
    "posix.system": (lambda m: op_call(op_global("posix", "system"), op_str(_touch(m))), "posix.system"),
    "builtins.exec": (
        lambda m: op_call(op_global("builtins", "exec"), op_str(_py_touch(m))),
        "builtins.exec",
    ),
    "builtins.eval": (
        lambda m: op_call(op_global("builtins", "eval"), op_str(_py_touch(m))),
        "builtins.eval",
    ),
    "__builtin__.eval": (lambda m: op_call(op_global("__builtin__", "eval"), op_str(_py_touch(m))), "eval"),
    "subprocess.Popen": (
        lambda m: op_call(op_global("subprocess", "Popen"), op_list(op_str("touch"), op_str(str(m)))),
        "subprocess.Popen",
    ),
    "nested_reduce": (
        lambda m: op_list(
            op_dict(ok=op_str("fine"), bad=op_call(op_global("os", "system"), op_str(_touch(m))))
        ),
        "os.system",
    ),
    "functools.partial": (
        lambda m: op_call(
            op_call(op_global("functools", "partial"), op_global("os", "system"), op_str(_touch(m)))
        ),
        "functools.partial",
    ),
    "INST": (lambda m: b"(" + op_str(_touch(m)) + b"ios\nsystem\n", "os.system"),
    "STACK_GLOBAL": (
        lambda m: op_str("os") + op_str("system") + b"\x93(" + op_str(_touch(m)) + b"tR",
        "os.system",
    ),
    "rebuild_from_type_v2(os.system)": (
        lambda m: op_call(
            op_global("torch._tensor", "_rebuild_from_type_v2"),
            op_global("os", "system"),
            op_global("torch", "Tensor"),
            b"(" + op_str(_touch(m)) + b"t",
            b"}",
        ),
        "os.system",
    ),
    "torch.load": (lambda m: op_call(op_global("torch", "load"), op_str(str(m))), "torch.load"),
    "builtins.getattr": (
        lambda m: op_call(op_call(op_global("builtins", "getattr"), op_global("os", "path"), op_str("join"))),
        "builtins.getattr",
    ),
    "copyreg._reconstructor": (
        lambda m: op_call(op_global("copyreg", "_reconstructor"), op_global("os", "system"), b"N", b"N"),
        "copyreg._reconstructor",
    ),
    "import_runs_code": (lambda m: op_call(op_global(EVIL_MODULE, "run")), f"{EVIL_MODULE}.run"),
}


@pytest.fixture
def evil_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A module on sys.path whose import creates the marker; returns the marker path."""
    marker = tmp_path / "PWNED"
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / f"{EVIL_MODULE}.py").write_text(f"open({str(marker)!r}, 'w').close()\ndef run():\n    pass\n")
    monkeypatch.syspath_prepend(str(mods))
    monkeypatch.delitem(sys.modules, EVIL_MODULE, raising=False)
    return marker


def _assert_nothing_ran(marker: Path, modules_before: set[str]) -> None:
    assert not marker.exists(), "payload ran: marker file was created"
    assert EVIL_MODULE not in sys.modules, "find_class imported the payload's module"
    new = set(sys.modules) - modules_before
    assert not [m for m in new if m.split(".")[0] in ("subprocess", EVIL_MODULE)], new


# ---- the unpickler itself ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(PAYLOADS))
def test_unpickler_refuses_before_resolving(name: str, evil_path: Path) -> None:
    make, glob = PAYLOADS[name]
    before = set(sys.modules)
    for data in (
        b"\x80\x02" + make(evil_path) + b".",
        b"\x80\x02" + op_list(op_dict(x=make(evil_path))) + b".",
    ):
        with pytest.raises(UnsafePickle) as ei:
            SafeUnpickler(io.BytesIO(data), source="payload.pt").load()
        assert glob in str(ei.value) and "payload.pt" in str(ei.value)
    _assert_nothing_ran(evil_path, before)


@pytest.mark.slow
def test_torch_lazy_attributes_are_not_resolved(tmp_path: Path) -> None:
    """``torch.<name>`` is resolved from a fixed dtype table, never via torch's module ``__getattr__``
    (which imports ``torch._dynamo``/``torch.onnx`` or calls deprecated factories). In a fresh interpreter."""
    code = (
        "import io, sys\n"
        "from zckpt.codecs.pickle_safe import SafeUnpickler\n"
        "from zckpt.errors import UnsafePickle\n"
        "for n in ('_dynamo', 'onnx', '_inductor', 'has_mps', 'load'):\n"
        "    try:\n"
        "        data = b'\\x80\\x02ctorch\\n' + n.encode() + b'\\n.'\n"
        "        SafeUnpickler(io.BytesIO(data), source='f').load()\n"
        "        raise SystemExit('resolved torch.' + n)\n"
        "    except UnsafePickle:\n"
        "        pass\n"
        "bad = [m for m in ('torch._dynamo', 'torch.onnx', 'torch._inductor') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    r = subprocess.run([PY, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_allowed_dtypes_still_resolve() -> None:
    data = b"\x80\x02" + op_list(op_global("torch", "float16"), op_global("torch", "bfloat16")) + b"."
    assert SafeUnpickler(io.BytesIO(data), source="f").load() == [torch.float16, torch.bfloat16]


# ---- planted into real files, through the CLI ----------------------------------------------------------
def _plant_state_dict(tmp: Path, how: Callable[[bytes], bytes], suffix: str) -> tuple[Path, Path]:
    f = tmp / f"model{suffix}"
    torch.save({"w": torch.arange(6.0).view(2, 3), "b": torch.ones(3)}, f)
    rewrite_pkl(f, how)
    return f, f


def _plant_ds(tmp: Path, how: Callable[[bytes], bytes], case: str, file: str) -> tuple[Path, Path]:
    ck = copy_case(case, tmp)
    target = ck / "global_step3" / file
    assert target.is_file(), target
    rewrite_pkl(target, how)
    return ck, target


KINDS: dict[str, Callable[[Path, Callable[[bytes], bytes]], tuple[Path, Path]]] = {
    "ds3_model_states": lambda t, h: _plant_ds(t, h, DS3, "zero_pp_rank_1_mp_rank_00_model_states.pt"),
    "ds2_model_states": lambda t, h: _plant_ds(t, h, DS2, "mp_rank_00_model_states.pt"),
    "ds2_optim_states": lambda t, h: _plant_ds(t, h, DS2, "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    "ds3_optim_states": lambda t, h: _plant_ds(t, h, DS3, "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
    "state_dict_bin": lambda t, h: _plant_state_dict(t, h, ".bin"),
    "state_dict_pt": lambda t, h: _plant_state_dict(t, h, ".pt"),
}


def _where(name: str) -> Callable[[bytes, bytes], bytes]:
    # before the object (the first thing the unpickler meets) or after it, as one more top-level key
    if name in ("nested_reduce", "import_runs_code", "functools.partial"):
        return lambda pkl, ops: add_key(pkl, "client_state", ops)
    return lambda pkl, ops: prepend(pkl, ops)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_cli_refuses_every_payload(kind: str, tmp_path: Path, evil_path: Path) -> None:
    """Every payload, planted into a copy of a real file of this kind: inspect and consolidate both refuse."""
    before = set(sys.modules)
    for name, (make, glob) in PAYLOADS.items():
        work = tmp_path / name.replace(".", "_").replace("(", "_").replace(")", "")
        work.mkdir()
        place = _where(name)
        ops = make(evil_path)
        ckpt, planted = KINDS[kind](work, lambda pkl, place=place, ops=ops: place(pkl, ops))
        out = work / "out.safetensors"
        for args in (["inspect", ckpt], ["consolidate", ckpt, out]):
            r = cli(*args)
            line = assert_one_line_error(r, glob)
            assert str(planted) in line, f"{name}/{args[0]}: error does not name the file: {line}"
            assert "trust-pickle" in r.stderr  # the hint says how to opt in
        assert not out.exists() and not leftovers(work), (name, leftovers(work))
    _assert_nothing_ran(evil_path, before)


def test_payload_deep_inside_a_real_pickle(tmp_path: Path, evil_path: Path) -> None:
    """The payload as a value deep in the real object: a list in a dict in the top-level dict."""
    ck = copy_case(DS3, tmp_path)
    f = ck / "global_step3" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    payload = op_dict(
        args=op_list(
            op_str("a"), op_dict(inner=op_call(op_global("os", "system"), op_str(_touch(evil_path))))
        )
    )
    rewrite_pkl(f, lambda pkl: add_key(pkl, "ds_config_extra", payload))
    line = assert_one_line_error(cli("inspect", ck), "os.system", str(f))
    assert "nothing from it was run" in line
    assert not evil_path.exists()


def test_legacy_non_zip_pickle_is_not_unpickled(tmp_path: Path, evil_path: Path) -> None:
    """A legacy (non-zip) torch file is a bare pickle: refused without unpickling it."""
    f = tmp_path / "model.pt"
    f.write_bytes(b"\x80\x02" + op_call(op_global("os", "system"), op_str(_touch(evil_path))) + b".")
    assert_one_line_error(cli("inspect", f), str(f))
    assert_one_line_error(cli("consolidate", f, tmp_path / "o.safetensors"), str(f))
    assert not evil_path.exists() and not (tmp_path / "o.safetensors").exists()


# ---- --trust-pickle ----------------------------------------------------------------------------------
def test_trust_pickle_loads_benign_foreign_class(tmp_path: Path) -> None:
    f = tmp_path / "model.pt"
    torch.save({"state_dict": {"w": torch.arange(4.0)}, "created": datetime.timedelta(days=1)}, f)
    assert_one_line_error(cli("inspect", f), "datetime.timedelta", str(f))
    r = cli("inspect", "--trust-pickle", f)
    assert r.code == 0, r.stderr
    assert f"warning: {f}: --trust-pickle: resolving datetime.timedelta" in r.stderr, r.stderr
    out = tmp_path / "o.safetensors"
    r = cli("consolidate", "--trust-pickle", f, out)
    assert r.code == 0, r.stderr
    assert "warning: " in r.stderr and "datetime.timedelta" in r.stderr
    from safetensors.torch import load_file

    assert torch.equal(load_file(out)["w"], torch.arange(4.0))


@pytest.mark.slow
def test_trust_pickle_on_real_deepspeed_file_with_foreign_class(tmp_path: Path) -> None:
    """A real DeepSpeed checkpoint whose model-states file carries a benign foreign class (a Fraction in its
    client state): refused by default, read with --trust-pickle; the CLI prints the warning on stderr."""
    ck = copy_case(DS2, tmp_path)
    f = ck / "global_step3" / "mp_rank_00_model_states.pt"
    rewrite_pkl(
        f, lambda pkl: add_key(pkl, "extra", op_call(op_global("fractions", "Fraction"), op_str("1/3")))
    )
    assert_one_line_error(cli("inspect", ck), "fractions.Fraction", str(f))
    r = subprocess.run(
        [PY, "-m", "zckpt.cli.app", "inspect", "--trust-pickle", str(ck)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    warn = [ln for ln in r.stderr.splitlines() if "fractions.Fraction" in ln]
    assert warn == [f"warning: {f}: --trust-pickle: resolving fractions.Fraction for real"], r.stderr
    assert "deepspeed" in r.stdout


def test_plant_helper_keeps_file_readable(tmp_path: Path) -> None:
    """Oracle for the tests above: a rewrite with an identity transform leaves a checkpoint zckpt reads and
    torch.load(weights_only=True) loads to the same tensors, so failures above come from the payload."""
    f = tmp_path / "model.pt"
    sd = {"w": torch.arange(6.0).view(2, 3), "b": torch.ones(3)}
    torch.save(sd, f)
    old = read_pkl(f)
    rewrite_pkl(f, lambda pkl: pkl)
    assert read_pkl(f) == old
    got = torch.load(f, weights_only=True)
    assert all(torch.equal(got[k], v) for k, v in sd.items())
    ck = copy_case(DS3, tmp_path)
    for p in (ck / "global_step3").glob("*.pt"):
        rewrite_pkl(p, lambda pkl: pkl)
    r = cli("consolidate", ck, tmp_path / "o.safetensors")
    assert r.code == 0, r.stderr
    from safetensors.torch import load_file

    got_sd = load_file(tmp_path / "o.safetensors")
    ref = load_file(FIXTURES / DS3 / "ref_fp32.safetensors")
    params = [k for k in ref if ":" not in k]
    assert params and all(torch.equal(got_sd[k], ref[k]) for k in params)


# ---- held-out real checkpoints (fixtures/make_heldout.py output; not committed) ----------------------
HELDOUT = os.environ.get("ZCKPT_HELDOUT")


@pytest.mark.heldout("ZCKPT_HELDOUT")  # the folder fixtures/make_heldout.py wrote; deselected without it
def test_heldout_checkpoints_with_planted_payload(tmp_path: Path, evil_path: Path) -> None:
    """Every held-out DeepSpeed checkpoint, a payload planted in its model-states file and (separately) in
    its last optimizer file: inspect and consolidate refuse, naming the global and the file; nothing runs."""
    cases = sorted(d for d in Path(str(HELDOUT)).iterdir() if (d / "latest").is_file())
    assert cases
    payload = op_call(op_global("os", "system"), op_str(_touch(evil_path)))
    for case in cases:
        tag = (case / "latest").read_text().strip()
        model = sorted((case / tag).glob("*model_states.pt"))[:1]
        files = model + sorted((case / tag).glob("*optim_states.pt"))[-1:]
        for f in files:
            work = tmp_path / f"{case.name}-{f.stem}"
            ck = work / case.name
            (ck / tag).mkdir(parents=True)
            shutil.copy(case / "latest", ck / "latest")
            for g in (case / tag).iterdir():
                shutil.copy(g, ck / tag / g.name)
            planted = ck / tag / f.name
            rewrite_pkl(planted, lambda pkl: add_key(pkl, "client_extra", op_list(op_dict(x=payload))))
            for args in (["inspect", ck], ["consolidate", ck, work / "out.safetensors"]):
                line = assert_one_line_error(cli(*args), "os.system")
                assert str(planted) in line, line
            assert not (work / "out.safetensors").exists()
    assert not evil_path.exists()


def test_gc_paused_restores_the_state_it_found() -> None:
    import gc

    from zckpt.storage.collector import paused as gc_paused

    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner exit leaves the outer pause alone
    assert gc.isenabled()


def test_long_lived_parse_is_frozen_only_in_a_process_that_owns_its_gc(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A library caller's collector is left alone, and so is the process of a command run in-process (this
    one has run many); the ``zckpt`` program (``main`` owns the collector) freezes torch's objects once torch
    is imported and a DCP open's records once built, and the checkpoint still reads."""
    import gc

    import zckpt
    from zckpt.storage import collector

    ck = ROOT / "fixtures" / "dcp" / "fsdp2_w2" / "checkpoint"
    assert (ck / ".metadata").is_file()
    monkeypatch.setattr(collector._State, "owned", False)  # a library caller (test_cli runs main() in here)
    gc.unfreeze()
    zckpt.open(ck)
    assert gc.get_freeze_count() == 0  # not ours: nothing frozen
    code = (
        "import gc, sys\n"
        "from zckpt.cli import app\n"
        "assert 'torch' not in sys.modules\n"
        "app._leave_startup()\n"  # in-process: not the program's process
        "assert gc.get_freeze_count() == 0, 'not owned'\n"
        "from zckpt.storage import collector\n"
        "collector.own()\n"  # what main() does first
        "app._leave_startup()\n"
        "n_torch = gc.get_freeze_count()\n"
        "import zckpt\n"
        f"ck = zckpt.open({str(ck)!r})\n"
        "print(n_torch, gc.get_freeze_count() - n_torch, len(ck.entries))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    n_torch, n_open, n_entries = map(int, out.split())
    assert n_torch > 50_000  # torch's own objects (~150k), frozen once it is imported
    assert n_open > n_entries  # the open's records (metadata, chunks, entries)
    cli_main = "from zckpt.cli.app import main; import sys; sys.argv = ['zckpt', '--version']; main()"
    env = dict(os.environ, ZCKPT_FAST_EXIT="0")
    assert subprocess.run([sys.executable, "-c", cli_main], env=env, capture_output=True).returncode == 0
