"""The floors of src/fastllm: each subpackage (room) is a floor, and a module
imports only from its own room or from rooms on lower floors; no import sits
inside a function except the few listed below with their reason. Read from
the source with ast (nothing is imported), .pyx files by their import lines.

A new subpackage must be given its floor in FLOORS; a new function-level
import fails here until it is hoisted to module level or listed.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "fastllm"

# Lowest first. "" is fastllm itself (__init__, __main__): the public face,
# above everything.
FLOORS = ["spec", "core", "formats", "load", "tokenizer", "generate", "serve", "cli", ""]

# Imports inside functions that stay, and why: (module, imported module).
ALLOWED_LOCAL = {
    ("fastllm.core._openmp", "fastllm.core._core"):
        "the OpenMP wait policy is set in the environment before the extension loads",
    ("fastllm.tokenizer.normalizers", "fastllm.tokenizer.precompiled"):
        "precompiled builds on normalizers._Rewrite (a cycle inside the room)",
    ("fastllm.tokenizer", "fastllm.tokenizer.chat_template"):
        "jinja2 loads at the first conversation rendered, not in every process that generates",
}
# Third-party (or platform) modules that may be imported inside a function, and
# standard ones too heavy to load in every process.
OPTIONAL = {
    "gguf": "llama.cpp's package: slow to import, needed only to convert or write GGUF files",
    "llguidance": "optional (structured output)",
    "starlette": "optional (fastllm serve)",
    "uvicorn": "optional (fastllm serve)",
    "huggingface_hub": "optional (models by Hugging Face repo id)",
    "ray": "optional (Ray Serve replicas)",
    "readline": "absent on Windows; only for the interactive prompt",
    "asyncio": "standard, but it loads ssl and subprocess: only an asyncio program iterating a request needs it",
}


def module_name(path: Path, package_dir: Path) -> str:
    parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in FLOORS) else ""


def is_module(name: str, package_dir: Path) -> bool:
    rel = Path(*name.split(".")[1:]) if "." in name else Path()
    base = package_dir / rel
    return base.is_dir() or any(base.with_suffix(s).exists() for s in (".py", ".pyx", ".pxd"))


def imports(path: Path, package_dir: Path):
    """(line, imported module, inside a function, guarded by except ImportError) of a file."""
    module = module_name(path, package_dir)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    if path.suffix in (".pyx", ".pxd"):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            m = re.match(r"\s*from (fastllm[\w.]*) c?import (\w+)", line)
            if m:
                full = f"{m.group(1)}.{m.group(2)}"
                yield i, full if is_module(full, package_dir) else m.group(1), line[:1].isspace(), False
        return
    tree = ast.parse(path.read_text())

    def walk(node, in_function, guarded):
        for field, value in ast.iter_fields(node):
            for child in value if isinstance(value, list) else [value]:
                if not isinstance(child, ast.AST):
                    continue
                g = guarded or (isinstance(node, ast.Try) and field == "body" and any(
                    h.type is not None and {"ImportError", "ModuleNotFoundError"} & {
                        x.id for x in ast.walk(h.type) if isinstance(x, ast.Name)} for h in node.handlers))
                if isinstance(child, ast.Import):
                    for a in child.names:
                        yield child.lineno, a.name, in_function, g
                elif isinstance(child, ast.ImportFrom):
                    if child.level:
                        base = package.split(".")[:len(package.split(".")) - child.level + 1]
                        target = ".".join(base + ([child.module] if child.module else []))
                    else:
                        target = child.module
                    for a in child.names:
                        full = f"{target}.{a.name}"
                        yield (child.lineno, full if target.startswith("fastllm") and is_module(full, package_dir)
                               else target, in_function, g)
                f = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                yield from walk(child, f, g)
    yield from walk(tree, False, False)


def sources(package_dir: Path):
    return sorted(p for p in package_dir.rglob("*") if p.suffix in (".py", ".pyx", ".pxd")
                  and "__pycache__" not in p.parts)


def problems(package_dir: Path = PACKAGE) -> list:
    found = []
    for path in sources(package_dir):
        module = module_name(path, package_dir)
        here = room(module)
        rel = path.relative_to(package_dir.parent.parent).as_posix()
        if here not in FLOORS:
            found.append(f"{rel}: room {here!r} has no floor in FLOORS")
            continue
        for line, target, in_function, guarded in imports(path, package_dir):
            internal = target == "fastllm" or target.startswith("fastllm.")
            if internal:
                there = room(target)
                if there not in FLOORS:
                    found.append(f"{rel}:{line}: imports {target}, in a room with no floor")
                elif FLOORS.index(there) > FLOORS.index(here):
                    found.append(f"{rel}:{line}: imports {target} ({there or 'fastllm'}, a higher floor than "
                                 f"{here or 'fastllm'})")
                if in_function and (module, target) not in ALLOWED_LOCAL:
                    found.append(f"{rel}:{line}: imports {target} inside a function")
            elif in_function and target.split(".")[0] not in OPTIONAL:
                found.append(f"{rel}:{line}: imports {target} inside a function (not an optional dependency)")
    return found


def test_no_import_points_up_a_floor_and_none_hides_in_a_function():
    assert problems() == []


def test_every_room_has_its_floor():
    rooms = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert rooms <= set(FLOORS), rooms - set(FLOORS)


def test_allowed_function_level_imports_are_still_there():
    """A listed exception that is gone is taken off the list."""
    seen = set()
    for path in sources(PACKAGE):
        module = module_name(path, PACKAGE)
        seen |= {(module, t) for _, t, f, _ in imports(path, PACKAGE) if f}
    assert set(ALLOWED_LOCAL) <= seen, set(ALLOWED_LOCAL) - seen


def test_the_check_sees_an_import_up_and_one_in_a_function(tmp_path):
    pkg = tmp_path / "src" / "fastllm"
    for room_name in ("spec", "serve"):
        (pkg / room_name).mkdir(parents=True)
        (pkg / room_name / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "serve" / "engine.py").write_text("X = 1\n")
    (pkg / "spec" / "config.py").write_text(
        "from ..serve import engine\n\ndef f():\n    import json\n    from . import config\n")
    found = problems(pkg)
    assert any("config.py:1: imports fastllm.serve.engine" in p for p in found), found
    assert any("config.py:4: imports json inside a function" in p for p in found), found
    assert any("config.py:5: imports fastllm.spec.config inside a function" in p for p in found), found
