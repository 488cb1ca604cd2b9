"""The ulysses_lc levers in your own DeepSpeed loop: a few library calls around deepspeed.initialize.

    deepspeed --num_gpus 2 examples/embed_in_your_loop.py          # CPU (gloo) or GPUs

Contract, in order:
  1. ParallelLayout.build(sp_size)            -> SP/DP groups; layout.mpu goes to deepspeed.initialize.
  2. apply_yarn(config, seq_len)              -> rope_parameters for the target length (before loading weights).
  3. SequenceParallelCausalLM(model, layout)  -> Ulysses attention + chunked loss + tiled MLP + offloaded
                                                checkpoints; build it before deepspeed.initialize.
  4. shard_batch(input_ids, layout)           -> this rank's slice, labels shifted over the whole sequence.
  5. engine(**batch.as_kwargs())              -> the sequence's mean loss, the same on every SP rank.
"""

import deepspeed
import torch
from transformers import AutoModelForCausalLM

from ulysses_lc import (
    ParallelLayout,
    SequenceParallelCausalLM,
    apply_yarn,
    check_deepspeed_config,
    destroy_distributed,
    init_distributed,
    shard_batch,
)
from ulysses_lc.tiny import tiny_model_config, tiny_text, tiny_tokenizer
from ulysses_lc.train.console import quiet_warnings

SEQ_LEN = 4096

quiet_warnings()  # each warning once (rank 0's), as the main job prints them
init_distributed()  # deepspeed, torchrun, accelerate launch or plain python
layout = ParallelLayout.build(sp_size=torch.distributed.get_world_size())
device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

# Your model: here the embedded tiny Qwen3; for a hub model use ulysses_lc.load_model_for_length(name, SEQ_LEN).
config = apply_yarn(tiny_model_config(), SEQ_LEN)
torch.manual_seed(0)
model = SequenceParallelCausalLM(AutoModelForCausalLM.from_config(config).to(device), layout)

ds_config = check_deepspeed_config({"zero_optimization": {"stage": 3}, "gradient_clipping": 1.0,
                                    "zero_allow_untested_optimizer": True}, layout)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config, mpu=layout.mpu)

# Your data: every rank of an SP group passes the same whole sequence; shard_batch takes this rank's slice.
tokenizer = tiny_tokenizer()
input_ids = torch.tensor(tokenizer(tiny_text(SEQ_LEN * 2))["input_ids"][:SEQ_LEN])
for step in range(3):
    batch = shard_batch(input_ids, layout, vocab_size=config.vocab_size).to(device)  # labels checked on the host
    loss = engine(**batch.as_kwargs())
    engine.backward(loss)
    engine.step()
    if layout.rank == 0:
        print(f"step {step + 1} | loss {loss.item():.4f} | valid tokens {int(model.last_num_tokens)}")
destroy_distributed()  # every rank, at the end: a clean exit (NCCL would warn, gloo can abort at exit)
