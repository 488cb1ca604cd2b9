"""Model config, tokenizer and weights for a run: from the hub, a local folder, or the embedded tiny model.

The config is read first and alone (no weights), so that the SP split and YaRN are checked in seconds;
a failed read says whether the name or the network is wrong.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .config import TINY


def load_model_config(name: str):
    """The model's config (no weights), or a ValueError that says whether the name or the network is wrong."""
    if name == TINY:
        from ..tiny import tiny_model_config

        return tiny_model_config()
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise ValueError(_why_not_loadable(name, e)) from e


def _why_not_loadable(name: str, e: Exception) -> str:
    # transformers raises OSError for a bad name, a missing network and a broken folder alike; the text tells.
    text = str(e).lower()
    bad_name = "valid model identifier" in text or "repo id" in text or "repo_id" in text
    offline = os.environ.get("HF_HUB_OFFLINE") == "1" or "offline" in text or "connect" in text
    if Path(name).exists():
        why = f"the local path {name} holds no loadable model config ({e})"
    elif offline and not bad_name:
        why = f"no network and no local copy of {name} in the Hugging Face cache"
    else:
        why = f"{name} is not a model on the Hugging Face hub or a local folder ({type(e).__name__})"
    return (f"cannot load --model {name}: {why}. Pass a local model folder, or --model tiny to try the "
            "pipeline on the embedded tiny model.")


def load_tokenizer(name: str):
    """The model's tokenizer, or the embedded byte-level one for `tiny`."""
    if name == TINY:
        from ..tiny import tiny_tokenizer

        return tiny_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def load_model(name: str, config, dtype: torch.dtype, seed: int, device: torch.device, ds_config: dict,
               peft_config=None):
    """Weights for `config` (YaRN already applied to it): from the hub/local folder, or fresh for tiny; with
    `peft_config` (--lora-r), wrapped in a PeftModel whose adapters start from `seed` on every rank.

    Under ZeRO-3 a real model is loaded through transformers' DeepSpeed integration (zero.Init), so each
    rank only ever holds its partition: eight ranks of an 8B model do not each materialise 16 GB. The adapters
    are added while that integration is on, so peft gathers a partitioned weight where an adapter's init reads it.
    """
    from transformers import AutoModelForCausalLM

    def adapted(model):
        if peft_config is None:
            return model
        from ..peft_support import apply_peft

        torch.manual_seed(seed)
        return apply_peft(model, peft_config)

    if name == TINY:
        torch.manual_seed(seed)
        return adapted(AutoModelForCausalLM.from_config(config, dtype=dtype).to(device))
    if ds_config.get("zero_optimization", {}).get("stage") == 3:
        from transformers.integrations import HfDeepSpeedConfig

        # zero.Init reads only the ZeRO and precision settings; without our mpu DeepSpeed would size the batch by
        # the world size, so the batch keys are left for it to derive.
        init_config = {k: v for k, v in ds_config.items() if k != "train_batch_size"}
        zero3 = HfDeepSpeedConfig(init_config)  # must stay alive while from_pretrained and peft run
        model = adapted(AutoModelForCausalLM.from_pretrained(name, config=config, dtype=dtype))
        del zero3
        return model
    return adapted(AutoModelForCausalLM.from_pretrained(name, config=config, dtype=dtype).to(device))
