"""Issue 18's pictures, checked structurally (never by pixel snapshots): the figure data built from ``diff``
/ ``inspect`` results (cells, markers, bars, byte stacks), the drawn figures read back (the diff scene's
panels: tick labels, cell values, marker letters, bar widths; the inspect figure's matplotlib objects), the
diff colours against matplotlib's for the same scale, one probe of the PNG (the hot cell's pixel), the files
written (PNG, SVG, self-contained HTML with inline SVG), the name tables, the new norm statistics, and the
CLI's ``--plot`` surface."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import matplotlib  # noqa: F401  # the dev extra installs it; test_plot_cli covers its absence
import numpy as np
import pytest
import torch
from _fixtures import fixture
from _handmade import make_ckpt
from typer.testing import CliRunner

from zckpt.errors import ZckptError
from zckpt.ops.diff import diff
from zckpt.ops.inspect import inspect
from zckpt.ops.plots.grids import diff_plot, inspect_plot
from zckpt.ops.plots.names import OTHER, place

runner = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1", "ZCKPT_DEBUG": ""})
LAYERS = 4
NUDGED = "model.layers.2.mlp.up_proj.weight"
MISSING = "model.layers.1.self_attn.k_proj.weight"
RESHAPED = "model.layers.3.self_attn.o_proj.weight"
RETYPED = "model.layers.0.input_layernorm.weight"


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {"model.embed_tokens.weight": torch.randn(11, 6, generator=g)}
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[f"{p}.self_attn.{name}.weight"] = torch.randn(6, 6, generator=g)
        sd[f"{p}.mlp.up_proj.weight"] = torch.randn(9, 6, generator=g)
        sd[f"{p}.mlp.down_proj.weight"] = torch.randn(6, 9, generator=g)
        sd[f"{p}.input_layernorm.weight"] = torch.randn(6, generator=g)
    sd["model.norm.weight"] = torch.randn(6, generator=g)
    sd["lm_head.weight"] = torch.randn(11, 6, generator=g)
    return sd


def _pair(tmp_path: Path) -> tuple[object, object, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A and B: B nudges one tensor, lacks one, reshapes one, stores one in bf16 (same values)."""
    a = _model()
    a[RETYPED] = a[RETYPED].bfloat16().float()  # exactly representable in bf16
    b = dict(a)
    b[NUDGED] = a[NUDGED] + 1e-3 * torch.randn(9, 6, generator=torch.Generator().manual_seed(1))
    del b[MISSING]
    b[RESHAPED] = a[RESHAPED].reshape(3, 12)
    b[RETYPED] = a[RETYPED].bfloat16()
    return make_ckpt(tmp_path / "a", a, world=3), make_ckpt(tmp_path / "b", b, world=2), a, b


# ---- names -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("key", "layer", "column"),
    [
        ("transformer.h.7.attn.c_attn.weight", 7, "qkv"),
        ("transformer.h.7.attn.c_proj.bias", 7, "o"),
        ("transformer.h.7.mlp.c_proj.weight", 7, "down"),
        ("transformer.h.7.mlp.c_fc.weight", 7, "up"),
        ("transformer.h.7.ln_2.weight", 7, "mlp_norm"),
        ("model.layers.12.self_attn.v_proj.weight", 12, "v"),
        ("model.layers.12.mlp.gate_proj.weight", 12, "gate"),
        ("model.layers.12.post_attention_layernorm.weight", 12, "mlp_norm"),
        ("layers.3.attention.wo.weight", 3, "o"),
        ("layers.3.feed_forward.w2.weight", 3, "down"),
        ("encoder.layer.2.attention.output.dense.weight", 2, "o"),
        ("encoder.layer.2.output.dense.weight", 2, "down"),
        ("blocks.1.proj.weight", 1, "o"),
        ("blocks.1.out.weight", 1, "down"),
        ("blocks.1.qkv.weight:exp_avg", 1, "qkv"),
        ("model.layers.0.block_sparse_moe.experts.3.w1.weight", 0, "experts"),
        ("model.layers.5.something_new.weight", 5, OTHER),
        ("lm_head.weight", None, "lm_head"),
        ("transformer.wte.weight", None, "transformer.wte"),
        ("scale", None, "scale"),
    ],
)
def test_place_from_tables(key: str, layer: int | None, column: str) -> None:
    p = place(key)
    assert (p.layer, p.column) == (layer, column)


