"""Writing a figure to ``.png``, ``.svg`` or ``.html`` (one self-contained page: the picture inline, the
tables after it, no script, no external resource: it opens offline).

The entry points the operations call (``plot_diff``, ``plot_inspect``, ``plot_series``) check the path and
that matplotlib is there first (``check``: one ``ZckptError`` line saying what to install), build the
figure's data (``grids``), draw it and write it beside ``path`` under a temporary name, then rename it over
``path`` (an existing plot is replaced). The diff figure is a ``Scene`` (``diff_scene``) that ``raster``
paints into a PNG and ``svg`` writes as SVG (inline SVG in its page), without importing matplotlib; the
inspect and series figures are matplotlib's (``draw_more``), saved by it, their page embedding a PNG.
"""

from __future__ import annotations

import base64
import html
import importlib
import importlib.util
import io
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zckpt.errors import ZckptError
from zckpt.ops.plots.tables import Table, diff_tables, inspect_tables, series_tables
from zckpt.storage.location import local

if TYPE_CHECKING:
    from zckpt.ops.diff import DiffResult
    from zckpt.ops.inspect import InspectReport
    from zckpt.ops.series import SeriesResult

SUFFIXES = (".png", ".svg", ".html")
INSTALL = "pip install 'zckpt[plot]'"
DPI = 100
_MODULES = ("matplotlib.figure", "matplotlib.backends.backend_agg", "matplotlib.colors")


def check(path: str | Path) -> Path:
    """``path`` as a plot output: a known suffix, an existing folder, and matplotlib importable."""
    p = local(path, "--plot", hint="write the plot to a local file")
    if p.suffix.lower() not in SUFFIXES:
        raise ZckptError(f"--plot {p}: the file name must end in {', '.join(SUFFIXES)}")
    if not p.parent.is_dir():
        raise ZckptError(f"--plot {p}: no folder {p.parent}")
    if importlib.util.find_spec("matplotlib") is None:
        raise ZckptError(f"--plot needs matplotlib, which is not installed: {INSTALL}")
    return p


def preload() -> threading.Thread:
    """Import matplotlib on a daemon thread (while a run's series of diffs works): drawing the series figure
    later does not wait for it. (The diff figure does not need matplotlib.)"""
    t = threading.Thread(target=_import_all, name="zckpt-plot-preload", daemon=True)
    t.start()
    return t


def _import_all() -> None:
    for m in _MODULES:
        importlib.import_module(m)


def plot_diff(r: DiffResult, path: str | Path, *, top: int = 20) -> Path:
    """Draw ``r`` (``zckpt.ops.plots.grids.diff_plot``) to ``path``."""
    p = check(path)
    from zckpt.ops.plots.diff_scene import diff_scene
    from zckpt.ops.plots.grids import diff_plot

    data = diff_plot(r, top)
    scene = diff_scene(data)
    suffix = p.suffix.lower()
    if suffix == ".png":
        from zckpt.ops.plots.raster import png

        return _write(p, png(scene))
    from zckpt.ops.plots.svg import svg

    if suffix == ".svg":
        return _write(p, svg(scene).encode("utf-8"))
    picture = svg(scene, standalone=False)
    return _write(p, page(data.title, (data.summary, *data.notes), picture, diff_tables(r)).encode("utf-8"))


def plot_inspect(r: InspectReport, path: str | Path) -> Path:
    p = check(path)
    from zckpt.ops.plots.draw_more import inspect_figure
    from zckpt.ops.plots.grids import inspect_plot

    data = inspect_plot(r)
    return save(inspect_figure(data), p, data.title, (), inspect_tables(r, data))


def plot_series(s: SeriesResult, path: str | Path) -> Path:
    p = check(path)
    from zckpt.ops.plots.draw_more import series_figure
    from zckpt.ops.plots.series_grid import series_plot

    data = series_plot(s)
    return save(series_figure(data), p, data.title, data.notes, series_tables(s))


def save(fig: Any, path: Path, title: str, lines: Sequence[str], tables: Sequence[Table]) -> Path:
    """Write ``fig`` to ``path`` by its suffix (``.html``: with ``lines`` and ``tables``), atomically."""
    suffix = path.suffix.lower()
    buf = io.BytesIO()
    if suffix == ".html":
        fig.savefig(buf, format="png", dpi=DPI)
        img = base64.b64encode(buf.getvalue()).decode("ascii")
        picture = f'<img alt="{html.escape(title)}" src="data:image/png;base64,{img}">'
        return _write(path, page(title, lines, picture, tables).encode("utf-8"))
    fig.savefig(buf, format=suffix[1:], dpi=DPI, metadata=_metadata(suffix))
    return _write(path, buf.getvalue())


def _write(path: Path, data: bytes) -> Path:
    """``data`` to ``path`` through a temporary name beside it."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ZckptError(f"--plot {path}: cannot write ({e.strerror or e})", path=str(path)) from None
    return path


def _metadata(suffix: str) -> dict[str, Any]:
    """No timestamps or version strings in the files: the same data gives the same bytes."""
    if suffix == ".svg":
        return {"Date": None, "Creator": None}
    return {"Software": None}


_CSS = """body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}img,svg{max-width:100%;height:auto}
table{border-collapse:collapse;font-size:12px;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:2px 6px}
th{background:#f3f3f3;position:sticky;top:0}td{font-family:ui-monospace,monospace}.n{color:#666}"""


def page(title: str, lines: Sequence[str], picture: str, tables: Sequence[Table]) -> str:
    """One self-contained HTML page: title, text lines, the picture (an ``<img>`` with a ``data:`` PNG or an
    inline ``<svg>``), then the tables."""
    e = html.escape
    parts = [
        f"<!doctype html>\n<html lang=en><head><meta charset=utf-8><title>{e(title)}</title>",
        f"<style>{_CSS}</style></head><body>\n<h1>{e(title)}</h1>",
        *(f"<p>{e(x)}</p>" for x in lines),
        picture,
    ]
    for t in tables:
        parts.append(f"<h2>{e(t.title)}</h2>")
        parts.append("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in t.headers) + "</tr>")
        parts.extend("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in t.rows)
        parts.append("</table>")
        if t.note:
            parts.append(f'<p class="n">{e(t.note)}</p>')
    parts.append("</body></html>\n")
    return "\n".join(parts)
