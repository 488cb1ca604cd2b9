"""The package's evaluation loss on a real model equals plain transformers' forward on the same window.

One process, one device: the model loads as the main job loads it for `--seq-len` (`load_model_for_length`: YaRN
planned for the length), plain transformers computes its own loss over the first evaluation window (full logits,
fp32 cross-entropy, mean over the shifted tokens), then the same model wrapped as the main job wraps it
(`SequenceParallelCausalLM`: Ulysses attention, chunked head, tiled MLP) is evaluated by `ulysses_lc.eval.evaluate`
on the same window.

    python benchmarks/eval_parity.py --model ./SmolLM2-135M --data ./text/eval --seq-len 65536 --out parity.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from ulysses_lc import ParallelLayout, SequenceParallelCausalLM, init_distributed, load_model_for_length
    from ulysses_lc.eval import evaluate
    from ulysses_lc.eval.data import eval_windows
    from ulysses_lc.train.loading import load_tokenizer

    init_distributed()
    layout = ParallelLayout.build(1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokenizer = load_tokenizer(args.model)
    window = eval_windows(args.data, tokenizer, args.seq_len, 1)[0]
    ids = window.input_ids.reshape(1, -1).long().to(device)
    model = load_model_for_length(args.model, args.seq_len, dtype=dtype).to(device).eval()
    record = {"model": args.model, "seq_len": args.seq_len, "dtype": str(dtype),
              "rope_parameters": dict(model.config.rope_parameters)}
    with torch.no_grad():
        t0 = time.perf_counter()
        record["transformers_loss"] = float(model(input_ids=ids, labels=ids).loss)
        record["transformers_s"] = time.perf_counter() - t0
    torch.cuda.empty_cache() if device.type == "cuda" else None
    wrapped = SequenceParallelCausalLM(model, layout, checkpointing=False, offload=False)
    t0 = time.perf_counter()
    result = evaluate(wrapped, [window.input_ids], [], buckets=8)
    record["ulysses_lc_s"] = time.perf_counter() - t0
    record["ulysses_lc_loss"] = result.loss
    record["relative_difference"] = abs(result.loss - record["transformers_loss"]) / record["transformers_loss"]
    record["by_position"] = result.to_dict().get("buckets")
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1, default=str)
    print(json.dumps({k: v for k, v in record.items() if k != "by_position"}, default=str))


if __name__ == "__main__":
    main()
