"""Composition root of the ``zckpt`` command line.

Each command lives in its own module exposing ``NAME``, ``command`` (a plain function whose
parameters are typer ``Annotated`` aliases from ``_options``; its docstring is the help's description),
``EPILOG`` (the details printed after the options) and ``needs_torch(options)`` (whether that run builds
tensors: ``inspect`` and ``verify`` read metadata only and never import torch); adding a command is one line
in ``COMMANDS``.
Help is plain text that fits 80 columns (``_help``); ``zckpt --version`` prints ``zckpt X.Y.Z``.

Every command runs under ``_guarded``: a ``ZckptError`` (or an OS error) prints
``error: <message>`` and ``hint: <hint>`` on stderr and exits 2, without a traceback unless
``ZCKPT_DEBUG=1``; Ctrl-C exits 130 (writers have already removed their temporary files). Exit
status 1 is left to commands for a negative answer (``diff``: "different"), 0 is success.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import os
import re
import signal
import warnings
from collections.abc import Callable
from typing import Annotated, Any

import typer

from zckpt import __version__, _startup_interrupt
from zckpt.cli._help import Command, Group
from zckpt.cli._output import Output

EXIT_ERROR = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143  # 128 + SIGTERM
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a writer killed by a closed pipe

COMMANDS = (
    "zckpt.cli.inspect",
    "zckpt.cli.consolidate",
    "zckpt.cli.diff",
    "zckpt.cli.verify",
    "zckpt.cli.reshard",
)

app = typer.Typer(
    name="zckpt",
    cls=Group,
    help="Inspect, consolidate, reshard, diff and verify sharded (ZeRO, FSDP-style) training checkpoints.",
    epilog="Run 'zckpt COMMAND --help' for a command's options. Errors print one line and exit 2; "
    "ZCKPT_DEBUG=1 shows the traceback.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain click help, as pip, git and the hf CLI print it (see _help)
)


def _print_version(value: bool) -> None:
    if value:  # `zckpt 0.1.0`: the program's name and version, as `pip --version` and `git --version` start
        typer.echo(f"zckpt {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", is_eager=True, callback=_print_version, help="Print the version and exit."),
    ] = False,
) -> None:
    """Options of ``zckpt`` itself (before the command)."""


def _one_line_warning(message: Warning | str, *_: Any, **__: Any) -> None:
    Output.warning(str(message))


def _guarded(fn: Callable[..., Any], needs_torch: Callable[[dict[str, Any]], bool]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        from zckpt.errors import ZckptError

        debug = os.environ.get("ZCKPT_DEBUG") == "1"
        from zckpt.storage import objstore, session  # neither imports torch

        try:
            options = objstore.parse_options(kwargs.get("storage_option"))
        except ZckptError as e:
            Output.error(str(e), e.hint)
            raise typer.Exit(EXIT_ERROR) from None
        st = session.Storage(options)  # the command's one Storage (its s3:// client, caches, open files)
        torch = needs_torch(kwargs)
        if torch:
            _preopen(kwargs, st)
        _leave_startup(torch)
        try:
            with st.bound():
                return _run(fn, args, kwargs, st, debug)
        finally:
            _end_children(st)
            st.close()

    return run


def _run(fn: Callable[..., Any], args: Any, kwargs: dict[str, Any], st: Any, debug: bool) -> Any:
    """The command ``fn`` with its errors as one line and its interrupts reported truthfully (``st``: the
    command's ``Storage``, bound)."""
    from zckpt.errors import ZckptError
    from zckpt.storage import interrupts

    start = interrupts.mark()
    try:
        _refuse_bare_schemes(kwargs)
        from zckpt.storage import env

        env.check()  # a bad ZCKPT_WORKERS is one line before any work, not an error mid-write
        with warnings.catch_warnings():
            warnings.simplefilter("always" if debug else "default")
            if not debug:  # library warnings as one `warning: ...` line, not file:line + source
                warnings.showwarning = _one_line_warning
            out = fn(*args, **kwargs)
        _done()
        return out
    except typer.Exit:  # a command's own exit status (diff: 1 = different; verify: 1 = problems)
        _done()
        raise
    except ZckptError as e:
        if debug:
            _traceback()
        Output.error(str(e), e.hint)
        raise typer.Exit(EXIT_ERROR) from None
    except BrokenPipeError:  # `zckpt inspect ... | head`: the reader left; stop quietly, as cat does
        _silence_stdout()
        raise typer.Exit(EXIT_BROKEN_PIPE) from None
    except OSError as e:
        if debug:
            _traceback()
        where = f"{e.filename}: " if e.filename else ""
        Output.error(f"{where}{e.strerror or e}")
        raise typer.Exit(EXIT_ERROR) from None
    except KeyboardInterrupt as e:
        stopped = "terminated" if isinstance(e, Terminated) else "interrupted"
        if interrupts.published_since(start):  # it came after the output was in place: the job is done
            Output.warning(f"{stopped} after the output was published; it is complete")
            return None
        if st.left:  # what a given-up output could not delete: say so, never "nothing left"
            shown = ", ".join(st.left[:3]) + (f" (+{len(st.left) - 3} more)" if len(st.left) > 3 else "")
            Output.error(f"{stopped}; {len(st.left)} object(s) of the unfinished output could not be "
                         f"deleted: {shown}", "delete them before writing there again")  # fmt: skip
        else:
            Output.error(f"{stopped}; no partial output was left behind")
        _said.interrupted = True
        raise typer.Exit(EXIT_TERMINATED if isinstance(e, Terminated) else EXIT_INTERRUPTED) from None
    except (MemoryError, RecursionError, Exception) as e:  # noqa: BLE001 - a bug, or input nothing foresaw
        if debug:
            _traceback()
        Output.error(f"unexpected {type(e).__name__}: {e}",
                     "this is a bug in zckpt or an input it does not know; ZCKPT_DEBUG=1 shows the "
                     "traceback to report")  # fmt: skip
        raise typer.Exit(EXIT_ERROR) from None


def _traceback() -> None:
    """The traceback ``ZCKPT_DEBUG=1`` asks for (``traceback`` imported only then: start-up)."""
    import traceback

    traceback.print_exc()


_BARE_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):/*")


def _refuse_bare_schemes(kwargs: dict[str, Any]) -> None:
    """A path argument that is a URL with no bucket (``zckpt inspect s3://``, which typer hands over as the
    path ``s3:``) in one line, not as a local file named ``s3:`` that does not exist."""
    from zckpt.errors import InvalidArgument

    for value in kwargs.values():
        if not isinstance(value, (str, os.PathLike)):
            continue
        m = _BARE_SCHEME.fullmatch(os.fspath(value))
        if m is not None and not os.path.lexists(value):
            s = m.group(1)
            raise InvalidArgument(f"{s}://: the URL names no bucket", hint=f"give {s}://BUCKET/PATH")


_INPUTS = {"ckpt": "tag", "src": "tag", "a": "tag_a", "b": "tag_b"}
"""The commands' parameters that name an input checkpoint, each with its tag option."""
_DCP_PRELOAD = "zckpt.formats.dcp.metadata:preload"
_WARMUP = "zckpt.ops.warmup:advise_model"


def _preopen(kwargs: dict[str, Any], st: Any) -> None:
    """Work that needs no torch, started in child processes to overlap torch's import
    (``zckpt.storage.preopen``: only in a process that has not imported torch and runs one thread, so never
    in an embedding program or typer's test runner), for each local input: a DCP folder's ``.metadata``
    parsed (folders that hold one directly or under ``--tag``); any other checkpoint's first model bytes read
    ahead into the page cache (``zckpt.ops.warmup``)."""
    from pathlib import Path

    from zckpt.storage import objstore, preopen

    if not preopen.available():
        return
    for name, tag_name in _INPUTS.items():
        value, tag = kwargs.get(name), kwargs.get(tag_name)
        if not isinstance(value, (str, os.PathLike)) or objstore.is_url(os.fspath(value)):
            continue
        f = Path(value) / (tag if isinstance(tag, str) else "") / ".metadata"
        with contextlib.suppress(OSError):
            if f.is_file():
                preopen.start(st.cache("preopen"), _DCP_PRELOAD, os.path.realpath(f))
            elif os.path.exists(value) and tag is None:
                preopen.start(st.cache("preopen"), _WARMUP, os.path.realpath(value))


def _end_children(st: Any) -> None:
    """Stop and reap the pre-open children the command did not take (a read-ahead still queueing)."""
    children = st.cached("preopen")
    if children:
        from zckpt.storage import preopen

        preopen.discard(children)


def _done() -> None:
    """The command has run to its end: in the program's process, Ctrl-C and SIGTERM from here on would only
    interrupt the exit, so they stay blocked until it (see ``_said.program``)."""
    if _said.program:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})


def _leave_startup(torch: bool = True) -> None:
    """Import torch (for a command that ``needs_torch``) while Ctrl-C still means ``_startup_interrupt``
    (exit 130, nothing written), then let it
    raise ``KeyboardInterrupt`` for ``_guarded``: an interrupt inside torch's C++ start-up, where a Python
    exception cannot unwind, aborts the process (``terminate called after throwing ... error_already_set``,
    SIGABRT) or leaves torch half-imported. Commands import torch lazily, so ``--help`` stays fast. SIGTERM
    keeps its default action until then too.

    In the ``zckpt`` program (``main``, which owns the process's collector) the ~150k objects that importing
    torch made are then frozen (``gc.freeze``, as ``main`` froze typer's): they live as long as the process,
    and every full collection during the command would walk them again (0.1 s of a 2.3 s consolidate on the
    2-core machine). Commands run in-process (typer's test runner, an embedding program) leave it alone."""
    if torch:
        importlib.import_module("torch")
        from zckpt.storage import collector

        collector.settle()
    if signal.getsignal(signal.SIGINT) is _startup_interrupt:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _terminated)  # cleaned up like Ctrl-C: staging folders removed


for _module in COMMANDS:
    _mod = importlib.import_module(_module)
    app.command(name=_mod.NAME, cls=Command, epilog=_mod.EPILOG)(_guarded(_mod.command, _mod.needs_torch))


def main() -> None:
    """Console-script entry point (``zckpt``).

    Ends with ``os._exit`` once stdout/stderr are flushed: torch's interpreter teardown costs about
    0.5 s per invocation, and nothing is left to clean up by then (outputs are fsynced and renamed,
    temporary files removed, the process group destroyed here). ``ZCKPT_FAST_EXIT=0`` keeps the normal
    interpreter exit (for embedding or debugging). The objects that importing typer and the commands made
    are frozen first (``gc.freeze``; torch's once it is imported, ``_leave_startup``): they live as long as
    the process, and each full collection during the command would walk them all again."""
    from zckpt.storage import collector

    collector.own()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    _said.program = True
    gc.freeze()
    try:
        app()
        code: object = 0
    except SystemExit as e:
        code = e.code
        if code == EXIT_INTERRUPTED and not _said.interrupted:  # typer's silent Ctrl-C exit (while parsing
            Output.error("interrupted (outputs are published whole or not at all)")  # or after the command)
    except KeyboardInterrupt:  # before or between commands (argument parsing, start-up)
        Output.error("interrupted; nothing was written")
        code = EXIT_INTERRUPTED
    if os.environ.get("ZCKPT_FAST_EXIT", "1") == "0":  # back to a caller: its signal mask as it was
        _said.program = False
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        raise SystemExit(code)
    _fast_exit(code)


class _said:  # noqa: N801 - a namespace, not a type
    interrupted = False
    """``_guarded`` reported the interrupt already."""
    program = False
    """``main`` runs this process: once a command has returned, SIGINT and SIGTERM stay blocked until the
    process exits (one arriving in typer's return path or in ``_fast_exit`` would print a traceback, or
    "nothing was written" after the output was published); ``ZCKPT_FAST_EXIT=0`` restores the mask before
    ``main`` returns to its caller. Commands run otherwise in-process leave the mask alone."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is so that it unwinds like Ctrl-C (staging folders removed)."""


def _terminated(signum: int, frame: object) -> None:
    raise Terminated


def _fast_exit(code: object) -> None:
    import sys

    if code is None:
        code = 0
    elif not isinstance(code, int):  # SystemExit("message"): print it and exit 1, as Python does
        print(code, file=sys.stderr)
        code = 1
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed pipe: nothing more can be said
            stream.flush()
    os._exit(code)


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush into a closed pipe stays quiet."""
    import sys

    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


if __name__ == "__main__":
    main()
