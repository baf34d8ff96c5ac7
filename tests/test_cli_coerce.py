"""``zckpt.cli._coerce`` converts command-line values exactly as typer's own pydantic adapters do.

Oracle: typer's converter for the same parameter (``typer._coercion.build_runtime_param``), on every
parameter of every command (and the app's own options, and ``--help``), for values argv can hold and a few
it cannot (those must go to typer's converter): the same result and type, or the same error and message.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import typer.main
from typer._coercion import build_runtime_param

from zckpt.cli import _coerce
from zckpt.cli.app import app

VALUES: list[Any] = [
    None, "", "a", "-", "~/x", "s3://b/k", "a\udcff", "\x00", "a\x00b", "é", "--x", b"ab", ["a", "b"], ("a",),
    [], (), ["a", 1], [b"a"], True, False, 0, 1.5, Path("p"), -1, 3, 4, 0.0, -0.5, 2.0, 1e308, float("nan"),
    float("inf"), "1", "1.5", "-1", "zero",
]  # fmt: skip


def _params() -> list[tuple[str, Any, Any]]:
    group = typer.main.get_command(app)
    ctx = group.make_context("zckpt", ["inspect"])
    out = [("zckpt", p, ctx) for p in [*group.params, group.get_help_option(ctx)]]
    for name, cmd in group.commands.items():  # type: ignore[attr-defined]
        sub = cmd.make_context(name, [], parent=ctx, resilient_parsing=True)
        out += [(name, p, sub) for p in cmd.get_params(sub)]
    return out


def _outcome(conv: Any, value: Any, param: Any, ctx: Any) -> tuple[str, str, Any]:
    try:
        got = conv.coerce(value, param=param, ctx=ctx)
    except Exception as e:  # noqa: BLE001 - the error is the outcome compared
        return ("error", type(e).__name__, str(e))
    return ("value", type(got).__name__, got)


def test_plain_converts_as_typer_does(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x")
    values = [*VALUES, str(tmp_path / "f"), str(tmp_path), str(tmp_path / "missing")]
    seen = set()
    for name, param, ctx in _params():
        mine = param._runtime_param
        if not isinstance(mine, _coerce.Plain):
            continue
        seen.add((mine.kind, name))
        theirs = build_runtime_param(param.type_descriptor)
        extra: list[Any] = []
        if mine.kind == "choice":  # its members, their words in other cases, and a near miss
            members = list(param.type_descriptor.annotation)
            extra = [*members, *(m.value for m in members), *(m.value.upper() for m in members), "safetensor"]
        for v in [*values, *extra]:
            assert _outcome(mine, v, param, ctx) == _outcome(theirs, v, param, ctx), (name, param.name, v)
    kinds = {k for k, _ in seen}
    assert kinds == {"str", "path", "list", "bool", "number", "choice"}, seen
    assert {n for _, n in seen} == {"zckpt", *typer.main.get_command(app).commands}, seen  # type: ignore[attr-defined]


def test_every_parameter_is_plain() -> None:
    """No parameter of today's commands needs typer's pydantic adapter for what argv holds (the ``Enum``
    options included: ``consolidate --format``, ``reshard --to``)."""
    names = {(n, p.name) for n, p, _ in _params() if not isinstance(p._runtime_param, _coerce.Plain)}
    assert names == set(), names


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "a\x00b"], ["verify", "x", "--tag"], ["inspect", "--help"], ["verify", "--nope", "x"],
        ["consolidate", "x", "y", "--workers", "zero"], ["inspect", "--plot", "a\x00.png", "x"],
        ["--version"], ["diff", "a", "b", "--top", "-1"], ["diff", "a", "b", "--atol", "nan"],
        ["reshard", "x", "y", "--world", "2", "--stage", "4"], ["consolidate", "x", "y", "--format", "nope"],
        ["reshard", "x", "y", "--to", "DCP", "--world", "0"],
    ],
)  # fmt: skip
def test_cli_same_with_and_without_plain(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the whole command line (typer's test runner, which can pass a NUL): the same output and exit
    status as with typer's converters alone."""
    from typer.testing import CliRunner

    mine = CliRunner().invoke(app, argv)
    monkeypatch.setattr(_coerce, "install", lambda params: None)
    monkeypatch.setattr(_coerce, "install_one", lambda param: param)
    theirs = CliRunner().invoke(app, argv)
    assert (mine.exit_code, mine.output) == (theirs.exit_code, theirs.output), argv
    assert mine.exit_code in (0, 2), mine.output
