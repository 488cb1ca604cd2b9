"""Model config, tokenizer and weights for a run: from the hub, a local folder, or the embedded tiny model.

The config is read first and alone (no weights), so that the SP split and YaRN are checked in seconds;
a failed read says whether the name or the network is wrong. Whether the hub can be reached is asked once, in
seconds (`hub_offline`): offline, hub names are read from the local cache only, since huggingface_hub's own
retries take 25-40 s per rank to give up. `weights_digest` names the weights a name loads by their content, for
caches of what the model computes (the precomputed DPO reference).
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import os
import re
import socket
from pathlib import Path
from urllib.parse import urlparse

import torch

from ..tiny import TINY_MODELS

# The files from_pretrained reads weights from (a sharded checkpoint's index beside its shards).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
# A hub cache blob's name is its content hash: sha256 for LFS files, git's sha1 for small ones.
_HUB_BLOB = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
HUB_PROBE_S = 3.0  # a TCP connect to the hub (or the proxy) answers in well under a second where there is a route
LOCAL_ALTERNATIVES = ("--model ./folder (a local copy, e.g. `hf download NAME --local-dir ./folder` on a machine "
                      "with network) or --model tiny, and --data tiny (generated text) or a local .txt/.jsonl/.parquet "
                      "file or folder")


@functools.lru_cache(maxsize=None)
def hub_offline() -> str | None:
    """Why the Hugging Face hub cannot be reached from here ("HF_HUB_OFFLINE=1", "no route to huggingface.co:443"),
    or None where it can: HF_HUB_OFFLINE, else one TCP connect within HUB_PROBE_S to the hub's endpoint (or to the
    HTTPS proxy that reaches it)."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE"):
        return "HF_HUB_OFFLINE=1"
    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    target = urlparse(proxy if proxy and endpoint.scheme == "https" else endpoint.geturl())
    host, port = target.hostname, target.port or (443 if target.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=HUB_PROBE_S).close()
    except OSError as e:
        return f"no route to {host}:{port} ({e})"
    return None


def _hub_kwargs(name: str) -> dict:
    """from_pretrained's keywords for `name`: the local cache only where a hub name cannot be fetched."""
    return {"local_files_only": True} if not Path(name).exists() and hub_offline() else {}


def looks_local(name: str) -> bool:
    """Whether --model `name` can only mean a folder: ./x, ../x, /x, ~/x, or two separators (a hub name has one)."""
    return name.startswith(("./", "../", "/", "~")) or name.replace(os.sep, "/").count("/") >= 2


def _missing_folder(name: str) -> str:
    folder = Path(name).expanduser()
    parent = folder.absolute().parent
    near = [p.name for p in parent.iterdir() if p.is_dir()] if parent.is_dir() else []
    close = difflib.get_close_matches(folder.name, near, n=1)
    hint = (f"did you mean --model {os.path.join(os.path.dirname(name), close[0])}?" if close else
            "pass the folder that holds the model's config.json, a hub name (org/name), or tiny.")
    return f"--model {name}: no such folder ({folder.absolute()} does not exist); {hint}"


# The config.json of published checkpoints, as published (model_configs/SOURCES.md says where each was read), so a dry
# run sizes them without the hub: --dry-run needs the config alone. Package data: a wheel carries them.
SHIPPED_CONFIGS = Path(__file__).resolve().parent.parent / "model_configs"


def shipped_config(name: str) -> Path | None:
    """The folder of the config.json ulysses_lc ships for hub name `name` ("Qwen/Qwen3-8B"), or None."""
    folder = SHIPPED_CONFIGS / name.replace("/", "__")
    return folder if name.count("/") == 1 and (folder / "config.json").is_file() else None


def load_model_config(name: str):
    """The model's config (no weights), or a ValueError that says whether the name or the network is wrong."""
    return model_config_and_source(name)[0]


def model_config_and_source(name: str, dry_run: bool = False):
    """(the model's config, None) from the hub, its cache or a folder; for a dry run of a hub name that cannot be
    read, (the shipped config, a line saying so) where ulysses_lc ships one. ValueError as load_model_config."""
    if name in TINY_MODELS:
        from ..tiny import tiny_model_config

        return tiny_model_config(name), None
    if looks_local(name) and not Path(name).expanduser().exists():
        raise ValueError(_missing_folder(name))  # transformers would take it for a hub name: a hub or network error
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name, **_hub_kwargs(name)), None
    except (OSError, ValueError) as e:
        shipped = shipped_config(name) if dry_run and not Path(name).exists() else None
        if shipped is None:
            raise ValueError(_why_not_loadable(name, e, dry_run)) from e
        note = (f"the config.json of {name} shipped with ulysses_lc ({shipped}), as published: the hub could not be "
                f"read ({hub_offline() or type(e).__name__}), and a dry run needs no weights")
        return AutoConfig.from_pretrained(shipped), note


