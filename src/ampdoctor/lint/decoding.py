"""Reading source bytes without libcst: encodings, bracket depth, Python's own syntax check."""

from __future__ import annotations

import ast
import io
import itertools
import tokenize
import warnings

# Python refuses more than 200 nested brackets ("too many nested parentheses"); libcst does
# not, and parses such nesting in time that grows much faster than the file. A file that deep
# is checked with Python's parser first.
MAX_NESTING = 200
_BRACKETS = bytes.maketrans(b"([{)]}", b"\x01\x01\x01\xff\xff\xff")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"()[]{}")


# -- reading ------------------------------------------------------------------------

def decode(data: bytes) -> tuple[str, str]:
    """Decode Python source honouring a BOM and a PEP 263 coding cookie.

    Raises UnicodeDecodeError/SyntaxError/LookupError with a readable message.
    """
    encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    return data.decode(encoding), encoding


def max_nesting(data: bytes) -> int:
    """The deepest bracket nesting, counting brackets in strings and comments too (an upper bound)."""
    if data.count(b"(") + data.count(b"[") + data.count(b"{") < MAX_NESTING:
        return 0
    steps = memoryview(data.translate(_BRACKETS, _NOT_BRACKETS)).cast("b")
    return max(itertools.accumulate(steps), default=0)


def python_syntax_error(text: str) -> tuple[int, int, str] | None:
    """Where and why Python's own parser rejects ``text``: (line, 1-based column, message), or None.

    libcst's error positions are often a line or more off (and a suppression comment on the
    wrong line then hides the error); Python's are the ones users see when they run the file.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            compile(text, "<ampdoctor>", "exec", ast.PyCF_ONLY_AST, dont_inherit=True)
        except SyntaxError as exc:
            if not exc.lineno:
                return None
            line = max(1, min(exc.lineno, text.count("\n") + 1))
            return line, max(1, exc.offset or 1), f"{type(exc).__name__}: {exc.msg}"
        except (RecursionError, MemoryError):
            return 1, 1, "the file is nested too deeply to be parsed"
        except (ValueError, TypeError):
            return None
    return None




# -- fixes --------------------------------------------------------------------------
