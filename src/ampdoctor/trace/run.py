"""Run a user's script as ``__main__`` under the tracer, the way ``python script.py`` would."""

from __future__ import annotations

import builtins
import contextlib
import importlib.machinery
import os
import runpy
import sys
import traceback
import types
import zipfile
from dataclasses import dataclass

from ampdoctor.trace.tracer import StopTracing, Tracer


class Terminated(BaseException):
    """SIGTERM arrived while the script ran (torchrun stopping the other ranks after one failed)."""


@dataclass
class ScriptResult:
    exit_code: int  # the script's own exit code (0 when it ended normally or was stopped by --max-steps)
    error: str | None  # the script's exception, formatted, when it raised
    stopped: bool  # ended by --max-steps
    summary: str | None = None  # the exception's last line ("ValueError: bad batch")


@contextlib.contextmanager
def _stdout_to_stderr():
    """The script's standard output goes to standard error, at the file-descriptor level too
    (prints from C code and child processes), so that a report written to standard output stays
    valid JSON or HTML."""
    sys.stdout.flush()
    try:
        out_fd, err_fd = sys.stdout.fileno(), sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # not real files (a test runner's capture)
        out_fd = err_fd = None
    saved = os.dup(out_fd) if out_fd is not None else None
    try:
        if saved is not None:
            os.dup2(err_fd, out_fd)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        if saved is not None:
            os.dup2(saved, out_fd)
            os.close(saved)


def run_script(path: str, args: list[str], tracer: Tracer, quiet_stdout: bool = False) -> ScriptResult:
    """Run the script under the tracer; with ``quiet_stdout`` its standard output goes to
    standard error."""
    with _stdout_to_stderr() if quiet_stdout else contextlib.nullcontext():
        return _run(path, args, tracer)


def _compile(path: str):
    with open(path, "rb") as f:
        source = f.read()
    return compile(source, path, "exec", dont_inherit=True)


def _main_module(path: str) -> types.ModuleType:
    """A fresh ``__main__`` for the script, as ``python SCRIPT`` makes it. Unlike runpy's, its
    globals stay the script's until the tracer has closed, so that the report can still name
    the models they hold."""
    mod = types.ModuleType("__main__")
    mod.__dict__.update({"__file__": path, "__cached__": None, "__package__": None, "__spec__": None,
                         "__loader__": importlib.machinery.SourceFileLoader("__main__", path),
                         "__builtins__": builtins})
    sys.modules["__main__"] = mod
    return mod


def _run(path: str, args: list[str], tracer: Tracer) -> ScriptResult:
    path = os.path.abspath(path)
    old_argv, old_path0 = sys.argv[:], sys.path[0] if sys.path else None
    sys.argv = [path, *args]
    script_dir = os.path.dirname(path)
    if sys.path:
        sys.path[0] = script_dir
    else:  # pragma: no cover
        sys.path.insert(0, script_dir)
    main_mod = sys.modules.get("__main__")
    try:
        if os.path.isfile(path) and not zipfile.is_zipfile(path):
            code = _compile(path)  # a syntax error is the script's own error
            with tracer:
                exec(code, _main_module(path).__dict__)
        else:  # a directory or zip file with a __main__.py
            with tracer:
                runpy.run_path(path, run_name="__main__")
        return ScriptResult(0, None, False)
    except StopTracing:
        return ScriptResult(0, None, True)
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return ScriptResult(0, None, False)
        if isinstance(code, int):
            return ScriptResult(code, None, False, f"exit code {code}" if code else None)
        return ScriptResult(1, str(code), False, str(code))
    except KeyboardInterrupt:
        return ScriptResult(130, "KeyboardInterrupt", False, "KeyboardInterrupt")
    except Terminated:
        return ScriptResult(143, "terminated by SIGTERM", False, "terminated by SIGTERM")
    except BaseException as exc:  # the script's own error: report it, then the trace
        tb = traceback.TracebackException.from_exception(exc)
        # hide ampdoctor's and runpy's frames: the user wants their own
        tb.stack = traceback.StackSummary.from_list(
            [f for f in tb.stack if "ampdoctor" not in f.filename and "runpy" not in f.filename])
        return ScriptResult(1, "".join(tb.format()), False, "".join(tb.format_exception_only()).strip())
    finally:
        sys.argv = old_argv
        if old_path0 is not None and sys.path:
            sys.path[0] = old_path0
        if main_mod is not None:
            sys.modules["__main__"] = main_mod
