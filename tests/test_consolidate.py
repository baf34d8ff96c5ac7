"""consolidate: multi-piece assembly, casting, keep-fp32, sharding, tied aliases, HF interop, and
never leaving half-written output. Oracles: hand-made tensors, safetensors.torch.load_file,
torch.load(weights_only=True), transformers, and real DeepSpeed fixtures when present."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from _fixtures import ds_cases
from safetensors import safe_open
from safetensors.torch import load_file

import zckpt
from zckpt.checkpoint import Checkpoint
from zckpt.errors import CorruptCheckpoint, OutputExists
from zckpt.model import Piece, Role, TensorEntry
from zckpt.state import CheckpointMeta, TrainingState
from zckpt.stream import fill, pipeline
from zckpt.stream import items as outputs

torch.manual_seed(0)
MASTERS = {  # fp32 masters of trainable params
    "emb.weight": torch.randn(13, 7),
    "norm.weight": torch.randn(7) * 1e-3,
    "fc.weight": torch.randn(11, 7) * 300,  # fp16 overflow-free but rounding-heavy
    "scale": torch.randn(1),
}
FROZEN = {"frozen.weight": torch.randn(7, 7).bfloat16()}
BUFFERS = {"position_ids": torch.arange(5, dtype=torch.int64)}
TIED = {"head.weight": "emb.weight"}


def _bytes(t: torch.Tensor) -> bytes:
    t = t.reshape(-1).contiguous()
    return t.view(torch.uint8).numpy().tobytes()


def make_ckpt(root: Path, *, world: int = 3, precision: str | None = "bf16") -> Checkpoint:
    """Each tensor split over ``world`` raw rank files (uneven chunks, NaN/garbage padding between)."""
    root.mkdir(parents=True, exist_ok=True)
    files = [root / f"rank{r}.raw" for r in range(world)]
    blobs = [bytearray() for _ in files]
    entries = []
    groups = [(MASTERS, Role.PARAM), (FROZEN, Role.FROZEN), (BUFFERS, Role.BUFFER)]
    for tensors, role in groups:
        for name, t in tensors.items():
            flat = t.reshape(-1)
            n = flat.numel()
            c = -(-n // world)
            pieces = []
            for r in range(world):
                lo, hi = min(r * c, n), min((r + 1) * c, n)
                if hi == lo:
                    continue
                blob = blobs[r]
                off = len(blob)
                blob += _bytes(flat[lo:hi])
                pad = (
                    torch.full((3,), float("nan")).to(t.dtype)
                    if t.is_floating_point()
                    else torch.full((3,), -1)
                )
                blob += _bytes(pad.to(t.dtype))
                pieces.append(Piece(str(files[r]), off, t.dtype, lo, hi - lo, rank=r, padding=3))
            entries.append(TensorEntry(name, tuple(t.shape), t.dtype, role, tuple(pieces)))
    for f, b in zip(files, blobs, strict=True):
        f.write_bytes(bytes(b))
    meta = CheckpointMeta(format="handmade", path=str(root), world_size=world,
                          state=TrainingState(precision=precision), tied=TIED,
                          files=tuple(map(str, files)))  # fmt: skip
    return Checkpoint(meta, entries)


def _expected(dtype: torch.dtype | None, keep: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    want = {}
    for name, t in {**MASTERS, **FROZEN, **BUFFERS}.items():
        if t.is_floating_point() and name in keep:
            want[name] = t.float()
        elif t.is_floating_point() and dtype is not None:
            want[name] = t.to(dtype)
        else:
            want[name] = t
    return want


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, t in want.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        assert torch.equal(got[k].view(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), k  # bit-exact


@pytest.mark.parametrize(
    ("dtype", "want"),
    [("auto", torch.bfloat16), ("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)],
)
def test_safetensors_multi_piece_cast_bit_exact(tmp_path: Path, dtype: str, want: torch.dtype) -> None:
    ck = make_ckpt(tmp_path / "in")
    res = zckpt.consolidate(ck, tmp_path / "m.safetensors", dtype=dtype, keep_fp32=["norm.*"], progress=False)
    got = load_file(tmp_path / "m.safetensors")
    _assert_same(got, _expected(want, keep=("norm.weight",)))
    assert res.tied == TIED and res.tensors == 6
    with safe_open(tmp_path / "m.safetensors", "pt") as f:
        md = f.metadata()
    assert json.loads(md["zckpt.tied"]) == TIED
    assert json.loads(md["zckpt.roles"]) == {"frozen.weight": "frozen", "position_ids": "buffer"}


def test_auto_without_training_precision_keeps_dtypes(tmp_path: Path) -> None:
    ck = make_ckpt(tmp_path / "in", precision=None)
    zckpt.consolidate(ck, tmp_path / "m.safetensors", progress=False)
    _assert_same(load_file(tmp_path / "m.safetensors"), _expected(None))


def test_bin_keeps_tied_names_on_one_storage(tmp_path: Path) -> None:
    ck = make_ckpt(tmp_path / "in")
    zckpt.consolidate(ck, tmp_path / "m.bin", dtype="fp32", exclude_frozen=True, progress=False)
    got = torch.load(tmp_path / "m.bin", weights_only=True)
    want = _expected(torch.float32)
    del want["frozen.weight"]
    want["head.weight"] = want["emb.weight"]
    _assert_same(got, want)
    assert got["head.weight"].untyped_storage().data_ptr() == got["emb.weight"].untyped_storage().data_ptr()


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_folder_sharded_with_index(tmp_path: Path, fmt: str) -> None:
    ck = make_ckpt(tmp_path / "in")
    out = tmp_path / "model"
    res = zckpt.consolidate(ck, out, dtype="fp32", max_shard_size="400B", format=fmt, progress=False)
    base = "model.safetensors" if fmt == "safetensors" else "pytorch_model.bin"
    idx = json.loads((out / f"{base}.index.json").read_text())
    shards = sorted(set(idx["weight_map"].values()))
    assert len(shards) > 1
    assert all((out / s).is_file() and (out / f"{s}.crc32.json").is_file() for s in shards)
    assert {p.name for p in res.files} >= set(shards)
    merged: dict[str, torch.Tensor] = {}
    for s in shards:
        merged.update(load_file(out / s) if fmt == "safetensors" else torch.load(out / s, weights_only=True))
    want = _expected(torch.float32)
    if fmt == "bin":
        want["head.weight"] = want["emb.weight"]
        assert idx["weight_map"]["head.weight"] == idx["weight_map"]["emb.weight"]
    else:
        assert "head.weight" not in idx["weight_map"] and idx["metadata"]["zckpt.tied"] == TIED
    _assert_same(merged, want)
    # and zckpt reads its own output back to the same values
    with zckpt.open(out) as back:
        _assert_same({k: back[k] for k in back}, {**want, "head.weight": want["emb.weight"]})


def test_file_out_with_shards(tmp_path: Path) -> None:
    ck = make_ckpt(tmp_path / "in")
    zckpt.consolidate(ck, tmp_path / "o" / "x.safetensors", dtype="fp32", max_shard_size=400, progress=False)
    names = sorted(p.name for p in (tmp_path / "o").iterdir())
    # 400-byte shards: [emb, norm] [fc, scale] [frozen, position_ids]
    shards = [f"x-0000{k}-of-00003.safetensors{s}" for k in (1, 2, 3) for s in ("", ".crc32.json")]
    assert names == sorted(["x.safetensors.index.json", *shards])
    merged: dict[str, torch.Tensor] = {}
    for i in (1, 2, 3):
        merged.update(load_file(tmp_path / "o" / f"x-0000{i}-of-00003.safetensors"))
    _assert_same(merged, _expected(torch.float32))


def test_chunks_are_bounded(tmp_path: Path) -> None:
    ck = make_ckpt(tmp_path / "in")
    item = outputs.WriteItem("fc.weight", ck.entry("fc.weight"), torch.bfloat16)
    chunks = list(item.chunks(max_bytes=40))
    assert all(c.numel() * 4 <= 40 for c in chunks)  # bounded by the wider (fp32) side of the cast
    assert torch.equal(torch.cat(chunks).view(11, 7), MASTERS["fc.weight"].bfloat16())


def test_hf_trainer_files_are_copied(tmp_path: Path) -> None:
    ck = make_ckpt(tmp_path / "ckpt" / "global_step3")  # a tag folder; HF files live one level up
    (tmp_path / "ckpt" / "config.json").write_text('{"model_type": "toy"}')
    (tmp_path / "ckpt" / "tokenizer.json").write_text("{}")
    (tmp_path / "ckpt" / "trainer_state.json").write_text("{}")
    (tmp_path / "ckpt" / "tokenizer.json").write_text('{"x": 1}')
    res = zckpt.consolidate(ck, tmp_path / "out", dtype="bf16", progress=False)
    assert sorted(res.copied) == ["config.json", "tokenizer.json"]
    # config.json keeps every key and names the dtype the weights were written in; the rest byte for byte
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config == {"model_type": "toy", "dtype": "bfloat16"}
    assert (tmp_path / "out" / "tokenizer.json").read_text() == '{"x": 1}'
    assert not (tmp_path / "out" / "trainer_state.json").exists()


# ---- failures leave nothing behind ---------------------------------------------------------------
def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_existing_output_refused_then_overwritten(tmp_path: Path) -> None:
    ck = make_ckpt(tmp_path / "in")
    out = tmp_path / "m.safetensors"
    out.write_bytes(b"old")
    with pytest.raises(OutputExists, match="already exists"):
        zckpt.consolidate(ck, out, progress=False)
    assert out.read_bytes() == b"old"
    zckpt.consolidate(ck, out, overwrite=True, dtype="fp32", progress=False)
    _assert_same(load_file(out), _expected(torch.float32))


def test_output_inside_input_refused(tmp_path: Path) -> None:
    ck = make_ckpt(tmp_path / "in")
    before = _listing(tmp_path)
    with pytest.raises(OutputExists, match="inside the input"):
        zckpt.consolidate(ck, tmp_path / "in" / "m.safetensors", progress=False)
    with pytest.raises(OutputExists, match="contains the input"):
        zckpt.consolidate(ck, tmp_path, overwrite=True, progress=False)
    assert _listing(tmp_path) == before


@pytest.mark.parametrize("exc", [CorruptCheckpoint("boom"), KeyboardInterrupt()])
@pytest.mark.parametrize("out_name", ["m.safetensors", "m.bin", "folder"])
def test_failure_mid_write_leaves_no_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           exc: BaseException, out_name: str) -> None:  # fmt: skip
    ck = make_ckpt(tmp_path / "in")
    calls = {"n": 0}
    real = outputs.WriteItem.chunks

    def flaky(self: outputs.WriteItem, max_bytes: int = outputs.CHUNK_BYTES) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:  # two tensors already written
            raise exc
        return real(self, max_bytes)

    real_tasks = pipeline.item_tasks

    def flaky_tasks(it: outputs.WriteItem, chunk_bytes: int = pipeline.CHUNK_BYTES) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:  # two tensors already written (safetensors goes through the pipeline)
            raise exc
        return real_tasks(it, chunk_bytes)

    real_run = fill._fill_run

    def flaky_run(r: fill.Run, dst: Any, a: int) -> None:  # a uint8 numpy array
        if r.entry is not None and a == 0:
            calls["n"] += 1
            if calls["n"] == 3:  # two tensors already filled (safetensors goes through pipeline.fill)
                raise exc
        real_run(r, dst, a)

    monkeypatch.setattr(outputs.WriteItem, "chunks", flaky)
    monkeypatch.setattr(pipeline, "item_tasks", flaky_tasks)
    monkeypatch.setattr(fill, "_fill_run", flaky_run)
    (tmp_path / "o").mkdir()
    with pytest.raises(type(exc)):
        zckpt.consolidate(ck, tmp_path / "o" / out_name, max_shard_size=200, progress=False)
    assert calls["n"] == 3
    assert os.listdir(tmp_path / "o") == []


def test_truncated_input_fails_cleanly(tmp_path: Path) -> None:
    ck = make_ckpt(tmp_path / "in")
    Path(ck.meta.files[-1]).write_bytes(b"\0" * 4)
    (tmp_path / "o").mkdir()
    with pytest.raises(CorruptCheckpoint, match="truncated"):
        zckpt.consolidate(ck, tmp_path / "o" / "m.safetensors", progress=False)
    assert os.listdir(tmp_path / "o") == []


# ---- interop ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_transformers_gpt2_from_pretrained_identical_logits(tmp_path: Path) -> None:
    import transformers

    cfg = transformers.GPT2Config(vocab_size=97, n_positions=16, n_embd=24, n_layer=2, n_head=2,
                                  tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(1)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    src = tmp_path / "src"
    src.mkdir()
    torch.save(model.state_dict(), src / "pytorch_model.bin")  # wte and lm_head share storage
    cfg.save_pretrained(src)
    res = zckpt.consolidate(src, tmp_path / "out", progress=False)
    assert res.tied == {"lm_head.weight": "transformer.wte.weight"}
    assert "config.json" in res.copied
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


# ---- real DeepSpeed fixtures -----------------------------------------------------------------------
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "ds"


@pytest.mark.parametrize("case", ds_cases())
def test_consolidate_deepspeed_fixture(tmp_path: Path, case: str) -> None:
    info = json.loads((FIXTURES / case / "case.json").read_text())
    ref = {k: v for k, v in load_file(FIXTURES / case / "ref_fp32.safetensors").items() if ":" not in k}
    train = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(info["dtype"])
    zckpt.consolidate(FIXTURES / case, tmp_path / "fp32.safetensors", dtype="fp32", progress=False)
    got = load_file(tmp_path / "fp32.safetensors")
    assert set(got) == set(ref) - set(info["tied"])
    for k, want in ref.items():
        if k in info["tied"]:
            continue
        assert torch.equal(got[k], want.float() if want.is_floating_point() else want), k
    if train is None:
        return
    zckpt.consolidate(FIXTURES / case, tmp_path / "auto.bin", progress=False)  # auto = training dtype
    got16 = torch.load(tmp_path / "auto.bin", weights_only=True)
    for k, e in ref.items():  # params in the training dtype; buffers (fp32 pos_scale) as stored
        want = e.to(train) if e.is_floating_point() and k not in info["buffers"] else e
        assert got16[k].dtype == want.dtype and torch.equal(got16[k], want), k
    fp32_buffers = [k for k, b in info["buffers"].items() if b["dtype"] == "float32" and k in ref]
    assert all(got16[k].dtype == torch.float32 for k in fp32_buffers)
    for alias, owner in info["tied"].items():
        assert got16[alias].untyped_storage().data_ptr() == got16[owner].untyped_storage().data_ptr()


@pytest.mark.parametrize("case", [c for c in ds_cases() if "fp32" not in c and not c.startswith("gpt2")])
def test_default_dtypes_match_deepspeeds_own_16bit_state(tmp_path: Path, case: str) -> None:
    """Oracle: the module state dict DeepSpeed saved beside the masters (``save_16bit_model`` writes the same
    ``module.state_dict()``): 16-bit params, fp32 ``pos_scale`` buffer, int64 ``position_ids``. The default
    consolidate has every key in DeepSpeed's dtype; where DeepSpeed stored full values (ZeRO-0/1/2, not
    ZeRO-3's empty placeholders) they are equal bit for bit."""
    states = sorted((FIXTURES / case / "global_step3").glob("*model_states.pt"))[0]
    theirs = torch.load(states, weights_only=True, map_location="cpu")["module"]
    zckpt.consolidate(FIXTURES / case, tmp_path / "auto.bin", progress=False)
    mine = torch.load(tmp_path / "auto.bin", weights_only=True)
    assert set(mine) == set(theirs)
    for k, t in theirs.items():
        assert mine[k].dtype == t.dtype, k
        if t.numel():
            assert torch.equal(mine[k], t), k
    assert theirs["pos_scale"].dtype == torch.float32 and theirs["emb.weight"].dtype != torch.float32