# ---- statistics the plots read -----------------------------------------------------------------------------
def test_norms_and_rel_change_match_full_tensor_oracle(tmp_path: Path) -> None:
    ca, cb, a, b = _pair(tmp_path)
    r = diff(ca, cb, progress=False)
    by = {t.key: t for t in r.tensors}
    t = by[NUDGED]
    x, y = a[NUDGED].double(), b[NUDGED].double()
    assert t.norm_a == pytest.approx(float(x.norm()), rel=1e-12)
    assert t.norm_b == pytest.approx(float(y.norm()), rel=1e-12)
    assert t.norm_diff == pytest.approx(float((x - y).norm()), rel=1e-12)
    assert t.rel_l2 == pytest.approx(float((x - y).norm() / y.norm()), rel=1e-12)  # the one relative change
    same = by["model.layers.0.self_attn.q_proj.weight"]  # bit-identical fp32: the fast path's fp32 dot
    assert same.norm_diff == 0 and same.rel_l2 == 0.0
    assert same.norm_a == pytest.approx(
        float(a["model.layers.0.self_attn.q_proj.weight"].double().norm()), 1e-6
    )
    assert by[RESHAPED].rel_l2 is None and by[RESHAPED].norm_a is None
    # bf16 vs fp32, same values: compared at bf16 by default (bit-identical there, no norm summed) ...
    assert by[RETYPED].compared_as == "bfloat16" and by[RETYPED].norm_diff == 0 and by[RETYPED].norm_a is None
    full = {t.key: t for t in diff(ca, cb, progress=False, compare_dtype="full").tensors}[RETYPED]
    assert full.norm_diff == 0  # ... and as stored, in float64, with the norms summed
    assert full.norm_a == pytest.approx(float(a[RETYPED].double().norm()), rel=1e-12)


def test_bit_identical_bf16_has_no_norm(tmp_path: Path) -> None:
    sd = {"w": torch.randn(40).bfloat16()}
    r = diff(make_ckpt(tmp_path / "a", sd), make_ckpt(tmp_path / "b", sd), progress=False)
    (t,) = r.tensors
    assert (t.norm_a, t.norm_diff, t.rel_l2) == (None, 0.0, 0.0)


# ---- diff figure data --------------------------------------------------------------------------------------
def test_diff_grid_one_hot_cell_and_markers(tmp_path: Path) -> None:
    ca, cb, a, b = _pair(tmp_path)
    d = diff_plot(diff(ca, cb, progress=False))
    h = d.layers
    assert h.rows == ("0", "1", "2", "3")
    assert h.cols == ("q", "k", "v", "o", "attn_norm", "up", "down")
    hot = [(r, c) for r in h.rows for c in h.cols if (h.cell(r, c) and (h.cell(r, c).rel or 0) > 0)]
    assert hot == [("2", "up")]
    x, y = a[NUDGED].double(), b[NUDGED].double()
    cell = h.cell("2", "up")
    assert cell.keys == (NUDGED,)
    assert cell.rel == pytest.approx(float((x - y).norm() / y.norm()), rel=1e-12)
    xf, yf = x.flatten(), y.flatten()
    assert cell.cosine == pytest.approx(float(xf @ yf / xf.norm() / yf.norm()), rel=1e-12)
    assert (h.cell("1", "k").marks, h.cell("1", "k").rel) == ("A", None)
    assert (h.cell("3", "o").marks, h.cell("3", "o").rel) == ("S", None)
    assert (h.cell("0", "attn_norm").marks, h.cell("0", "attn_norm").rel) == ("D", 0.0)
    assert d.strip.rows == ("non-layer",)
    assert d.strip.cols == ("lm_head", "model.embed_tokens", "model.norm")
    assert all(c is not None and c.rel == 0.0 for c in d.strip.cells[0])
    assert [bar.key for bar in d.top] == [NUDGED]


def test_cells_pool_weight_and_bias(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    a = {
        "h.0.mlp.c_fc.weight": torch.randn(8, 4, generator=g),
        "h.0.mlp.c_fc.bias": torch.randn(8, generator=g),
    }
    b = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in a.items()}
    d = diff_plot(diff(make_ckpt(tmp_path / "a", a), make_ckpt(tmp_path / "b", b), progress=False))
    cell = d.layers.cell("0", "up")
    xa = torch.cat([a[k].double().flatten() for k in a])
    xb = torch.cat([b[k].double().flatten() for k in a])
    assert set(cell.keys) == set(a)
    assert cell.rel == pytest.approx(float((xa - xb).norm() / xb.norm()), rel=1e-12)
    assert cell.cosine == pytest.approx(float(xa @ xb / xa.norm() / xb.norm()), rel=1e-12)


