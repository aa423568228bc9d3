"""Diagnostics go through ``logging``: no ``print`` in library code outside the CLIs' own output (read with
``ast``), and the CLIs' one handler (:func:`ssd_jax.errors.configure_logging`) shows the lines as they
always looked, on the stderr of the moment, at the level ``--log-level`` asks for. (A server started with
``--log-level warning`` shows none of its start-up lines: ``test_serve_compiles.py``.)"""

import ast
import logging
from pathlib import Path

from ssd_jax.cli.args import Parser, add_log_level
from ssd_jax.errors import configure_logging

PKG = Path(__file__).resolve().parents[1] / "ssd_jax"

#: where ``print`` is the output itself: the CLIs (their results, tables and progress), the benchmark
#: commands, the entry points, ``cli_main``'s one error line, the AR-reference child's JSON line
CLI_MODULES = ("cli/", "bench/", "serve/__main__.py", "data/__main__.py", "__main__.py")
CLI_FUNCTIONS = {("errors.py", "cli_main"), ("planning/reference.py", "main")}


def _prints(path: Path) -> list[tuple[int, str]]:
    """(line, enclosing top-level function) of every ``print(...)`` call in ``path``."""
    out = []
    for top in ast.parse(path.read_text()).body:
        name = getattr(top, "name", "")
        for node in ast.walk(top):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                out.append((node.lineno, name))
    return out


def test_no_print_in_library_code():
    found = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel.startswith(CLI_MODULES) or rel.endswith("__main__.py"):
            continue
        found += [f"{rel}:{line} ({fn})" for line, fn in _prints(path) if (rel, fn) not in CLI_FUNCTIONS]
    assert found == [], "library code logs (logging.getLogger(__name__)) instead of printing"


def test_the_cli_handler_keeps_the_lines_and_follows_the_level(capsys):
    log = logging.getLogger("ssd_jax.planning.example")
    p = Parser(prog="example")
    add_log_level(p)
    try:
        p.parse_args([])  # info, the default: the plan and the start-up lines show
        log.info("[plan] a start-up line")
        log.warning("warning: a warning")
        assert capsys.readouterr().err == "[plan] a start-up line\nwarning: a warning\n"
        p.parse_args(["--log-level", "warning"])  # one handler still, now at warning
        log.info("[plan] a start-up line")
        log.warning("warning: a warning")
        assert capsys.readouterr().err == "warning: a warning\n"
    finally:
        configure_logging()
        root = logging.getLogger("ssd_jax")
        root.handlers.clear()  # the library's default again: no handler, records reach the root logger
        root.setLevel(logging.NOTSET)
        root.propagate = True
