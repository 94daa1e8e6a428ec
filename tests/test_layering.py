"""The package's shape, read from its source with ast: no module imports from a layer above its own,
and no file or class grows past what a reader can hold.

The order is DESIGN.md's (server -> engine -> scheduler -> kvcache -> runner -> models -> layers),
with the modules outside those layers placed by what they import and who imports them:
- front ends, beside server/ at the top: the offline `llm` (it drives an engine in-process) and the
  package's own __init__ (it re-exports `LLM`; server/app reads its version).
- shared, below layers/: config, errors, outputs, sampling_params, sequence, structured, chat,
  detokenizer and distributed/ import nothing but each other, and layers below the top read them
  (the sampler reads `Sequence`, models/ and engine/ the tensor-parallel group, layers/ the config).
Imports inside functions and under TYPE_CHECKING count: a layer that needs a type from above takes
a Protocol of its own (runner/step_plan.py's ScheduledTokens)."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "nanoserve"
# top to bottom; a module's place is its first name under nanoserve/ ("" = the package's __init__)
LAYERS = [{"", "llm", "server"}, {"client"}, {"engine"}, {"parallel"}, {"scheduler"}, {"kvcache"}, {"runner"}, {"models"}, {"layers", "kernels"},
          {"config", "errors", "outputs", "sampling_params", "sequence", "structured", "chat", "detokenizer",
           "distributed", "heap"}]
MAX_FILE_LINES, MAX_CLASS_LINES = 400, 250


def _modules() -> dict[str, Path]:
    return {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts): p for p in PACKAGE.rglob("*.py")}


def _layer(module: str) -> int:
    parts = module.split(".")
    name = "" if len(parts) == 1 or parts[1] == "__init__" else parts[1]
    found = [i for i, names in enumerate(LAYERS) if name in names]
    assert found, f"{module} has no place in the layer order: give it one in {__file__}"
    return found[0]


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: relative import (the layer check reads absolute ones)"
            out.append((node.lineno, node.module or ""))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
    return [(line, m) for line, m in out if m == "nanoserve" or m.startswith("nanoserve.")]


def test_no_module_imports_from_a_layer_above_its_own():
    modules = _modules()
    assert len(modules) > 40 and "nanoserve.runner.model_runner" in modules  # the walk found the package
    upward = [f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}"
              for module, path in sorted(modules.items()) for line, target in _imports(path)
              if _layer(target) < _layer(module)]
    assert upward == []


def test_the_checker_sees_an_upward_import(tmp_path):
    """The control: the same reading flags a runner module that imports the scheduler."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from nanoserve.scheduler import ScheduledSeq\n")
    assert [_layer(m) for _, m in _imports(bad)] == [_layer("nanoserve.scheduler")]
    assert _layer("nanoserve.scheduler") < _layer("nanoserve.runner.model_runner")


def test_no_file_or_class_is_longer_than_a_reader_can_hold():
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        name = path.relative_to(PACKAGE).as_posix()
        if (n := len(source.splitlines())) > MAX_FILE_LINES:
            too_long.append(f"{name}: {n} lines")
        too_long += [f"{name}: class {c.name}, {c.end_lineno - c.lineno + 1} lines"
                     for c in ast.walk(ast.parse(source)) if isinstance(c, ast.ClassDef)
                     and c.end_lineno - c.lineno + 1 > MAX_CLASS_LINES]
    assert too_long == []