# ---- the drawn figure, read back ---------------------------------------------------------------------------
def _axes(fig: object) -> dict[str, object]:
    return {ax.get_label(): ax for ax in fig.axes}  # type: ignore[attr-defined]


def _labels(ticks: list[object]) -> list[str]:
    return [t.get_text() for t in ticks]  # type: ignore[attr-defined]


def test_diff_figure_reads_back_from_the_grid(tmp_path: Path) -> None:
    from zckpt.ops.plots.diff_scene import diff_scene

    ca, cb, _, _ = _pair(tmp_path)
    d = diff_plot(diff(ca, cb, progress=False))
    ax = diff_scene(d).panels
    rel = ax["rel"]
    assert list(rel.xticks) == list(d.layers.cols)
    assert list(rel.yticks) == list(d.layers.rows)
    arr = rel.values
    assert arr is not None and rel.vmin is not None
    i, j = d.layers.rows.index("2"), d.layers.cols.index("up")
    assert arr[i, j] == pytest.approx(d.layers.cell("2", "up").rel)
    others = [arr[r, c] for r in range(arr.shape[0]) for c in range(arr.shape[1]) if (r, c) != (i, j)]
    assert all(np.isnan(v) or v < rel.vmin for v in others)  # white (unchanged) or grey (no value)
    assert np.isnan(arr[d.layers.rows.index("1"), d.layers.cols.index("k")])
    assert rel.marks[(d.layers.cols.index("k"), d.layers.rows.index("1"))] == "A"
    assert rel.marks[(d.layers.cols.index("o"), d.layers.rows.index("3"))] == "S"
    assert list(ax["strip_rel"].xticks) == list(d.strip.cols)
    assert list(ax["top"].yticks) == [NUDGED]
    (width,) = ax["top"].values  # type: ignore[misc]
    assert width == pytest.approx(d.top[0].rel)
    assert {"cos", "strip_cos", "colorbar_rel", "colorbar_cos"} <= set(ax)


def test_colours_are_matplotlibs() -> None:
    """The diff figure's colours (no matplotlib) equal matplotlib's for the same log scale: the colour map's
    colour inside, white for 0 (unchanged), black for inf, grey for no value."""
    from matplotlib.colors import LogNorm

    from zckpt.ops.plots.colours import colours, log_range
    from zckpt.ops.plots.draw import NO_VALUE, drawable

    g = np.random.default_rng(0)
    grid = (10.0 ** g.uniform(-9, 1, (7, 9))).tolist()
    grid[0][:3] = [0.0, math.inf, math.nan]
    lo, hi = log_range([grid])
    for name in ("viridis", "plasma"):
        cm = matplotlib.colormaps[name].with_extremes(bad=NO_VALUE, under="#ffffff", over="#000000")
        norm = LogNorm(lo, hi)
        want = np.round(np.asarray(cm(norm(drawable(grid, norm))))[..., :3] * 255).astype(np.uint8)
        assert (colours(np.array(grid), lo, hi, name) == want).all()


def test_png_cells_are_the_scene_colours(tmp_path: Path) -> None:
    """The PNG's pixel at the nudged cell's centre is that cell's colour (the top of the scale)."""
    from PIL import Image

    from zckpt.ops.plots.colours import lut

    ca, cb, _, _ = _pair(tmp_path)
    r = diff(ca, cb, progress=False)
    d = diff_plot(r)
    png = Image.open(r.plot(tmp_path / "d.png")).convert("RGB")
    from zckpt.ops.plots.diff_scene import diff_scene

    x, y, w, h = diff_scene(d).panels["rel"].box
    i, j = d.layers.rows.index("2"), d.layers.cols.index("up")
    at = (round(x + (j + 0.5) * w / len(d.layers.cols)), round(y + (i + 0.5) * h / len(d.layers.rows)))
    assert png.getpixel(at) == tuple(int(c) for c in lut("viridis")[255])


