"""The site's build hooks (docs/hooks/*.py) loaded as MkDocs loads them: by file, registered under their name."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from tests.support.paths import ROOT

HOOKS = ROOT / "docs" / "hooks"


def load_hook(name: str) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, HOOKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
