"""``zckpt diff --series``: tag discovery and numeric order, one pair open at a time, per-layer update sizes
equal to a full-tensor oracle, the layer x step figure read back, and the CLI."""

from __future__ import annotations

from pathlib import Path

import matplotlib  # noqa: F401  # the dev extra installs it
import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

import zckpt.ops.series as series_mod
from zckpt.cli.app import app
from zckpt.errors import ZckptError
from zckpt.ops.plots.series_grid import series_plot
from zckpt.ops.series import diff_series, run_tags, step_of

runner = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1", "ZCKPT_DEBUG": ""})
STEPS = (2, 10, 30, 100)  # "step-10" sorts before "step-2" by name: the order must be numeric
NAMES = ("mlp.up_proj.weight", "self_attn.q_proj.weight")


def _run(tmp_path: Path) -> tuple[Path, list[dict[str, torch.Tensor]]]:
    """step-N folders (HF safetensors); between consecutive steps only layer ``j % 3`` moves (j = pair index),
    plus noise folders a series must skip."""
    g = torch.Generator().manual_seed(0)
    sd = {f"layers.{i}.{n}": torch.randn(8, 5, generator=g) for i in range(3) for n in NAMES}
    sd["embed.weight"] = torch.randn(7, 5, generator=g)
    sd["position_ids"] = torch.arange(5)
    run = tmp_path / "run"
    states = []
    for j, step in enumerate(STEPS):
        if j:
            sd = dict(sd)
            for n in NAMES:
                k = f"layers.{(j - 1) % 3}.{n}"
                sd[k] = sd[k] + 0.01 * (j + 1) * torch.randn(8, 5, generator=g)
        (run / f"step-{step}").mkdir(parents=True)
        save_file(sd, run / f"step-{step}" / "model.safetensors", metadata={"format": "pt"})
        states.append(sd)
    (run / "logs").mkdir()
    (run / "notes-7").mkdir()  # a step in its name but no checkpoint inside
    (run / "latest").write_text("step-100")
    return run, states


def test_step_patterns() -> None:
    names = ("global_step40", "checkpoint-500", "step-7", "step_8", "iter_0000100", "x9", "x")
    assert [step_of(n) for n in names] == [40, 500, 7, 8, 100, 9, None]


def test_tags_are_the_checkpoints_in_numeric_order(tmp_path: Path) -> None:
    run, _ = _run(tmp_path)
    assert [t.name for t in run_tags(run)] == [f"step-{s}" for s in STEPS]
    with pytest.raises(ZckptError, match="2 or more checkpoints"):
        run_tags(run / "step-2")


def test_layer_updates_match_oracle_one_pair_open_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run, states = _run(tmp_path)
    real_open, live, peak = series_mod.open_checkpoint, [0], [0]

    def counting_open(*args: object, **kw: object) -> object:
        c = real_open(*args, **kw)  # type: ignore[arg-type]
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        close = c.close

        def closed() -> None:
            live[0] -= 1
            close()

        c.close = closed  # type: ignore[method-assign]
        return c

    monkeypatch.setattr(series_mod, "open_checkpoint", counting_open)
    s = diff_series(run, progress=False)
    assert (peak[0], live[0]) == (2, 0)
    assert [p.b.step for p in s.pairs] == list(STEPS[1:])
    d = series_plot(s)
    assert d.rows == ("0", "1", "2", "embed", "position_ids (buffer)") and d.layer_rows == 3
    for j, (a, b) in enumerate(zip(states, states[1:], strict=False)):
        moved = j % 3
        for i in range(3):
            keys = [f"layers.{i}.{n}" for n in NAMES]
            xa = torch.cat([a[k].double().flatten() for k in keys])
            xb = torch.cat([b[k].double().flatten() for k in keys])
            want = float((xa - xb).norm() / xb.norm())  # B the reference, as diff's rel_l2
            assert d.values[i][j] == pytest.approx(want, rel=1e-12)
            assert (want > 0) == (i == moved)
        assert d.values[3][j] == 0.0
        weights = [k for k in a if k != "position_ids"]
        num = sum(float((b[k].double() - a[k].double()).norm() ** 2) for k in weights)
        den = sum(float(b[k].double().norm() ** 2) for k in weights)
        # unchanged tensors' norms come from diff's bit-identical fast path (float32 dot): 1e-6, not 1e-12
        assert d.totals[j] == pytest.approx((num / den) ** 0.5, rel=1e-6)


