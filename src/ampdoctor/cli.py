"""The command line: ``ampdoctor lint | rules | rule``. The only module that knows them all."""

from __future__ import annotations

import difflib
import io
import json
import os
import re
import sys
from pathlib import Path

import click

from ampdoctor import __version__
from ampdoctor.diagnostics import AmpdoctorError, Severity, fix_counts

FORMATS = ("text", "concise", "json", "sarif", "github")
EXIT_OK, EXIT_FINDINGS, EXIT_ERROR = 0, 1, 2


def _codes(values: tuple[str, ...]) -> tuple[str, ...]:
    out: list[str] = []
    for v in values:
        out.extend(c.strip() for c in v.split(",") if c.strip())
    return tuple(out)


def _fail(message: str) -> "click.exceptions.Exit":
    click.echo(f"ampdoctor: error: {message}", err=True)
    return click.exceptions.Exit(EXIT_ERROR)


class _Group(click.Group):
    """Turns our own errors into one line and exit 2, and never shows a traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except AmpdoctorError as exc:
            raise _fail(str(exc)) from None
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except BrokenPipeError:
            # the reader went away (`ampdoctor rules | head`): stop quietly
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            raise click.exceptions.Exit(EXIT_FINDINGS) from None
        except KeyboardInterrupt:
            click.echo("ampdoctor: interrupted", err=True)
            raise click.exceptions.Exit(130) from None
        except Exception as exc:  # pragma: no cover - last line of defence
            if os.environ.get("AMPDOCTOR_DEBUG"):
                raise
            raise _fail(f"internal error: {type(exc).__name__}: {exc} (set AMPDOCTOR_DEBUG=1 for details)") from None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, "--version", prog_name="ampdoctor")
def main() -> None:
    """Find mixed-precision (AMP) problems in PyTorch code."""


def _console(file, force_plain: bool):
    from rich.console import Console

    if force_plain:
        return Console(file=file, no_color=True, highlight=False, width=100, force_terminal=False,
                       soft_wrap=True, emoji=False)
    tty = hasattr(file, "isatty") and file.isatty()
    # a terminal's own width; piped output is 120 columns unless COLUMNS says otherwise
    return Console(file=file, highlight=False, emoji=False, width=None if tty else _columns(120, 20))


def _columns(default: int, minimum: int) -> int:
    """The width ``COLUMNS`` asks for (output that is not a terminal), else ``default``."""
    columns = os.environ.get("COLUMNS", "")
    return int(columns) if columns.isdigit() and int(columns) >= minimum else default


@main.command()
@click.argument("paths", nargs=-1, type=str)
@click.option("--select", multiple=True, help="Codes or prefixes to enable, replacing the defaults (e.g. AMP1,AMP401).")
@click.option("--extend-select", multiple=True, help="Codes or prefixes to enable on top of the selection.")
@click.option("--ignore", multiple=True, help="Codes or prefixes to disable.")
@click.option("--exclude", multiple=True, help="Gitignore-style patterns to skip, replacing the defaults.")
@click.option("--extend-exclude", multiple=True, help="Gitignore-style patterns to skip, added to the defaults.")
@click.option("--force-exclude", is_flag=True, help="Apply the excludes to files named on the command line too.")
@click.option("--no-respect-gitignore", is_flag=True, help="Also lint files that .gitignore ignores.")
@click.option("--stdin-filename", help="The path to use for source read from '-' (messages and config).")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="Use this pyproject.toml for every file.")
@click.option("--min-torch-version", help="Oldest torch the project supports (gates fixes), e.g. 2.4.")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="text", show_default=True)
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True), help="Write the report to this file.")
@click.option("--statistics", is_flag=True, help="Show a count per rule instead of each diagnostic.")
@click.option("-q", "--quiet", is_flag=True, help="Print diagnostics only: no summary, no progress bar.")
@click.option("--exit-zero", is_flag=True, help="Exit 0 even when there are diagnostics.")
@click.option("--fail-on", type=click.Choice(["error", "warning", "info"]), default="info", show_default=True,
              help="Lowest severity that makes the exit code 1.")
@click.option("--fix", is_flag=True, help="Apply safe fixes to the files.")
@click.option("--unsafe-fixes", is_flag=True, help="With --fix or --diff, apply unsafe fixes too.")
@click.option("--diff", is_flag=True, help="Print the fixes as a unified diff and write nothing.")
@click.option("--show-fixes", is_flag=True,
              help="Show each fix's edits under its diagnostic; with --fix, list what was fixed.")
@click.option("--no-cache", is_flag=True, help="Neither read nor write the cache.")
@click.option("--cache-dir", type=click.Path(file_okay=False), help="Cache folder (default: .ampdoctor_cache).")
@click.option("-j", "--jobs", type=click.IntRange(min=1), help="Worker processes (default: all cores).")
@click.option("--include-unreferenced", is_flag=True,
              help="Also report defects in classes and functions nothing in the project refers to.")
def lint(paths, select, extend_select, ignore, exclude, extend_exclude, force_exclude, no_respect_gitignore,
         stdin_filename, config_file, min_torch_version, fmt, output, statistics, quiet, exit_zero, fail_on,
         fix, unsafe_fixes, diff, show_fixes, no_cache, cache_dir, jobs, include_unreferenced) -> None:
    """Check PATHS (default: the current folder) for AMP anti-patterns. '-' reads standard input."""
    from ampdoctor import config as config_mod
    from ampdoctor.lint import discovery, registry, runner

    cwd = Path.cwd()
    paths = list(paths) or ["."]
    fix_mode = None
    if fix or diff:
        fix_mode = "unsafe" if unsafe_fixes else "safe"
    if unsafe_fixes and not (fix or diff):
        raise AmpdoctorError("--unsafe-fixes needs --fix or --diff")
    if "-" in paths and len(paths) > 1:
        raise AmpdoctorError("'-' (standard input) cannot be combined with other paths")
    if statistics and fmt not in ("text", "concise", "json"):
        raise AmpdoctorError(f"--statistics works with --format text, concise or json, not {fmt}")
    selection = runner.Selection(
        select=_codes(select) if select else None,
        extend_select=_codes(extend_select),
        ignore=_codes(ignore),
        min_torch=config_mod.parse_version(min_torch_version, "--min-torch-version") if min_torch_version else None,
    )
    for code in (selection.select or ()) + selection.extend_select + selection.ignore:
        registry.expand(code)  # unknown codes are a usage error, before any work
    if config_file:
        fixed_cfg = config_mod.load(Path(config_file))
        finder = config_mod.Finder(cwd)
        finder.for_dir = lambda _d: fixed_cfg  # type: ignore[method-assign]
    else:
        finder = config_mod.Finder(cwd)
    want_edits = fmt in ("json", "sarif") or fix_mode is not None or fmt == "text"
    resolver = runner.SettingsResolver(selection, fix_mode, want_edits)

    problems: list[str] = []
    sources: dict[str, str] = {}
    if paths == ["-"]:
        data = sys.stdin.buffer.read()
        display = stdin_filename or "-"
        stdin_path = Path(os.path.abspath(stdin_filename)) if stdin_filename else cwd / "-"
        cfg = finder.for_dir(stdin_path.parent)
        settings = resolver.for_file(stdin_path, cfg)
        result = runner.lint_stdin(display, data, settings)
        try:
            from ampdoctor.lint.engine import decode
            sources[display] = decode(data)[0]
        except Exception:
            pass
        files = 1
    else:
        opts = discovery.ExcludeOptions(
            exclude=_codes(exclude) if exclude else None,
            extend_exclude=_codes(extend_exclude),
            force_exclude=force_exclude,
            respect_gitignore=not no_respect_gitignore,
        )
        targets, problems = discovery.discover(paths, finder, opts, cwd)
        for t in targets:  # validate every config that applies before linting
            resolver.base(t.config)
        files = len(targets)
        use_cache = not no_cache and not diff and not os.environ.get("AMPDOCTOR_NO_CACHE")
        cdir = None
        if use_cache:
            cdir = Path(cache_dir) if cache_dir else finder.for_dir(cwd).root / ".ampdoctor_cache"
        progress_cb, progress_done = _progress(files, quiet)
        try:
            everything = include_unreferenced or finder.for_dir(cwd).include_unreferenced
            result = runner.run(targets, resolver, jobs=jobs, cache_dir=cdir, write_fixes=fix and not diff,
                                progress=progress_cb, referenced_only=not everything)
        finally:
            progress_done()

    for p in problems:
        click.echo(f"ampdoctor: error: {p}", err=True)
    if files == 0 and not problems:
        where = ", ".join(paths) if len(paths) <= 3 else f"the {len(paths)} paths given"
        click.echo(f"ampdoctor: warning: no Python files found under {where}", err=True)

    diags = result.diagnostics
    internal = any(r.internal_error for r in result.results)

    if diff:
        text = _diff_text(result, sources)
        _emit(text, output)
        if not text and not quiet:
            hidden = fix_counts(diags)[1]
            if hidden and fix_mode != "unsafe":
                click.echo(f"No safe fixes to show; {hidden} unsafe fix{'es' * (hidden != 1)} "
                           f"{'are' if hidden != 1 else 'is'} available: `--diff --unsafe-fixes` shows "
                           f"{'them' if hidden != 1 else 'it'}.", err=True)
            else:
                click.echo("No fixes to show.", err=True)
        code = EXIT_FINDINGS if text else EXIT_OK
        if internal or problems:
            code = EXIT_ERROR
        raise click.exceptions.Exit(code)

    if paths == ["-"] and fix and result.results[0].fixed is not None:
        sys.stdout.buffer.write(result.results[0].fixed)
        sys.stdout.flush()
        report_to = sys.stderr if not output else None
    else:
        report_to = None

    _report(fmt, diags, files, result.fixes_applied, fix_mode if fix else None, output, statistics, quiet,
            sources, report_to, getattr(result, "unreferenced", []), show_fixes=show_fixes,
            applied=result.applied if fix else [], failed=bool(problems))

    threshold = Severity(fail_on).rank
    failing = [d for d in diags if d.severity.rank >= threshold]
    if internal or problems:
        code = EXIT_ERROR
    elif failing and not exit_zero:
        code = EXIT_FINDINGS
    else:
        code = EXIT_OK
    raise click.exceptions.Exit(code)


def _progress(total: int, quiet: bool):
    if quiet or total < 200 or not sys.stderr.isatty() or os.environ.get("CI"):
        return None, lambda: None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from rich.console import Console
    prog = Progress(TextColumn("linting"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=Console(file=sys.stderr), transient=True)
    task = prog.add_task("lint", total=total)
    prog.start()
    return (lambda n: prog.advance(task, n)), prog.stop


_DIFF_LINE = re.compile(r"[^\n]*\n|[^\n]+")


def _diff_text(result, sources: dict[str, str]) -> str:
    from ampdoctor.lint.engine import decode

    chunks = []
    for r in result.results:
        if r.fixed is None:
            continue
        if r.path in sources:
            old = sources[r.path]
        else:
            try:
                with open(r.path, "rb") as f:
                    old = decode(f.read())[0]
            except Exception:
                continue
        try:
            new = decode(r.fixed)[0]
        except Exception:
            continue
        # lines end at "\n" only, as for diff and patch (splitlines also splits at form feeds,
        # \x1c-\x1e, \x85, \u2028, ... and the diff then does not apply)
        chunks.extend(difflib.unified_diff(_DIFF_LINE.findall(old), _DIFF_LINE.findall(new),
                                           fromfile=f"a/{r.path}", tofile=f"b/{r.path}"))
    return "".join(c if c.endswith("\n") else c + "\n\\ No newline at end of file\n" for c in chunks)


def _emit(text: str, output: str | None) -> None:
    # a file name that is not valid UTF-8 (kept as surrogates) is written as a \\udcXX escape
    if output:
        try:
            with open(output, "w", encoding="utf-8", errors="backslashreplace") as f:
                f.write(text)
        except OSError as exc:
            raise AmpdoctorError(f"cannot write {output}: {exc.strerror}") from None
    else:
        try:
            sys.stdout.write(text)
        except UnicodeEncodeError:
            # standard output cannot encode a character (an ASCII or cp1252 console, a redirect on
            # Windows): the report is written in UTF-8 rather than lost
            sys.stdout.flush()
            buffer = getattr(sys.stdout, "buffer", None)
            if buffer is None:
                raise
            buffer.write(text.encode("utf-8", "backslashreplace"))
        sys.stdout.flush()


def _tolerant(stream):
    """A text stream that escapes the characters it cannot encode instead of failing half-way."""
    if getattr(stream, "errors", None) == "strict" and hasattr(stream, "reconfigure"):
        try:
            stream.reconfigure(errors="backslashreplace")
        except (ValueError, OSError):  # pragma: no cover - a stream that cannot be changed
            pass
    return stream


def _report(fmt, diags, files, fixed, fix_mode, output, statistics, quiet, sources, report_to,
            unreferenced=(), show_fixes=False, applied=(), failed=False) -> None:
    from ampdoctor.report import machine

    if fmt == "json" and statistics:
        _emit(machine.statistics_json(diags), output)
    elif fmt == "json":
        _emit(machine.to_json(diags, files, fixed, unreferenced, applied), output)
    elif fmt == "sarif":
        from ampdoctor.lint.registry import all_infos
        _emit(machine.to_sarif(diags, all_infos()), output)
    elif fmt == "github":
        _emit(machine.to_github(diags), output)
    elif fmt == "concise" and not statistics:
        text = machine.to_concise(diags)
        if not quiet and not output:
            text += _plain_summary(diags, files, fixed, failed) + _unreferenced_line(unreferenced)
        _emit(text, output)
    else:
        from ampdoctor.report import text as text_mod

        buf = io.StringIO() if output else None
        console = _console(buf if buf is not None else _tolerant(report_to or sys.stdout), force_plain=buf is not None)
        if statistics:
            text_mod.render_statistics(console, diags)
        else:
            text_mod.render_diagnostics(console, diags, sources, show_fixes=show_fixes)
        if show_fixes and applied:
            text_mod.render_applied(console, applied)
        if not quiet:
            text_mod.render_summary(console, diags, files, fixed, fix_mode, failed=failed)
            line = _unreferenced_line(unreferenced)
            if line:
                console.print(line.rstrip("\n"), highlight=False, markup=False)
        if buf is not None:
            _emit(buf.getvalue(), output)


def _unreferenced_line(unreferenced) -> str:
    """Say what was left out, so a quiet run is not mistaken for a clean one."""
    if not unreferenced:
        return ""
    n = len(unreferenced)
    names = sorted({h.where for h in unreferenced})
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    present = {h.kind for h in unreferenced}
    folders = sorted({h.where.split("(", 1)[1].rstrip(")") for h in unreferenced if h.kind == "folder"})
    kinds = ["code that nothing outside tests uses"] + \
        ([f"in {' and '.join(folders)} folders"] if folders else []) + \
        (["in scripts that import modules the project no longer has"] if "stale" in present else []) + \
        (["whose missing call another file makes"] if "elsewhere" in present else [])
    where = ", ".join(kinds[:-1]) + " or " + kinds[-1] if len(kinds) > 1 else kinds[0]
    return (f"{n} finding{'s' * (n != 1)} in {where} not shown ({shown}); "
            f"--include-unreferenced shows {'them' if n != 1 else 'it'}.\n")


def _plain_summary(diags, files, fixed, failed=False) -> str:
    out = f"Fixed {fixed} diagnostic{'s' * (fixed != 1)}.\n" if fixed else ""
    if not diags:
        from ampdoctor.report.text import clean_line
        line = clean_line(files, failed)
        return out + (line + "\n" if line else "")
    n, with_diags = len(diags), len({d.path for d in diags})
    return out + f"Found {n} diagnostic{'s' * (n != 1)} in {with_diags} of {files} file{'s' * (files != 1)}.\n"


@main.command()
@click.option("--format", "fmt", type=click.Choice(["text", "json", "markdown"]), default="text", show_default=True)
def rules(fmt: str) -> None:
    """List every rule: code, name, severity, fix, on by default."""
    from ampdoctor.lint.registry import all_infos

    infos = list(all_infos().values())
    if fmt == "markdown":
        click.echo("| code | name | severity | fix | default | what it finds |")
        click.echo("|---|---|---|---|---|---|")
        for i in infos:
            summary = i.summary.replace("|", "\\|")
            click.echo(f"| {i.code} | {i.name} | {i.severity.value} | {i.fix or '-'} | "
                       f"{'on' if i.default else 'off'} | {summary} |")
        return
    if fmt == "json":
        click.echo(json.dumps([{
            "code": i.code, "name": i.name, "severity": i.severity.value, "fix": i.fix,
            "default": i.default, "summary": i.summary,
        } for i in infos], indent=2))
        return
    if not sys.stdout.isatty():
        w = max(len(i.name) for i in infos)
        for i in infos:
            click.echo(f"{i.code}  {i.name:<{w}}  {i.severity.value:<7}  {(i.fix or '-'):<10}  "
                       f"{'on ' if i.default else 'off'}  {i.summary}")
        return
    from ampdoctor.report.text import render_rules
    render_rules(_console(sys.stdout, False), infos)


@main.command()
@click.argument("code")
def rule(code: str) -> None:
    """Explain a rule: what it does, why, examples and fix safety."""
    from ampdoctor import docs
    from ampdoctor.lint.registry import all_infos

    infos = all_infos()
    key = code.strip().upper()
    if key not in infos:
        by_name = {i.name: c for c, i in infos.items()}
        if code.strip().lower() in by_name:
            key = by_name[code.strip().lower()]
        else:
            raise AmpdoctorError(f"unknown rule '{code}' (see `ampdoctor rules`)")
    text = docs.read(key)
    if text is None:
        raise AmpdoctorError(f"no documentation found for {key}; the installation looks incomplete")
    _, body = docs.split_front_matter(text)
    if sys.stdout.isatty():
        from rich.markdown import Markdown
        _console(sys.stdout, False).print(Markdown(body))
    else:
        click.echo(body.rstrip("\n"))


_TORCHRUN = (("nnodes", "--nnodes"), ("node_rank", "--node-rank"), ("master_addr", "--master-addr"),
             ("master_port", "--master-port"), ("rdzv_backend", "--rdzv-backend"),
             ("rdzv_endpoint", "--rdzv-endpoint"), ("rdzv_id", "--rdzv-id"), ("max_restarts", "--max-restarts"))


@main.command(context_settings={"allow_interspersed_args": False})
@click.argument("script", type=click.Path(dir_okay=False))
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.option("--target", type=click.Choice(["float16", "bfloat16"]),
              help="Format to judge values against (default: the low-precision dtype seen, else float16).")
@click.option("--max-steps", type=click.IntRange(min=1),
              help="Stop the script cleanly after N steps (optimizer steps when it makes an optimizer, "
              "else loop iterations).")
@click.option("--ops", is_flag=True, help="Replay the first bad module call to name the aten op or autograd node "
              "(slower: syncs, and keeps each call's inputs until the step ends).")
@click.option("--no-grads", is_flag=True, help="Do not collect gradient statistics.")
@click.option("--compare", type=click.Choice(["fp32", "float32"]),
              help="Re-run each low-precision module call in float32 (no_grad, results untouched) and rank the "
              "layers by the digits they lose (a debugging mode: several times slower).")
@click.option("--watch", is_flag=True, help="Watch mode: check only the loss and the GradScaler's skips, with no "
              "host transfer in a healthy step; trace fully from the first bad step on (replaying it).")
@click.option("--watch-steps", type=click.IntRange(min=1), default=5, show_default=True,
              help="With --watch: how many steps after the bad one to trace.")
@click.option("--format", "fmt", type=click.Choice(["text", "json", "html"]),
              help="Report format (default: text, or what the name given to -o ends with: .json, .html).")
@click.option("-o", "--output", type=click.Path(dir_okay=False),
              help="Write the report to this file (the terminal still gets the verdict).")
@click.option("--width", type=click.IntRange(min=40, max=1000),
              help="Columns of the text report (default: the terminal's, else COLUMNS, else 100).")
@click.option("--fail-on", "fail_on", help="Comma-separated finding kinds that make the exit code 1 "
              "(nonfinite, overflow, underflow, scaler, or all).")
@click.option("--nproc-per-node", help="Launch SCRIPT on N processes with torch's elastic launcher "
              "(torch.distributed.run, as torchrun does) and merge the ranks' reports into one.")
@click.option("--nnodes", help="torchrun's --nnodes (with --nproc-per-node).")
@click.option("--node-rank", help="torchrun's --node-rank.")
@click.option("--master-addr", help="torchrun's --master-addr.")
@click.option("--master-port", help="torchrun's --master-port.")
@click.option("--rdzv-backend", help="torchrun's --rdzv-backend.")
@click.option("--rdzv-endpoint", help="torchrun's --rdzv-endpoint.")
@click.option("--rdzv-id", help="torchrun's --rdzv-id.")
@click.option("--max-restarts", help="torchrun's --max-restarts.")
@click.option("--standalone", is_flag=True, help="torchrun's --standalone.")
@click.option("--run-dir", type=click.Path(file_okay=False),
              help="Folder for the ranks' reports (default: a temporary one; over several nodes, give one on "
              "storage all nodes share).")
@click.option("--merge-timeout", type=click.FloatRange(min=0), default=60.0, show_default=True,
              help="Under a bare torchrun, how long rank 0 waits for the other ranks' reports after its script "
              "ends (seconds).")
def trace(script, args, target, max_steps, ops, no_grads, compare, watch, watch_steps, fmt, output, width,
          fail_on, nproc_per_node, run_dir, merge_timeout, standalone, **torchrun) -> None:
    """Run SCRIPT with its ARGS under the numerics tracer and report per-layer fp16/bf16 health.

    With --nproc-per-node N, SCRIPT runs on N processes launched by torch.distributed.run; each rank
    traces itself and one report covers them all. Under torchrun (torchrun ... -m ampdoctor trace
    SCRIPT), rank 0 merges the reports."""
    kinds = set()
    if fail_on:
        allowed = {"nonfinite", "overflow", "underflow", "scaler"}
        kinds = {k.strip() for k in fail_on.split(",") if k.strip()}
        if "all" in kinds:
            kinds = allowed
        unknown = sorted(kinds - allowed)
        if unknown:
            raise AmpdoctorError(f"unknown finding kind '{unknown[0]}' for --fail-on "
                                 f"(one of: {', '.join(sorted(allowed))}, all)")
    if not os.path.isfile(script):
        raise AmpdoctorError(f"{script}: no such file")
    if fmt is None:
        from ampdoctor.report.trace_files import format_for
        fmt = format_for(output) if output else "text"
    launcher = [arg for key, flag in _TORCHRUN if torchrun.get(key) is not None
                for arg in (flag, str(torchrun[key]))] + (["--standalone"] if standalone else [])
    if launcher and nproc_per_node is None:
        raise AmpdoctorError(f"{launcher[0]} needs --nproc-per-node (it is a launcher option)")
    if output:
        _check_writable(output)
    try:
        import torch  # noqa: F401
    except ImportError:
        raise AmpdoctorError("`ampdoctor trace` needs torch: pip install 'ampdoctor[trace]'") from None
    from ampdoctor.trace import distributed as dist_trace

    if nproc_per_node is not None:
        opts = [*(["--target", target] if target else []), *(["--max-steps", str(max_steps)] if max_steps else []),
                *(["--ops"] if ops else []), *(["--no-grads"] if no_grads else []),
                *(["--watch", "--watch-steps", str(watch_steps)] if watch else []),
                *(["--compare", compare] if compare else [])]
        report, code = _launch(script, list(args), str(nproc_per_node), launcher, opts, run_dir, fmt, output)
        _finish_trace(report, fmt, output, width, kinds, code)
    info = dist_trace.rank_info()
    from ampdoctor.trace.run import run_script
    from ampdoctor.trace.tracer import Tracer

    if info is not None:
        dist_trace.stop_on_sigterm()
    if watch and compare:
        raise AmpdoctorError("--watch and --compare do not go together: watch mode traces nothing until a step "
                             "goes wrong, --compare re-runs every call")
    if watch:
        from ampdoctor.trace.watch import Watcher
        tracer = Watcher(target=target, grads=not no_grads, ops=ops, max_steps=max_steps, trace_steps=watch_steps)
    else:
        tracer = Tracer(target=target, grads=not no_grads, ops=ops, max_steps=max_steps, compare=compare)
    # a JSON or HTML report on standard output must stay parseable: the script's own output goes to stderr
    result = run_script(script, list(args), tracer, quiet_stdout=fmt != "text" and not output)
    if info is not None:
        dist_trace.hold_sigterm()
    report = tracer.report()
    report["script"] = {"path": script, "args": list(args), "exit_code": result.exit_code,
                        "error": result.error, "error_summary": result.summary,
                        "stopped_by_max_steps": result.stopped}
    if info is not None:
        folder = dist_trace.run_dir(info, run_dir)
        dist_trace.write_rank_report(folder, info, report)
        if info.rank != 0 or os.environ.get(dist_trace.MERGE_ENV) == "launcher":
            # the launcher (or rank 0) merges; this rank only says how its script ended
            if result.error:
                click.echo(f"ampdoctor: rank {info.rank}: the script raised:\n{result.error.rstrip()}", err=True)
            raise click.exceptions.Exit(result.exit_code)
        reports = dist_trace.wait_for_ranks(folder, info.world_size, merge_timeout)
        merged = dist_trace.merge(reports, info.world_size)
        kept = run_dir or os.environ.get(dist_trace.RUN_DIR_ENV)
        if not kept:  # the default folder: nothing in it is needed once merged
            import shutil
            shutil.rmtree(folder, ignore_errors=True)
        merged["script"] = dict(report["script"], run_dir=kept or None)
        _finish_trace(merged, fmt, output, width, kinds, result.exit_code, result.error)
    _finish_trace(report, fmt, output, width, kinds, result.exit_code, result.error)


def _launch(script, args, nproc, launcher, opts, folder, fmt, output):
    """Run SCRIPT on ``nproc`` processes through torch.distributed.run, every rank under
    ``ampdoctor trace``, then merge the ranks' reports. Returns the merged report and the
    launcher's exit code."""
    import subprocess
    import tempfile

    from ampdoctor.trace import distributed as dist_trace

    keep = folder is not None
    folder = folder or tempfile.mkdtemp(prefix="ampdoctor-run-")
    os.makedirs(folder, exist_ok=True)
    dist_trace.clear_rank_reports(folder)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", nproc, *launcher,
           "-m", "ampdoctor", "trace", *opts, script, *args]
    env = dict(os.environ, **{dist_trace.RUN_DIR_ENV: os.path.abspath(folder), dist_trace.MERGE_ENV: "launcher"})
    # a JSON or HTML report on standard output must stay parseable: the ranks' output goes to stderr
    to_stderr = fmt != "text" and not output
    try:
        code = subprocess.call(cmd, env=env, stdout=sys.stderr if to_stderr else None)
    except KeyboardInterrupt:
        code = 130
    world = _world_size(folder, nproc, launcher)
    reports = dist_trace.read_rank_reports(folder, world)
    if not keep:
        import shutil
        shutil.rmtree(folder, ignore_errors=True)
    if not any(reports.values()):
        raise AmpdoctorError(f"no rank left a report (the launcher exited with {code})")
    merged = dist_trace.merge(reports, world)
    failure = dist_trace.first_failure(reports)
    missing = merged["distributed"]["missing_ranks"]
    summary = f"rank {failure[0]}: {dist_trace.first_line(failure[1]['error_summary'])}" if failure else None
    if missing:  # a rank that left no report was killed or crashed: the likeliest cause
        gone = f"rank {', '.join(map(str, missing))} ended without a report (killed or crashed)"
        summary = f"{gone}; {summary}" if summary else gone
    merged["script"] = {"path": script, "args": args, "exit_code": code,
                        "error": f"rank {failure[0]}: {failure[1]['error']}" if failure else None,
                        "error_summary": summary or (f"launcher exit code {code}" if code else None),
                        "stopped_by_max_steps": any(rep and rep["script"].get("stopped_by_max_steps")
                                                    for rep in reports.values()),
                        "run_dir": folder if keep else None,
                        "launcher": ["torch.distributed.run", "--nproc-per-node", nproc, *launcher]}
    return merged, code


