"""``tools/docs_tables.py`` (a developer tool, not an installed module) loaded for the tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def docs_tables() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_tables", ROOT / "tools" / "docs_tables.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