def test_series_figure_reads_back(tmp_path: Path) -> None:
    from zckpt.ops.plots.draw_more import series_figure

    run, _ = _run(tmp_path)
    d = series_plot(diff_series(run, progress=False))
    axes = {ax.get_label(): ax for ax in series_figure(d).axes}
    ax = axes["series"]
    assert [t.get_text() for t in ax.get_xticklabels()] == [str(s) for s in STEPS[1:]]
    assert [t.get_text() for t in ax.get_yticklabels()] == list(d.rows)
    arr = ax.images[0].get_array()
    assert arr.shape == (len(d.rows), len(STEPS) - 1)
    assert arr[1, 1] == pytest.approx(d.values[1][1])
    line = axes["total"].lines[0]
    assert list(line.get_ydata()) == pytest.approx(list(d.totals))


def test_cli_series(tmp_path: Path) -> None:
    run, _ = _run(tmp_path)
    out = tmp_path / "s.html"
    res = runner.invoke(app, ["diff", "--series", str(run), "--plot", str(out), "--no-progress"])
    assert res.exit_code == 0, res.output
    assert "step-2 -> step-10" in res.stdout and f"plot: {out}" in res.stdout
    assert "data:image/png;base64," in out.read_text()
    res = runner.invoke(app, ["diff", "--series", str(run), "--json"])
    assert res.exit_code == 0 and '"step_b": 100' in res.stdout
    res = runner.invoke(app, ["diff", str(run / "step-2"), "--series", str(run)])
    assert res.exit_code == 2 and "give no A B" in res.stderr


def test_real_deepspeed_tag_folders(tmp_path: Path) -> None:
    """Real DeepSpeed ZeRO-3 tag folders (the GPT-2 fixture's, copied under two step names): found by the
    DeepSpeed format's own detection, one pair, nothing moved."""
    import shutil

    from _fixtures import fixture

    src = fixture("ds", "gpt2_s3_bf16_w2", "global_step3")
    for step in (3, 12):
        shutil.copytree(src, tmp_path / "run" / f"global_step{step}")
    s = diff_series(tmp_path / "run", progress=False)
    (p,) = s.pairs
    assert (p.a.name, p.b.name, p.total, p.differing) == ("global_step3", "global_step12", 0.0, 0)
    d = series_plot(s)
    assert d.rows[: d.layer_rows] == ("0", "1") and all(v == 0.0 for row in d.values for v in row)


def test_one_relative_change_in_table_plot_and_series(tmp_path: Path) -> None:
    """Issue 40.5: the table's ``rel_l2``, the diff figure's cell and bar, and ``--series`` (rows, total,
    JSON) show one figure, ``||A-B|| / ||B||``. B = 2A makes the two conventions disagree (0.5 and 1.0)."""
    from zckpt.ops.diff import diff
    from zckpt.ops.plots.grids import diff_plot

    g = torch.Generator().manual_seed(4)
    a = {"layers.0.mlp.up_proj.weight": torch.randn(6, 4, generator=g)}
    b = {k: 2 * v for k, v in a.items()}
    run = tmp_path / "run"
    for step, sd in ((1, a), (2, b)):
        (run / f"step-{step}").mkdir(parents=True)
        save_file(sd, run / f"step-{step}" / "model.safetensors", metadata={"format": "pt"})
    x, y = (next(iter(sd.values())).double() for sd in (a, b))
    want = float((x - y).norm() / y.norm())
    assert want == pytest.approx(0.5, rel=1e-12)  # the oracle, from torch alone
    r = diff(run / "step-1" / "model.safetensors", run / "step-2" / "model.safetensors", progress=False)
    (t,) = r.tensors
    assert t.rel_l2 == pytest.approx(want, rel=1e-12)
    assert r.to_json()["tensors"][0]["rel_l2"] == pytest.approx(want, rel=1e-12)
    d = diff_plot(r)
    assert d.layers.cell("0", "up").rel == pytest.approx(want, rel=1e-12)
    assert [bar.rel for bar in d.top] == [pytest.approx(want, rel=1e-12)]
    s = diff_series(run, progress=False)
    (p,) = s.pairs
    assert p.total == pytest.approx(want, rel=1e-12)
    assert series_plot(s).values[0][0] == pytest.approx(want, rel=1e-12)
    js = s.to_json()["pairs"][0]
    assert js["rel_change"] == pytest.approx(want, rel=1e-12)
    assert js["rows"][0]["rel_change"] == pytest.approx(want, rel=1e-12)
    assert "||A-B||/||B|| 0.5," in s.to_text()
