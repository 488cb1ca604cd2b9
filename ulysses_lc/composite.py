"""Published multimodal checkpoints (`*ForConditionalGeneration`): the language model inside them is what trains.

Qwen3.5 (dense and MoE) and Gemma 3 4B / 12B / 27B are published as one checkpoint holding a vision tower, a
projector and a language model, the text model's settings under `config.text_config` (`shape.text_config` reads
them, for a text-only config as for these). ulysses_lc loads such a checkpoint with its own class (`model_class`), so
that from_pretrained reads the checkpoint's own layout in every transformers version and `save_pretrained` writes it
back; it trains the decoder and the LM head (`language_model`, a *ForCausalLM-shaped view of them that the levers act
on), and freezes the rest (`freeze_outside_language_model`): the vision tower never runs on text, so it would take no
gradient, but AdamW's weight decay (in ZeRO-3's flat partitions) would still move it. Frozen, it takes no gradient and
no optimizer state, and is saved as it was loaded, so the export is the checkpoint the user started from, with the
trained text weights in it.

The export (`save_in_source_layout`) writes the trained weights into a copy of the source checkpoint's own safetensors
files, each under the name it has there, and every other tensor as its bytes were: the vision tower, the projector and
what transformers does not load at all (Qwen3.5's multi-token-prediction layers) come back byte-identical, in any
dtype the run trained in. `save_pretrained` is no substitute: a model loaded under ZeRO-3 saves the language model
under a doubled prefix (transformers 5.24's DeepSpeed path keeps every conversion of the model type, not the ones the
checkpoint needed), and it drops the tensors it did not load.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
import torch.nn as nn

from .shape import text_config

logger = logging.getLogger(__name__)
WEIGHTS_INDEX = "model.safetensors.index.json"


def is_composite(config) -> bool:
    """Whether `config` nests its text model's config (a multimodal checkpoint's)."""
    return text_config(config) is not config


def model_class(config):
    """The transformers Auto class that builds and loads checkpoints of `config`: AutoModelForCausalLM for a text
    model, AutoModelForImageTextToText (the checkpoint's own *ForConditionalGeneration) for a multimodal one.

    AutoModelForCausalLM is not used for the latter: for some families (Qwen3.5) it loads the text model alone and
    drops the vision tower, for others (Gemma 3) it loads the whole model; either way the user would not get back
    the checkpoint they started from."""
    import transformers

    if not is_composite(config):
        return transformers.AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    if config.model_type not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        raise ValueError(
            f"{type(config).__name__} ({config.model_type}) nests a text model but is no image-text-to-text model "
            "transformers knows, so ulysses_lc cannot tell which of its weights are the language model. Save the "
            "language model alone as a *ForCausalLM folder and pass that.")
    return transformers.AutoModelForImageTextToText


class LanguageModel(nn.Module):
    """The decoder and LM head of a *ForConditionalGeneration, laid out as a *ForCausalLM (`.model`, `.config`,
    `.base_model`, the output embeddings): what every lever and the wrapper's forward act on.

    The head is read and replaced through the whole model, so a replaced head (the chunked loss) sits where ZeRO-3
    registered its hooks and where `save_pretrained` finds it. The whole model is held outside the module tree, so
    this view's parameters are the decoder's alone."""

    def __init__(self, composite: nn.Module):
        super().__init__()
        decoder = composite.get_decoder()
        if decoder is composite or not isinstance(getattr(decoder, "layers", None), nn.ModuleList):
            raise ValueError(f"{type(composite).__name__} has no language model with decoder layers where "
                             "get_decoder() looks (model.language_model); ulysses_lc cannot find what to train.")
        self.model = decoder
        self.config = decoder.config
        self.__dict__["composite"] = composite  # not a submodule: the vision tower stays out of this view

    @property
    def base_model(self) -> nn.Module:
        return self.model

    def get_output_embeddings(self) -> nn.Module:
        return self.composite.get_output_embeddings()

    def set_output_embeddings(self, head: nn.Module) -> None:
        self.composite.set_output_embeddings(head)

    def set_attn_implementation(self, name: str) -> None:
        self.model.set_attn_implementation(name)  # the text model's config only: the vision tower keeps its own


def language_model(model: nn.Module) -> nn.Module:
    """What trains: `model` itself for a *ForCausalLM, its `LanguageModel` view for a multimodal model (one view per
    model, so every lever and the forward see the same one)."""
    if not is_composite(model.config):
        return model
    view = model.__dict__.get("_ulysses_language_model")
    if view is None:
        view = model.__dict__["_ulysses_language_model"] = LanguageModel(model)
    return view


def freeze_outside_language_model(model: nn.Module) -> int:
    """Set requires_grad=False on every parameter of a multimodal `model` outside its decoder and LM head (the vision
    tower, the projector); returns how many parameters that froze (0 for a text model)."""
    if not is_composite(model.config):
        return 0
    lm = language_model(model)
    trained = {id(p) for p in lm.parameters()} | {id(p) for p in lm.get_output_embeddings().parameters()}
    frozen = [p for p in model.parameters() if id(p) not in trained]
    for p in frozen:
        p.requires_grad_(False)
    return sum(getattr(p, "ds_numel", p.numel()) for p in frozen)


def language_model_params(model: nn.Module) -> int:
    """Parameters of the language model (decoder and LM head, each counted once): what a full fine-tune of a
    multimodal model trains."""
    lm = language_model(model)
    params = {id(p): p for p in list(lm.parameters()) + list(lm.get_output_embeddings().parameters())}
    return sum(getattr(p, "ds_numel", p.numel()) for p in params.values())


def meta_model(config) -> nn.Module:
    """The model `config` builds (`model_class`), on the meta device: its parameters' names and sizes, no memory.
    Built with transformers' ZeRO-3 switch off for the call (a Trainer's HfDeepSpeedConfig would put it under
    zero.Init, which initialises weights it cannot hold)."""
    from transformers.integrations import deepspeed as hf_deepspeed

    held = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        with torch.device("meta"):
            return model_class(config).from_config(config)
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = held


def count_language_model_params(config) -> int:
    """`language_model_params` of the model `config` builds, counted on the meta device (no memory, no weights)."""
    return language_model_params(meta_model(config))


def source_folder(name_or_path: str) -> Path | None:
    """The folder holding checkpoint `name_or_path`: the path itself, or its snapshot in the Hugging Face cache
    (from_pretrained put it there); None where neither holds it."""
    if Path(name_or_path).is_dir():
        return Path(name_or_path)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name_or_path, local_files_only=True))
    except Exception:  # noqa: BLE001 - any failure to find it means the same: no source files to copy
        return None


def _weight_files(folder: Path) -> list[Path]:
    index = folder / WEIGHTS_INDEX
    if index.is_file():
        return [folder / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [folder / "model.safetensors"] if (folder / "model.safetensors").is_file() else []


def _trained_source_names(model: nn.Module, state: dict) -> dict:
    """The language model's weights of `state` (plain names: no lever's wrapper in them) under the names a checkpoint
    of the model's class stores them: transformers' own renaming on save, for a fresh model of the class (the
    conversions of a ZeRO-3 load are not the checkpoint's: module docstring)."""
    from transformers.core_model_loading import revert_weight_conversion

    fresh = meta_model(model.config)
    lm = language_model(fresh)
    ids = {id(p) for p in list(lm.parameters()) + list(lm.get_output_embeddings().parameters())}
    # named_parameters names a tied head once, by the embedding's name, as the source stores it
    names = [name for name, p in fresh.named_parameters() if id(p) in ids]
    return revert_weight_conversion(fresh, {name: state[name] for name in names})


def save_in_source_layout(model: nn.Module, state: dict, export_dir: Path) -> None:
    """Save multimodal `model` to `export_dir` from `state` (every weight, full tensors on the host, the plain model's
    names): the source checkpoint's (`config.name_or_path`) safetensors files copied tensor by tensor, each language
    model weight replaced by its trained value under its name there, the rest as they were; its config (with YaRN),
    and the source's other files (processor, chat template). Where the source has no safetensors files or names the
    weights otherwise, the model's own save_pretrained of `state`, with a warning."""
    export_dir = Path(export_dir)
    source = source_folder(model.config.name_or_path)
    files = _weight_files(source) if source is not None else []
    trained = _trained_source_names(model, state) if files else {}
    stored = set()
    for path in files:
        from safetensors import safe_open

        with safe_open(path, "pt") as f:
            stored.update(f.keys())
    if not files or not trained.keys() <= stored:
        logger.warning("the export of %s is transformers' save_pretrained, not a copy of the source's files (%s): "
                       "the weights it did not train are written as loaded", type(model).__name__,
                       "none found" if not files else f"{sorted(trained.keys() - stored)[:3]} are not in them")
        model.save_pretrained(export_dir, state_dict=state)
        return
    _write_copies(source, files, trained, export_dir)
    model.config.save_pretrained(export_dir)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(export_dir)


def save_model(model: nn.Module, state: dict, export_dir: Path) -> None:
    """`model.save_pretrained(export_dir, state_dict=state)`; a multimodal model (not a PeftModel, whose save writes
    its adapters) into a copy of its source checkpoint's files (`save_in_source_layout`)."""
    if is_composite(model.config) and not hasattr(model, "peft_config"):
        save_in_source_layout(model, state, export_dir)
    else:
        model.save_pretrained(export_dir, state_dict=state)


def _write_copies(source: Path, files: list[Path], trained: dict, export_dir: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    export_dir.mkdir(parents=True, exist_ok=True)
    total = 0
    for path in files:  # one shard at a time: the host holds one source shard, not the model
        with safe_open(path, "pt") as f:
            tensors = {k: trained[k].contiguous() if k in trained else f.get_tensor(k) for k in f.keys()}
            metadata = f.metadata()
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, export_dir / path.name, metadata=metadata)
    if (source / WEIGHTS_INDEX).is_file():
        index = json.loads((source / WEIGHTS_INDEX).read_text())
        index.setdefault("metadata", {})["total_size"] = total  # the trained dtype may differ from the source's
        (export_dir / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    written = {p.name for p in files} | {WEIGHTS_INDEX, "config.json", "generation_config.json"}
    for path in source.iterdir():  # the processor's and tokenizer's files (the run's tokenizer is saved after)
        if (path.is_file() and path.name not in written and not path.name.startswith(".")
                and path.suffix not in (".safetensors", ".bin", ".pt", ".pth")):
            shutil.copy(path, export_dir / path.name)


__all__ = ["LanguageModel", "count_language_model_params", "freeze_outside_language_model", "is_composite",
           "language_model", "language_model_params", "meta_model", "model_class", "save_in_source_layout", "save_model",
           "source_folder"]
