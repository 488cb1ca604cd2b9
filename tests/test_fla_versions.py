"""`pip install 'ulysses_lc[fla]'` resolves to a Triton whose fla gated backward runs on Hopper, and where an older torch
stays installed the start-up block names the torch and Triton to install (plan/deltanet_time.py,
mixers/linear_attention.py; BENCHMARKS.md "fla's backward over Triton 3.7.1").
"""

from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

from ulysses_lc.mixers import linear_attention
from ulysses_lc.plan import deltanet_time

# The Triton each torch's Linux wheels pin (their requires_dist on PyPI, read 2026-12-03).
TORCH_TRITON = {"2.11.0": "3.6.0", "2.12.0": "3.7.0", "2.12.1": "3.7.1", "2.13.0": "3.7.1", "2.14.0": "3.8.0"}


def test_the_fla_extra_pins_a_torch_whose_triton_fla_trusts_on_hopper():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+; the package itself runs on 3.10
    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
    extra = [Requirement(r) for r in project["optional-dependencies"]["fla"]]
    base = next(Requirement(r) for r in project["dependencies"] if r.startswith("torch"))
    allowed = [t for t in TORCH_TRITON if Version(t) in base.specifier
               and all(Version(t) in r.specifier for r in extra if r.name == "torch")]
    assert allowed, "the extra leaves no torch the package supports"
    low, high = deltanet_time.FLA_REFUSED_TRITON
    refused = [t for t in allowed if Version(low) <= Version(TORCH_TRITON[t]) < Version(high)]
    assert not refused, f"pip may resolve torch {refused}, whose Triton fla refuses on Hopper"
    assert min(allowed, key=Version) == linear_attention.FLA_TORCH  # the line below names the floor the extra sets


def test_an_older_triton_is_named_with_the_versions_to_install(monkeypatch):
    monkeypatch.setattr(deltanet_time.util, "find_spec", lambda name: object())
    monkeypatch.setattr(deltanet_time, "_triton_version", lambda: "3.6.0")
    path, why = deltanet_time.deltanet_path()
    assert path == "torch"
    assert "Triton 3.6.0; install torch >= 2.12.1 (it brings Triton >= 3.7.1): pip install 'ulysses_lc[fla]'" in why
    # On the GPU: the probe's refusal, the same fix on the start-up block's layers line.
    monkeypatch.setattr(linear_attention, "_fla_ops", lambda: (None, None))
    monkeypatch.setattr(linear_attention, "_fla_probe", lambda index: "Triton >= 3.4.0 and < 3.7.1 on Hopper (#640)")
    kernel, why = linear_attention.resolve_deltanet_kernel("auto", torch.device("cuda", 0))
    assert kernel == "torch" and "install torch >= 2.12.1" in why and "ulysses_lc[fla]" in why
    with pytest.raises(ValueError, match=r"install torch >= 2\.12\.1"):
        linear_attention.resolve_deltanet_kernel("fla", torch.device("cuda", 0))