def _world_size(folder: str, nproc: str, launcher: list[str]) -> int:
    """How many ranks the job had: nproc x nnodes when both are numbers, else from the reports."""
    nnodes = launcher[launcher.index("--nnodes") + 1] if "--nnodes" in launcher else "1"
    if nproc.isdigit() and nnodes.isdigit():
        return int(nproc) * int(nnodes)
    from ampdoctor.trace import distributed as dist_trace

    ranks = dist_trace.ranks_written(folder)
    return max(ranks) + 1 if ranks else 1


def _finish_trace(report, fmt, output, width, kinds, exit_code, error=None) -> None:
    """Write the report, print the verdict, and exit: the script's own exit code when it failed,
    else 1 when a --fail-on kind was found, else 0."""
    if fmt != "text" or output:
        from ampdoctor.report import trace_files as trace_output
        text_width = width if width is not None else _columns(100, 40)  # a file gets COLUMNS, else 100
        _emit(trace_output.render(report, fmt, text_width), output)
    else:
        from ampdoctor.report import trace_text
        trace_text.render(_trace_console(sys.stdout, width), report)
    if output:  # the terminal still says what was found, and where the report went
        from ampdoctor.report import trace_text
        console = _trace_console(sys.stdout, width, plain=not sys.stdout.isatty())
        trace_text.render_verdict(console, report)
        console.print(f"wrote {output}", highlight=False, soft_wrap=True, markup=False)
    if error:
        click.echo(f"ampdoctor: the script raised:\n{error.rstrip()}", err=True)
    if exit_code:
        raise click.exceptions.Exit(exit_code)
    if kinds and (any(f["kind"] in kinds for f in report["findings"])
                  or ("nonfinite" in kinds and report["first_nonfinite"] is not None)):
        raise click.exceptions.Exit(EXIT_FINDINGS)
    raise click.exceptions.Exit(EXIT_OK)


def _trace_console(file, width: int | None, plain: bool | None = None):
    """The trace report's console: ``--width``, else the terminal's width, else COLUMNS, else 100;
    a file gets exactly what a terminal of that width shows, without colour."""
    from ampdoctor.report.trace_files import console

    tty = hasattr(file, "isatty") and file.isatty()
    if width is None and not tty:
        width = _columns(100, 40)
    return console(file, width, plain=not tty if plain is None else plain)


def _check_writable(output: str) -> None:
    """Fail before a long run, not after it, when the report could not be written."""
    parent = os.path.dirname(os.path.abspath(output)) or "."
    if os.path.isdir(output):
        raise AmpdoctorError(f"cannot write {output}: it is a directory")
    if not os.path.isdir(parent):
        raise AmpdoctorError(f"cannot write {output}: no such directory {parent}")
    target = output if os.path.exists(output) else parent
    if not os.access(target, os.W_OK):
        raise AmpdoctorError(f"cannot write {output}: permission denied")
