"""The package's floor plan (docs/architecture.md, "Floors"): every import inside grpo_ext goes down a floor, never up
or sideways, so that a module can be read knowing only the floors below it. Read from the source with ``ast`` (the
imports inside functions count too)."""

from __future__ import annotations

import ast
from pathlib import Path

import grpo_ext.ops.options
import grpo_ext.validation.options

PACKAGE = Path(grpo_ext.validation.options.__file__).resolve().parents[1]

#: Lowest first. A unit is a top-level module or subpackage of grpo_ext (``__init__``: the package's facade).
FLOORS: tuple[tuple[str, ...], ...] = (
    ("_build_config", "validation"),  # the checks and the option tables (the contract's vocabulary)
    ("_native", "results"),  # the native libraries; the result types
    ("ops", "reference"),  # the kernels' wrappers, and the float64 oracle beside them (not on them)
    ("nn",),  # the Liger-shaped module on the ops
    ("integrations", "trainer"),  # TRL, verl; the training layer
    ("__init__", "__main__"),  # the package's facade; `python -m grpo_ext`, the grpo-ext command
)
FLOOR_OF = {unit: floor for floor, units in enumerate(FLOORS) for unit in units}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def package_imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every grpo_ext module (or name in one) that ``path`` imports."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.split(".")[0] == "grpo_ext"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target.split(".")[0] != "grpo_ext":
                continue
            # `from . import ops` names a module; `from .ops import grpo_loss` a name inside one
            found += [(node.lineno, target if node.module else f"{target}.{alias.name}") for alias in node.names]
    return found


def test_every_unit_has_a_floor():
    units = {unit_of(module_name(p)) for p in PACKAGE.rglob("*.py")}
    assert units <= set(FLOOR_OF), f"give these a floor in FLOORS: {sorted(units - set(FLOOR_OF))}"


def test_no_import_runs_up_or_sideways():
    """Issue 40 item 6: the validation modules imported ops/options.py while every op imported them back; the
    trainer and the verl plug-in imported the package's facade (``import grpo_ext``) that imports them."""
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        unit = unit_of(module_name(path))
        for line, target in package_imports(path):
            other = unit_of(target)
            if other != unit and FLOOR_OF[other] >= FLOOR_OF[unit]:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {unit} (floor {FLOOR_OF[unit]}) imports "
                             f"{target} (floor {FLOOR_OF[other]})")  # fmt: skip
    assert not wrong, "\n".join(wrong)


def test_the_option_tables_import_nothing_of_the_package():
    """The contract's vocabulary sits at the bottom: the checks, the ops and the reference import it."""
    assert package_imports(Path(grpo_ext.validation.options.__file__)) == []


def test_the_old_public_path_of_the_options_is_the_same_objects():
    """``grpo_ext.ops.options`` stays importable for users: every public name it had is the very same object."""
    moved = [n for n in vars(grpo_ext.validation.options) if not n.startswith("_")]
    for name in moved:
        assert getattr(grpo_ext.ops.options, name) is getattr(grpo_ext.validation.options, name), name
    for name in ("metrics_dict", "NUM_METRICS", "METRIC_KL"):  # the native metrics vector, now in ops/metrics.py
        assert getattr(grpo_ext.ops.options, name) is getattr(grpo_ext.ops.metrics, name), name
