"""deepspeed.initialize for the job's engines, without the start-up cost of an optimizer the job does not use.

ZeRO's set-up imports DeepSpeed's Muon optimizer module (stage3.py, zero/utils.py: `from
deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam`) only to ask whether the optimizer is one; that
import runs `torch.compile` on Muon's update functions at module level, 1.35 s of CPU per rank start on 2 cores
(torch 2.13, DeepSpeed 0.19.8; a 2-rank CPU run of the tiny model spends 15 CPU-s in all). Where the engine's
optimizer is not Muon (the job's own AdamW, or a config optimizer of another type), a stand-in module answers
that question during the call: its MuonWithAuxAdam is a class no optimizer is an instance of, and any other name
asked of it imports the real module. The stand-in is gone after the call, so a later import finds the real one.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types

MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


class _NotMuon:
    """What ZeRO's isinstance(optimizer, MuonWithAuxAdam) meets while the stand-in is in place: nothing is one."""


class _MuonStandIn(types.ModuleType):
    MuonWithAuxAdam = _NotMuon

    def __getattr__(self, name):  # a name DeepSpeed may ask of a later version: the real module's
        if name.startswith("__"):  # the import system's questions (__path__: is it a package?)
            raise AttributeError(name)
        if sys.modules.get(self.__name__) is self:
            del sys.modules[self.__name__]
        return getattr(importlib.import_module(self.__name__), name)


def uses_muon(config: dict) -> bool:
    """Whether DeepSpeed builds its Muon optimizer from `config` (a DeepSpeed config dict): an optimizer of type muon.
    A client optimizer that is DeepSpeed's Muon was made from the real module, which is then loaded already."""
    return str(config.get("optimizer", {}).get("type", "")).lower() == "muon"


@contextlib.contextmanager
def without_muon_import(config: dict):
    """The stand-in for the block where `config` asks for no Muon and the real module is not loaded yet."""
    if uses_muon(config) or MUON_MODULE in sys.modules:
        yield
        return
    stand_in = _MuonStandIn(MUON_MODULE)
    sys.modules[MUON_MODULE] = stand_in
    try:
        yield
    finally:
        if sys.modules.get(MUON_MODULE) is stand_in:
            del sys.modules[MUON_MODULE]


def deepspeed_initialize(*, config: dict, optimizer=None, **kwargs):
    """deepspeed.initialize(config=config, optimizer=optimizer, **kwargs), without Muon's import where unused."""
    import deepspeed

    with without_muon_import(config):
        return deepspeed.initialize(config=config, optimizer=optimizer, **kwargs)
