"""The diff figure's labels, read back from its scene with the painted text boxes (``fonts.text_corners``:
the glyph boxes ``raster`` paints, turned with their text): every text inside the figure, no two texts
overlapping, each colour bar labelled at both ends (at least two distinct labels, whatever the range: one
value, a range a millionth wide, twenty decades, nothing changed, infinite), the bars' axis labels and the
numbers after each bar inside the bars panel. Cases from real fixtures (issue 25's two figures: a checkpoint
against its bf16 consolidation, and a pair whose changes span nine decades) and hand-made extremes."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib  # noqa: F401  # the font is matplotlib's DejaVu Sans (the dev extra installs it)
import pytest
import torch
from _fixtures import fixture
from safetensors.torch import load_file, save_file

import zckpt
from zckpt.ops.diff import diff
from zckpt.ops.plots.diff_scene import bar_note, diff_scene  # noqa: E402
from zckpt.ops.plots.fonts import text_corners, text_width  # noqa: E402
from zckpt.ops.plots.grids import diff_plot
from zckpt.ops.plots.scene import Scene, Text, end_labels, fitting_log_ticks, tick_label

Quad = tuple[tuple[float, float], ...]
GPT2 = fixture("ds", "gpt2_s3_bf16_w2")
TOY = fixture("ds", "s1_bf16_w2")


def _overlap(p: Quad, q: Quad) -> bool:
    """Two convex quadrilaterals share area (separating axis test; touching edges do not count)."""
    for poly in (p, q):
        for (x1, y1), (x2, y2) in zip(poly, poly[1:] + poly[:1], strict=True):
            nx, ny = y2 - y1, x1 - x2
            a = [nx * x + ny * y for x, y in p]
            b = [nx * x + ny * y for x, y in q]
            if max(a) <= min(b) + 1e-6 or max(b) <= min(a) + 1e-6:
                return False
    return True


def _near(texts: list[tuple[Text, Quad]]) -> list[tuple[tuple[Text, Quad], tuple[Text, Quad]]]:
    """The pairs whose axis-aligned boxes overlap (sweep over x): the only ones the exact test needs."""
    boxes = sorted(
        (min(p[0] for p in q), max(p[0] for p in q), min(p[1] for p in q), max(p[1] for p in q), i)
        for i, (_, q) in enumerate(texts)
    )
    out = []
    for k, (_, x1, y0, y1, i) in enumerate(boxes):
        for bx0, _, by0, by1, j in boxes[k + 1 :]:
            if bx0 >= x1:
                break
            if by0 < y1 and y0 < by1:
                out.append((texts[i], texts[j]))
    return out


def _texts(s: Scene) -> list[tuple[Text, Quad]]:
    return [(t, text_corners(t)) for t in s.items if isinstance(t, Text) and t.text.strip()]


def _check(s: Scene, top_notes: list[str]) -> None:
    texts = _texts(s)
    for t, q in texts:
        xs, ys = [p[0] for p in q], [p[1] for p in q]
        assert min(xs) >= 0 and max(xs) <= s.width and min(ys) >= 0 and max(ys) <= s.height, t
    clashes = [(a.text, b.text) for (a, p), (b, q) in _near(texts) if _overlap(p, q)]
    assert not clashes, clashes
    for name in ("colorbar_rel", "colorbar_cos"):
        if name in s.panels:
            bar = s.panels[name]
            assert len(bar.yticks) >= 2 and len(set(bar.yticks)) == len(bar.yticks), (name, bar.yticks)
            assert bar.vmin is not None and bar.vmax is not None
            lo, hi = (
                float(bar.yticks[0]),
                float(bar.yticks[-1]),
            )  # the ends, with the digits that tell them apart
            assert lo == pytest.approx(bar.vmin, rel=0.05) and hi == pytest.approx(bar.vmax, rel=0.05)
    top = s.panels["top"]
    x, _, w, _ = top.box
    labels = {t.text: q for t, q in texts}
    for note in top_notes:  # the numbers after each bar end inside the panel
        assert max(p[0] for p in labels[note]) <= x + w, note
    for lab in top.xticks:  # the axis labels lie under the panel
        assert min(p[0] for p in labels[lab]) >= x and max(p[0] for p in labels[lab]) <= x + w, lab
    assert len(top.xticks) >= (1 if top_notes else 0)


def _figure(a: Path | str, b: Path | str) -> tuple[Scene, list[str]]:
    """The figure of ``diff(a, b)`` with every tensor compared as stored (the layout is the subject here,
    not the comparison dtype: a 16-bit side's rounding shows)."""
    d = diff_plot(diff(a, b, progress=False, compare_dtype="full"))
    return diff_scene(d), [bar_note(bar) for bar in d.top]


def test_checkpoint_against_its_bf16_consolidation(tmp_path: Path) -> None:
    """Issue 25's first figure: the left colour bar had no label, the middle one a single "1e-06"."""
    out = tmp_path / "bf16.safetensors"
    zckpt.consolidate(TOY, out, dtype="bf16", progress=False)
    s, notes = _figure(TOY, out)
    _check(s, notes)
    assert len(notes) >= 5


def _wide(tmp_path: Path) -> Path:
    """DeepSpeed's fp32 weights of the GPT-2 fixture, each tensor nudged by a relative amount from 1e-8 to
    10 (nine decades), one negated (cosine -1), one stored in float64 (same values)."""
    ref = load_file(GPT2 / "ref_fp32.safetensors")
    keys = sorted(ref)
    g = torch.Generator().manual_seed(0)
    b = {}
    for i, k in enumerate(keys):
        eps = 10.0 ** (-8 + 9 * i / (len(keys) - 1))
        b[k] = ref[k] + eps * ref[k].abs().mean() * torch.randn(ref[k].shape, generator=g)
    b[keys[3]] = -ref[keys[3]]
    b[keys[5]] = ref[keys[5]].double()
    save_file(b, str(tmp_path / "wide.safetensors"))
    return tmp_path / "wide.safetensors"


def test_changes_over_nine_decades(tmp_path: Path) -> None:
    """Issue 25's second figure: the top-tensors axis labels overlapped into a smear and the cosine labels
    ran past the panel."""
    s, notes = _figure(GPT2, _wide(tmp_path))
    _check(s, notes)
    assert len(notes) == 20 and any("cos -1" in n for n in notes)
    assert len(s.panels["top"].xticks) >= 3  # thinned, not emptied


def _pair(tmp_path: Path, rels: dict[str, float], zero_b: str = "") -> tuple[Path, Path]:
    """A: the GPT-2 fixture's fp32 weights; B: the same in float64 with every tensor of module ``m``
    divided by ``1 + rels[m]`` (so its cell's and its bars' change ``||A-B||/||B||`` is exactly ``rels[m]``);
    ``zero_b``: a tensor that is all zeros in B (an infinite change)."""
    ref = load_file(GPT2 / "ref_fp32.safetensors")
    a = dict(ref)
    b = {k: v.double() for k, v in ref.items()}
    for m, r in rels.items():
        for k in ref:
            if k.startswith(m + "."):
                b[k] = ref[k].double() / (1 + r)
    if zero_b:
        b[zero_b] = torch.zeros_like(b[zero_b])
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(b, str(tmp_path / "b.safetensors"))
    return tmp_path / "a.safetensors", tmp_path / "b.safetensors"


QKV0, QKV1, UP0 = "transformer.h.0.attn.c_attn", "transformer.h.1.attn.c_attn", "transformer.h.0.mlp.c_fc"


@pytest.mark.parametrize(
    "rels",
    [
        {QKV0: 1e-3},  # one value: the scale is hi/10 .. hi
        {QKV0: 1e-6, QKV1: 1.0004e-6, UP0: 1.0002e-6},  # a range a few ten-thousandths wide
        {QKV0: 1e-15, QKV1: 1.0, UP0: 1e3},  # eighteen decades
        {},  # nothing changed: all white
    ],
    ids=["one-value", "tiny-range", "huge-range", "unchanged"],
)
def test_colour_bars_and_axes_over_any_range(tmp_path: Path, rels: dict[str, float]) -> None:
    a, b = _pair(tmp_path, rels)
    s, notes = _figure(a, b)
    _check(s, notes)
    bar = s.panels["colorbar_rel"]
    if rels:
        assert bar.vmax == pytest.approx(max(rels.values()), rel=1e-9)
        assert bar.vmin == pytest.approx(min(rels.values()) if len(rels) > 1 else bar.vmax / 10, rel=1e-9)


def test_infinite_change_is_labelled_inside(tmp_path: Path) -> None:
    a, b = _pair(tmp_path, {QKV0: 1e-4, UP0: 0.5}, zero_b="transformer.wte.weight")
    s, notes = _figure(a, b)
    _check(s, notes)
    assert notes[0].startswith("inf")


def test_equal_checkpoints_layout() -> None:
    """A real DeepSpeed checkpoint against DeepSpeed's own zero_to_fp32 output: equal, no bars."""
    s, notes = _figure(GPT2, GPT2 / "ref_zero_to_fp32" / "pytorch_model.bin")
    assert not notes
    _check(s, notes)


def test_tick_arithmetic() -> None:
    """The label helpers on hand-picked numbers."""
    assert (
        tick_label(1e-6) == "1e-06" and tick_label(1.3e-6, 2) == "1.3e-06" and tick_label(1e-6, 3) == "1e-06"
    )
    assert end_labels(1.07e-3, 2.13e-3) == ("1.1e-03", "2.1e-03")
    assert end_labels(1.0e-6, 1.001e-6) == ("1e-06", "1.001e-06")  # as many digits as it takes

    def ext(v: float, lab: str) -> tuple[float, float]:  # a 300-px axis, labels 30 px wide
        c = 300 * (math.log10(v) + 9) / 10
        return c - 15, c + 15

    assert fitting_log_ticks(1e-9, 10.0, ext, 3) == [10.0**k for k in range(-9, 2, 2)]  # every 2nd decade
    assert fitting_log_ticks(1e-9, 10.0, lambda v, _: (v, v), 0) == [
        m * 10.0**k for k in range(-9, 2) for m in (1.0, 2.0, 5.0) if m * 10.0**k <= 10.0
    ]  # labels of no width: all of 1, 2, 5
    assert text_width("8.88e-88", 10) > text_width("1e-3", 10) > 0


def test_many_layers_and_long_names(tmp_path: Path) -> None:
    """Hand-made: 64 layers of 11 roles (one unknown, long-named: the ``other`` column), 20 long-named
    non-layer modules, changes from 1e-11 to 1: every label placed, none overlapping, all inside."""
    g = torch.Generator().manual_seed(0)
    roles = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm",
             "block_sparse_moe.experts.0.w1", "something_unusual_with_a_long_name")  # fmt: skip
    a = {f"model.layers.{i}.{r}.weight": torch.randn(4, generator=g) for i in range(64) for r in roles}
    a |= {
        f"model.extra_module_with_a_rather_long_name_{m}.weight": torch.randn(3, generator=g)
        for m in range(20)
    }
    b = {k: v.double() * (1 + 10.0 ** -(i % 12)) for i, (k, v) in enumerate(a.items())}
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(b, str(tmp_path / "b.safetensors"))
    s, notes = _figure(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert len(s.panels["rel"].yticks) == 64 and len(s.panels["strip_rel"].xticks) == 20
    _check(s, notes)


def test_the_overlap_check_itself() -> None:
    """The checker finds a clash when there is one: two labels on one spot, a label over its neighbour;
    turned labels side by side (the heat maps' 45-degree role names) do not clash."""

    def clashes(*ts: Text) -> int:
        texts = _texts(Scene(1000, 1000, items=list(ts)))
        return sum(_overlap(p, q) for (_, p), (_, q) in _near(texts))

    assert clashes(Text(100, 100, "1e-03"), Text(100, 100, "2e-03")) == 1
    assert clashes(Text(100, 100, "1e-03"), Text(100 + text_width("1e-03", 11) - 2, 100, "2e-03")) == 1
    assert clashes(Text(100, 100, "1e-03"), Text(100 + text_width("1e-03", 11) + 2, 100, "2e-03")) == 0
    side = [Text(100 + 36 * i, 100, "attn_norm", ha="right", va="top", rotate=45) for i in range(3)]
    assert clashes(*side) == 0
    assert clashes(*side, Text(100, 100, "attn_norm", ha="right", va="top", rotate=45)) >= 1