def test_files_png_svg_and_self_contained_html(tmp_path: Path) -> None:
    ca, cb, _, _ = _pair(tmp_path)
    r = diff(ca, cb, progress=False)
    png = r.plot(tmp_path / "d.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size < 200_000
    svg = r.plot(tmp_path / "d.svg").read_text()
    assert svg.startswith("<?xml") and "<svg" in svg
    page = r.plot(tmp_path / "d.html").read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", page)  # nothing fetched: opens offline
    assert "<script" not in page
    picture = page[page.index("<svg") : page.index("</svg>")]
    assert f"<title>1 / k: ||A-B||/||B|| -\nonly in A\n{MISSING}</title>" in picture  # the cell's tooltip
    assert NUDGED in page and MISSING in page  # the tensor table and the only-in-A table
    assert not list(tmp_path.glob(".*tmp*"))
    import xml.dom.minidom

    xml.dom.minidom.parseString(svg)  # well-formed


def test_plot_refuses_bad_suffix_and_missing_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca, cb, _, _ = _pair(tmp_path)
    r = diff(ca, cb, progress=False)
    with pytest.raises(ZckptError, match=r"\.png, \.svg, \.html"):
        r.plot(tmp_path / "d.jpg")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ZckptError, match=re.escape("pip install 'zckpt[plot]'")):
        r.plot(tmp_path / "d.png")


# ---- inspect -----------------------------------------------------------------------------------------------
def test_inspect_bytes_by_rank_and_kind(tmp_path: Path) -> None:
    sd = _model()
    optim = {f"{k}:exp_avg": torch.zeros_like(v) for k, v in sd.items() if "layers.0" in k}
    world, pad = 3, 3
    r = inspect(make_ckpt(tmp_path / "c", sd, world=world, pad=pad, optim=optim))
    d = inspect_plot(r)
    assert d.ranks == ("0", "1", "2") and d.kinds == ("param", "exp_avg")
    want = {k: [0] * world for k in d.kinds}
    for kind, tensors in (("param", sd.values()), ("exp_avg", optim.values())):
        for t in tensors:
            c = -(-t.numel() // world)
            for rank in range(world):
                valid = max(0, min(c, t.numel() - rank * c))
                want[kind][rank] += (valid + pad) * 4 if valid else 0
    assert {k: list(v) for k, v in zip(d.kinds, d.nbytes, strict=True)} == want
    per_layer = sum(v.numel() for k, v in sd.items() if k.startswith("model.layers.0."))
    assert d.groups[:LAYERS] == ("0", "1", "2", "3") and d.params[:LAYERS] == (per_layer,) * LAYERS
    assert set(d.groups[LAYERS:]) == {"model.embed_tokens", "lm_head", "model.norm"}

    from zckpt.ops.plots.draw_more import inspect_figure

    ax = _axes(inspect_figure(d))
    stacks = ax["bytes"].containers
    assert [c.get_label() for c in stacks] == ["params (masters)", "exp_avg"]
    heights = np.array([[p.get_height() for p in c.patches] for c in stacks]).sum(axis=0)
    assert heights / heights.max() == pytest.approx(
        np.array(d.nbytes).sum(axis=0) / np.array(d.nbytes).sum(0).max()
    )
    assert _labels(ax["params"].get_xticklabels()) == list(d.groups)


def test_deepspeed_fixture_plots(tmp_path: Path) -> None:
    """A real DeepSpeed ZeRO-3 checkpoint (HF GPT-2): the layer grid, the strip, ranks, and the files."""
    case = fixture("ds", "gpt2_s3_bf16_w2")
    r = diff(case, case / "ref_zero_to_fp32" / "pytorch_model.bin", progress=False)
    d = diff_plot(r)
    assert d.layers.rows == ("0", "1")
    assert d.layers.cols == ("qkv", "o", "attn_norm", "up", "down", "mlp_norm")
    assert set(d.strip.cols) == {"transformer.wte", "transformer.wpe", "transformer.ln_f"}
    assert r.equal and not d.top
    r.plot(tmp_path / "ds.png")
    rep = inspect(case)
    data = inspect_plot(rep)
    assert data.ranks == ("0", "1") and data.kinds[:1] == ("param",)
    assert {"exp_avg", "exp_avg_sq"} <= set(data.kinds)
    rep.plot(tmp_path / "dsi.html")
    assert math.isclose(sum(map(sum, data.nbytes)), sum(rb.nbytes for rb in rep.rank_bytes))
