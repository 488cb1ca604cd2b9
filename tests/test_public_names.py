"""Every name that README.md and examples/ import still imports, and the flat paths of before the layout still work.

The package moved its modules into subpackages (parallel/, mixers/, levers/, objectives/, plan/, integrations/) on
2026-12-01. User code written against the names documented before keeps running: each of them is listed here, from
the path it was documented at then, and each name the README and examples import today is read from their text.
"""

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# What README.md and examples/ imported before the move (2026-12-01, main 57e1866): the old paths stay good.
DOCUMENTED_BEFORE = [
    ("ulysses_lc", "ParallelLayout"),
    ("ulysses_lc", "SequenceParallelCausalLM"),
    ("ulysses_lc", "apply_yarn"),
    ("ulysses_lc", "build_token_stream"),
    ("ulysses_lc", "check_deepspeed_config"),
    ("ulysses_lc", "load_deepspeed_config"),
    ("ulysses_lc", "load_model_for_length"),
    ("ulysses_lc", "shard_batch"),
    ("ulysses_lc.distributed", "destroy_distributed"),
    ("ulysses_lc.distributed", "init_distributed"),
    ("ulysses_lc.hf_trainer", "UlyssesSFTTrainer"),
    ("ulysses_lc.hf_trainer", "UlyssesTrainer"),
    ("ulysses_lc.hf_trainer", "ulysses_trainer"),
    ("ulysses_lc.peft_support", "lora_config"),
    ("ulysses_lc.tiny", "tiny_model_config"),
    ("ulysses_lc.tiny", "tiny_text"),
    ("ulysses_lc.tiny", "tiny_tokenizer"),
    ("ulysses_lc.train", "main"),
    ("ulysses_lc.train.console", "quiet_warnings"),
]


def documented_now() -> list[tuple[str, str]]:
    """(module, name) for each `from ulysses_lc... import name` in examples/*.py and the python blocks of README.md
    and docs/."""
    sources = [(f.name, f.read_text()) for f in sorted((ROOT / "examples").glob("*.py"))]
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
        sources += [(f"{page.name} block {i}", b) for i, b in enumerate(blocks)]
    found = set()
    for where, text in sources:
        for node in ast.walk(ast.parse(text, filename=where)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ulysses_lc":
                found.update((node.module, alias.name) for alias in node.names)
    return sorted(found)


def test_the_documents_are_read():
    now = documented_now()
    assert ("ulysses_lc", "SequenceParallelCausalLM") in now and len(now) >= 10, now


@pytest.mark.parametrize("module,name", sorted(set(DOCUMENTED_BEFORE) | set(documented_now())))
def test_documented_name_imports(module, name):
    assert hasattr(importlib.import_module(module), name), f"`from {module} import {name}` fails"


def test_old_paths_are_the_same_modules():
    """An old path is an alias of the moved module, not a second copy (patches and registries stay one)."""
    from ulysses_lc.moved import MOVED

    for old, new in MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
    from ulysses_lc.exchange import seq_to_heads  # noqa: F401 (a from-import through the alias)
    from ulysses_lc.parallel import exchange

    assert sys.modules["ulysses_lc.exchange"] is exchange


def test_old_paths_in_a_fresh_interpreter():
    """The alias works as the first import of a process (nothing else loaded the new path before)."""
    code = "import ulysses_lc.yarn as y, ulysses_lc.levers.yarn as n; assert y is n; from ulysses_lc.memory import plan_memory"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