def _why_not_loadable(name: str, e: Exception, dry_run: bool = False) -> str:
    # transformers raises OSError for a bad name, a missing network and a broken folder alike; the text tells.
    text = str(e).lower()
    bad_name = "valid model identifier" in text or "repo id" in text or "repo_id" in text
    offline = hub_offline()
    if Path(name).exists():
        why = f"the local path {name} holds no loadable model config ({e})"
        return f"cannot load --model {name}: {why}. Pass a folder holding config.json, or --model tiny."
    if offline or (not bad_name and ("offline" in text or "connect" in text)):
        why = f"no network ({offline or 'the hub did not answer'}) and no local copy of {name} in the Hugging Face cache"
    else:
        why = f"{name} is not a model on the Hugging Face hub or a local folder ({type(e).__name__})"
    if dry_run:
        shipped = ", ".join(sorted(p.parent.name.replace("__", "/") for p in SHIPPED_CONFIGS.glob("*/config.json")))
        return (f"cannot load --model {name}: {why}. A dry run needs the config alone: pass --model ./folder, a folder "
                f"holding only the model's config.json (e.g. `hf download {name} config.json --local-dir ./folder` "
                f"on a machine with network). ulysses_lc ships the configs of {shipped} for dry runs without the hub.")
    return (f"cannot load --model {name}: {why}. Without the hub, pass "
            f"{LOCAL_ALTERNATIVES.replace('NAME', name)}.")


def load_tokenizer(name: str):
    """The model's tokenizer, or the embedded byte-level one for the embedded models."""
    if name in TINY_MODELS:
        from ..tiny import tiny_tokenizer

        return tiny_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name, **_hub_kwargs(name))


def load_model(name: str, config, dtype: torch.dtype, seed: int, device: torch.device, ds_config: dict,
               peft_config=None):
    """Weights for `config` (YaRN already applied to it): from the hub/local folder, or fresh for tiny; with
    `peft_config` (--lora-r), wrapped in a PeftModel whose adapters start from `seed` on every rank.

    Under ZeRO-3 a real model is loaded through transformers' DeepSpeed integration (zero.Init), so each
    rank only ever holds its partition: eight ranks of an 8B model do not each materialise 16 GB. The adapters
    are added while that integration is on, so peft gathers a partitioned weight where an adapter's init reads it.
    """
    from transformers import AutoModelForCausalLM

    from ..composite import model_class

    def adapted(model):
        if peft_config is None:
            return model
        from ..peft_support import apply_peft

        torch.manual_seed(seed)
        return apply_peft(model, peft_config)

    if name in TINY_MODELS:
        torch.manual_seed(seed)
        return adapted(AutoModelForCausalLM.from_config(config, dtype=dtype).to(device))
    auto = model_class(config)  # a multimodal checkpoint loads whole, with its own class (composite.py)
    if ds_config.get("zero_optimization", {}).get("stage") == 3:
        from transformers.integrations import HfDeepSpeedConfig

        # zero.Init reads only the ZeRO and precision settings; without our mpu DeepSpeed would size the batch by
        # the world size, so the batch keys are left for it to derive.
        init_config = {k: v for k, v in ds_config.items() if k != "train_batch_size"}
        zero3 = HfDeepSpeedConfig(init_config)  # must stay alive while from_pretrained and peft run
        # use_kernels=False: transformers 5.25 kernelizes by default (hub kernels, fetched, in place of the layers the
        # levers patch); SequenceParallelCausalLM would undo it, but not fetch it first.
        model = adapted(auto.from_pretrained(name, config=config, dtype=dtype, use_kernels=False, **_hub_kwargs(name)))
        del zero3
        return model
    return adapted(auto.from_pretrained(name, config=config, dtype=dtype, use_kernels=False, **_hub_kwargs(name)).to(device))


def weights_digest(name: str, seed: int, memo_dir: Path | None = None) -> str:
    """A sha256 over the content of the weights `name` loads, so that a cache of the model's outputs is never read
    for other weights (a folder overwritten by a later export keeps its name, not its digest).

    tiny: the name and seed, which draw its weights. A folder, or the hub snapshot a hub name loads: each weight
    file's name and the sha256 of its bytes (WEIGHT_SUFFIXES, top level, as from_pretrained reads them; every file
    where none matches). Two different sets of weights sharing a digest would take a sha256 collision. What it costs:
      - a hub file is a link to a blob named by its content hash (checked by huggingface_hub on download): not read;
      - a local file is read once (sha256 runs at about 1.5 GB/s on a core with SHA extensions, or the disk's speed
        where slower: a minute or two for 70B parameters in bf16); memo_dir keeps its hash under its path, inode,
        size, mtime and ctime, so a later run or resume reads nothing. Any write gives a file a new ctime, which no
        tool sets back (cp -p and rsync -t set the mtime), so a file rewritten since is hashed again (one rewritten
        within the clock tick, a few ms, of the write before our read would not be; no checkpoint is written that
        fast).
    """
    from ..tiny import TINY_MODELS

    if name in TINY_MODELS:
        return hashlib.sha256(f"{name}|seed {seed}".encode()).hexdigest()
    folder = Path(name)
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(name, local_files_only=True))  # the snapshot load_model just read
    files = sorted(f for f in folder.iterdir() if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES)) or \
        sorted(f for f in folder.iterdir() if f.is_file())
    return hashlib.sha256(json.dumps([(f.name, _file_digest(f, memo_dir)) for f in files]).encode()).hexdigest()


def _file_digest(path: Path, memo_dir: Path | None) -> str:
    real = path.resolve()
    if real.parent.name == "blobs" and _HUB_BLOB.fullmatch(real.name):
        return real.name
    st = real.stat()
    stamp = f"{real}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}"
    memo = memo_dir / f"{hashlib.sha256(stamp.encode()).hexdigest()[:32]}.sha256" if memo_dir is not None else None
    if memo is not None and memo.is_file():
        return memo.read_text().strip()
    digest = hashlib.sha256()
    with open(real, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    if memo is not None:
        memo_dir.mkdir(parents=True, exist_ok=True)
        partial = memo.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(digest.hexdigest())
        partial.replace(memo)  # whole or absent
    return digest.hexdigest()
