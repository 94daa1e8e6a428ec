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
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "nanoserve"
# top to bottom; a module's place is its first name under nanoserve/ ("" = the package's __init__)
LAYERS = [{"", "llm", "server"}, {"client"}, {"engine"}, {"parallel"}, {"scheduler"}, {"kvcache"}, {"runner"},
          {"models"}, {"layers", "kernels"},
          {"config", "errors", "outputs", "sampling_params", "sequence", "structured", "chat", "detokenizer",
           "distributed", "heap"}]
MAX_FILE_LINES, MAX_CLASS_LINES, MAX_FUNCTION_LINES = 400, 250, 60
SLACK = 10  # a class this close to its cap was squeezed under it: split it by responsibility


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
            assert node.level == 0, (f"{path}:{node.lineno}: relative import "
                                     "(the layer check reads absolute ones)")
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


def test_no_file_class_or_function_is_longer_than_a_reader_can_hold():
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        name = path.relative_to(PACKAGE).as_posix()
        if (n := len(source.splitlines())) > MAX_FILE_LINES:
            too_long.append(f"{name}: {n} lines")
        for node in ast.walk(ast.parse(source)):
            lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.ClassDef) and lines > MAX_CLASS_LINES - SLACK:
                too_long.append(f"{name}: class {node.name}, {lines} lines")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and lines > MAX_FUNCTION_LINES:
                too_long.append(f"{name}: {node.name}(), {lines} lines")
    assert too_long == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of a module graph (Tarjan's strongly connected components of more than one)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (`from package import module` names the module)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nanoserve"):
                names = [f"{node.module}.{a.name}" for a in node.names]
                targets |= {n for n in names if n in modules} or {node.module}
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name.startswith("nanoserve")}
        graph[module] = {t if t in modules else f"{t}.__init__" for t in targets} - {module}
    return graph


def test_no_modules_import_each_other_in_a_circle():
    assert _cycles(_import_graph()) == []
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the control


CSRC = PACKAGE / "kernels" / "csrc"
MAX_CPP_FILE_LINES, MAX_CPP_FUNCTION_LINES = 600, 80


def _cpp_functions(source: str) -> list[tuple[str, int]]:
    """(name, lines) of each function of a C++ source, from its signature (template line included) to its
    closing brace: a body opened at namespace or class scope by a declaration with a parameter list, whatever
    it holds (blocks, lambdas). Comments, literals and preprocessor lines are blanked first, so each branch
    of an #if must balance its own braces."""
    blank = lambda m: re.sub(r"[^\n]", " ", m.group())  # noqa: E731 - keeps every line in its place
    text = re.sub(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', blank, source, flags=re.S)
    text = re.sub(r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", blank, text, flags=re.M)
    scopes: list[tuple[str, str, int]] = []  # (kind, name, first line) of each open brace
    found, head_start = [], 0
    for i, ch in enumerate(text):
        if ch not in ";{}":
            continue
        if ch == "{" and (not scopes or scopes[-1][0] in ("namespace", "class")):
            head = text[head_start:i]
            words = set(re.findall(r"\w+", head.split("(")[0]))
            kind = ("namespace" if words & {"namespace", "extern"}
                    else "class" if words & {"class", "struct", "union"} and "(" not in head
                    else "function" if "(" in head and not head.rstrip().endswith("=") else "other")
            name = [n for n in re.findall(r"(\w+)\s*\(", head) if n != "__attribute__"][:1] or ["?"]
            scopes.append((kind, name[0], text.count("\n", 0, i - len(head.lstrip())) + 1))
        elif ch == "{":
            scopes.append(("block", "", 0))
        elif ch == "}":
            kind, name, first = scopes.pop()
            if kind == "function":
                found.append((name, text.count("\n", 0, i) + 2 - first))
        if not scopes or scopes[-1][0] in ("namespace", "class"):  # a declaration at this scope ends here
            head_start = i + 1
    assert not scopes, "unbalanced braces"
    return found


def test_no_cpp_file_or_function_is_longer_than_a_reader_can_hold():
    control = ("namespace {\ntemplate <int N>\nint f() {  // {\n  auto g = [] {\n    return 1;\n  };\n"
               "  return g();\n}\n"
               "struct S { int k[2] = {1, 2}; void m() const {} };\n}  // namespace\n#define OPEN {\n"
               "__attribute__((noinline)) void h(int) { m.def(\"}\", f); }\n")
    assert _cpp_functions(control) == [("f", 7), ("m", 1), ("h", 1)]  # the control: f from its template line
    files = sorted([*CSRC.glob("*.cpp"), *CSRC.glob("*.h")])
    assert len(files) > 5  # the walk found the sources
    too_long = []
    for path in files:
        source = path.read_text()
        if (n := len(source.splitlines())) > MAX_CPP_FILE_LINES:
            too_long.append(f"{path.name}: {n} lines")
        too_long += [f"{path.name}: {name}(), {lines} lines" for name, lines in _cpp_functions(source)
                     if lines > MAX_CPP_FUNCTION_LINES]
    assert too_long == []