def test_default_matches_deepspeeds_save_16bit_model_of_a_trainer_run(tmp_path: Path) -> None:
    """Oracle: ``model.safetensors`` of an HF Trainer + DeepSpeed ZeRO-3 bf16 run, written by DeepSpeed's own
    ``save_16bit_model`` (gathered weights); the default consolidate reproduces it tensor for tensor."""
    ck = FIXTURES.parent / "trainer" / "trainer_z3off_w2" / "checkpoint-3"
    zckpt.consolidate(ck, tmp_path / "hf", progress=False)
    mine, theirs = load_file(tmp_path / "hf" / "model.safetensors"), load_file(ck / "model.safetensors")
    assert set(mine) == set(theirs)
    for k, t in theirs.items():
        assert mine[k].dtype == t.dtype and torch.equal(mine[k], t), k


def test_buffers_keep_their_dtype_unless_a_dtype_is_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(BUFFERS, "pos_scale", torch.linspace(0.5, 1.5, 5) / 3)  # an fp32 buffer of a bf16 run
    ck = make_ckpt(tmp_path / "in")
    zckpt.consolidate(ck, tmp_path / "auto.safetensors", progress=False)  # default: params bf16, buffers kept
    _assert_same(
        load_file(tmp_path / "auto.safetensors"),
        {**_expected(torch.bfloat16), "pos_scale": BUFFERS["pos_scale"]},
    )
    for i, asked in enumerate(("bf16", "BFloat16", "torch.bfloat16", torch.bfloat16)):  # asked: every float
        zckpt.consolidate(ck, tmp_path / f"{i}.safetensors", dtype=asked, progress=False)
        _assert_same(load_file(tmp_path / f"{i}.safetensors"), _expected(torch.bfloat16))
    zckpt.consolidate(ck, tmp_path / "k.safetensors", dtype="bf16", keep_fp32=["pos_*"], progress=False)
    _assert_same(load_file(tmp_path / "k.safetensors"), _expected(torch.bfloat16, keep=("pos_scale",)))


def test_file_out_checks_every_name_first(tmp_path: Path) -> None:
    ck = make_ckpt(tmp_path / "in")
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "x-00002-of-00003.safetensors").write_bytes(b"keep")
    with pytest.raises(OutputExists, match="x-00002-of-00003"):
        zckpt.consolidate(
            ck, tmp_path / "o" / "x.safetensors", dtype="fp32", max_shard_size=400, progress=False
        )
    assert os.listdir(tmp_path / "o") == ["x-00002-of-00003.safetensors"]
    (tmp_path / "o" / "m.safetensors.sha256").write_text("stale  m.safetensors\n")  # its file is gone
    zckpt.consolidate(ck, tmp_path / "o" / "m.safetensors", progress=False)
    # the old sidecar is not left beside the new file (which carries a block-digest sidecar)
    assert not (tmp_path / "o" / "m.safetensors.sha256").exists()
    assert (tmp_path / "o" / "m.safetensors.crc32.json").is_file()
