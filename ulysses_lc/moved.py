"""The import paths of the flat layout (before 2026-12-01) keep working: `ulysses_lc.exchange` is `ulysses_lc.parallel.exchange`.

Each old name is an alias, not a copy: `import ulysses_lc.yarn` hands back the module object of `ulysses_lc.levers.yarn`,
so a patch, a registry or a pickled class reached by either path is the same one. Aliases load on first import only
(the integrations pull in transformers' Trainer; an unused alias costs nothing).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

GROUPS = {
    "parallel": ("distributed", "layout", "sharding", "exchange", "zero_reshard", "ds_config"),
    "mixers": ("attention", "kernels", "explicit_attention", "window_attention", "linear_attention", "fallbacks"),
    "levers": ("chunked_loss", "checkpointing", "host_pool", "tiled_mlp", "rmsnorm", "yarn"),
    "objectives": ("loss", "preference"),
    "plan": ("memory", "memory_model", "sizing", "metrics"),
    "integrations": ("hf_trainer", "hf_dpo", "trainer_engine"),
}
MOVED = {f"ulysses_lc.{name}": f"ulysses_lc.{group}.{name}" for group, names in GROUPS.items() for name in names}


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `ulysses_lc.<old name>` and loads it as the module at its new path."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module):
        pass  # the module ran under its new name already


def install() -> None:
    """Put the finder on sys.meta_path once (the package's __init__ calls it)."""
    if not any(isinstance(f, _OldPaths) for f in sys.meta_path):
        sys.meta_path.append(_OldPaths())
