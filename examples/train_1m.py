"""Fine-tune a causal LM on one ~1M-token sequence per step: Ulysses SP + ZeRO-3 + all memory levers.

    deepspeed --num_gpus 8 examples/train_1m.py                       # Qwen3-8B on PG-19, 1,048,576 tokens
    deepspeed --num_gpus 2 examples/train_1m.py                       # no GPU: the embedded tiny default
    deepspeed --num_gpus 8 examples/train_1m.py --model ./my-model --data ./books/ --seq-len 524288

The flags, their defaults, the loop and the failure reporting are the library's (`ulysses_lc.train.main`);
--help lists the flags, --dry-run sizes a run without loading anything.
"""

from ulysses_lc.train import main

if __name__ == "__main__":
    main()
