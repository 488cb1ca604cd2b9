"""One DPO step beside two SFT steps of the same tokens, on one GPU, with the dry run's predicted peaks (issue 29).

    python3 benchmarks/bench_dpo.py --prompt 98304 --completion 32768 --budget-s 555 --out $OUT   # 36 layers, ~330 s

The Qwen3-8B shape (--layers of its 36; random bf16 weights from one seed), LoRA r 16 on every projection, the main
job's way: a ZeRO-3 engine, torch AdamW over the adapters, the plan `plan_step` makes for this GPU. The pair is one
sequence of two packed documents, prompt + chosen and prompt + rejected, each --prompt + --completion tokens; the
reference is the model with its adapters off (no second model). The DPO step: the reference forward (no gradient),
the policy's forward and backward, the optimizer step. Beside it, two SFT steps, one per document, each its own
sequence (labels on the completion). Each phase is warmed up at 8k tokens first; peaks are
torch.cuda.max_memory_allocated over the timed steps, also per part of the step (reference forward, forward + loss,
backward, optimizer step), beside the memory held at its start; predicted: sizing.Job.predict for the plan used (what
the dry run prints for that plan), with its terms. The timed steps include making the pinned host buffers for the
offloaded layers (the first step at a plan pays it; its seconds are recorded as host_buffers_s). A time guard
(--budget-s) runs two SFT steps, one, or none, by what the DPO step's measured / predicted time says they take.
Writes <out>/dpo.json after each phase and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

GB = 1e9
K = 1024
WARMUP = 8 * K


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    p.add_argument("--prompt", type=int, default=96 * K)
    p.add_argument("--completion", type=int, default=32 * K)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--warmup", type=int, default=WARMUP, help="tokens of each phase's warm-up sequence")
    p.add_argument("--budget-s", type=float, default=240)
    p.add_argument("--out", type=Path, default=Path("results"))
    args = p.parse_args()
    start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)

    import deepspeed
    import psutil
    from transformers import AutoModelForCausalLM

    from ulysses_lc import IGNORE_INDEX, MemoryPlan, ModelShape, ParallelLayout, SequenceParallelCausalLM, shard_batch
    from ulysses_lc.parallel.distributed import init_distributed
    from ulysses_lc.levers.host_pool import HostPool
    from ulysses_lc.parallel.ds_config import check_deepspeed_config, load_deepspeed_config
    from ulysses_lc.peft_support import apply_peft, count_trainable_parameters, lora_config
    from ulysses_lc.objectives.preference import PreferenceLoss, reference_log_probs, shard_pairs
    from ulysses_lc.plan.sizing import Job, Limits
    from ulysses_lc.train.estimate import plan_reservations
    from ulysses_lc.levers.yarn import apply_yarn

    from common import SHAPES
    from transformers import Qwen3Config

    def qwen3_config(name, layers):  # the public shapes (common.py), random weights: no download
        kwargs = dict(SHAPES[name], max_position_embeddings=40960, rope_theta=1e6)
        kwargs["num_hidden_layers"] = layers or kwargs["num_hidden_layers"]
        return Qwen3Config(**kwargs)

    doc = args.prompt + args.completion
    config = apply_yarn(qwen3_config(args.shape, args.layers), 2 * doc)
    config.use_cache = False
    peft_config = lora_config(args.lora_r)
    total, trainable = count_trainable_parameters(config, peft_config)
    layout_sizes = ParallelLayout(1, 1)
    ds_config = check_deepspeed_config(load_deepspeed_config("zero3"), layout_sizes, gradient_accumulation_steps=1)
    init_distributed()
    cuda = torch.cuda.is_available()  # without one: a smoke run of the code paths, no figures
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    layout = ParallelLayout.build(1)
    limits = Limits(torch.cuda.mem_get_info(dev)[1] if cuda else 150e9, 0.9 * psutil.virtual_memory().total)
    rec = dict(date=time.strftime("%Y-%m-%d"), machine=f"{torch.cuda.get_device_name(dev) if cuda else 'cpu'}, "
               f"{psutil.virtual_memory().total / GB:.0f} GB host", shape=args.shape, layers=config.num_hidden_layers,
               lora_r=args.lora_r, params=total, trainable=trainable, prompt=args.prompt, completion=args.completion,
               command=" ".join(sys.argv))

    torch.manual_seed(0)
    with torch.device(dev):
        model = apply_peft(AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if cuda else torch.float32),
                           peft_config)
    wrapper = SequenceParallelCausalLM(model, layout)
    optimizer = torch.optim.AdamW([q for q in wrapper.parameters() if q.requires_grad], lr=1e-5, fused=cuda)
    engine, *_ = deepspeed.initialize(model=wrapper, optimizer=optimizer, config=ds_config, mpu=layout.mpu)
    engine.train()
    rec["setup_s"] = time.perf_counter() - start
    vocab = config.vocab_size
    shape = ModelShape.from_config(config)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    made = dict(s=0.0, bytes=0)  # pinned host buffers made (allocated and registered) inside the timed steps
    take = HostPool.take

    def timed_take(pool, nbytes, pin):
        before, t0 = pool.bytes, time.perf_counter()
        out = take(pool, nbytes, pin)
        if pool.bytes > before:
            made["s"] += time.perf_counter() - t0
            made["bytes"] += pool.bytes - before
        return out

    HostPool.take = timed_take
    parts = {}  # part of the step -> its peak (GB); the step's peak is their max

    def part(name):  # the peak since the last part; "held": the memory allocated as the step starts
        sync()
        if cuda:
            now = (torch.cuda.memory_allocated if name == "held" else torch.cuda.max_memory_allocated)(dev) / GB
            parts[name] = max(parts.get(name, 0.0), now)
            torch.cuda.reset_peak_memory_stats(dev)

    def tokens(n, seed):
        return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()

    def job(packed, preference):  # DPO: two documents of a pair, each its own kernel call (long_documents)
        return Job.from_ds_config(shape, total, 1, 1, ds_config, packed=packed, trainable_params=trainable,
                                  preference=preference, long_documents=preference)

    loss_fn = PreferenceLoss(beta=0.1)

    def dpo_step(prompt, completion):
        pair = (tokens(prompt, 1), tokens(completion, 2), tokens(completion, 3))
        batch = shard_pairs([pair], layout, vocab_size=vocab).to(dev)
        part("held")
        t0 = time.perf_counter()
        ref = reference_log_probs(engine, batch)
        part("reference_forward")
        t_ref = time.perf_counter() - t0
        loss, metrics = loss_fn(engine(**batch.as_kwargs()), ref, batch)
        part("forward_and_loss")
        engine.backward(loss)
        part("backward")
        engine.step()
        part("optimizer_step")
        return time.perf_counter() - t0, t_ref, float(loss), float(metrics["rewards/margins"])

    def sft_step(prompt, completion, seed):
        ids = torch.tensor(tokens(prompt, 1) + tokens(completion, seed))
        labels = ids.clone()
        labels[:prompt] = IGNORE_INDEX
        batch = shard_batch(ids, layout, labels=labels, vocab_size=vocab).to(dev).as_kwargs()
        part("held")
        t0 = time.perf_counter()
        loss = engine(**batch)
        part("forward_and_loss")
        engine.backward(loss)
        part("backward")
        engine.step()
        part("optimizer_step")
        return time.perf_counter() - t0, float(loss)

    def plan_for(packed, preference, seq):
        return wrapper.plan_step(seq, dev, packed=packed, long_documents=preference,
                                 **plan_reservations(job(packed, preference), limits))

    def phase(name, packed, preference, seq, run, plan):
        predicted = job(packed, preference).predict(seq, plan)
        wrapper.use_plan(plan)
        parts.clear()
        made.update(s=0.0, bytes=0)
        out = run()
        peak = max(v for k, v in parts.items() if k != "held") if cuda else float("nan")
        rec[name] = dict(plan=list(plan.counts), tokens=seq, predicted_gpu=predicted.gpu / GB, gpu_peak=peak,
                         predicted_terms_gb=dict(state=predicted.state_gpu / GB, gathered=predicted.gathered / GB,
                                                 activations=predicted.act_gpu / GB, host=predicted.act_host / GB),
                         part_peaks_gb=dict(parts), host_buffers_s=made["s"], host_buffers_gb=made["bytes"] / GB,
                         predicted_step_s=job(packed, preference).step_seconds(seq, plan), **out)
        print(name, json.dumps(rec[name]), flush=True)
        (args.out / "dpo.json").write_text(json.dumps(rec, indent=1))

    wrapper.use_plan(MemoryPlan(0, 0, 0))
    rec["warmup_dpo_s"] = dpo_step(args.warmup * 3 // 8, args.warmup // 8)[0]

    def run_dpo():
        step_s, ref_s, loss, margin = dpo_step(args.prompt, args.completion)
        return dict(step_s=step_s, reference_forward_s=ref_s, loss=loss, margin=margin)

    phase("dpo", True, True, 2 * doc, run_dpo, plan_for(True, True, 2 * doc))
    # An SFT step's seconds: its prediction at the rate the DPO step ran against its own (+15% and 20 s spare).
    sft_plan = plan_for(False, False, doc)
    rate = rec["dpo"]["step_s"] / rec["dpo"]["predicted_step_s"]
    sft_s = 1.15 * rate * job(False, False).step_seconds(doc, sft_plan)
    rec["sft_step_s_expected"] = sft_s
    elapsed = time.perf_counter() - start
    steps = next((n for n in (2, 1) if elapsed + n * sft_s + 20 <= args.budget_s), 0)
    if not steps:
        rec["sft"] = dict(status=f"skipped: {elapsed:.0f} s gone of --budget-s {args.budget_s:.0f}, an SFT step "
                                 f"~{sft_s:.0f} s")
    else:
        wrapper.use_plan(MemoryPlan(0, 0, 0))
        rec["warmup_sft_s"] = sft_step(args.warmup * 3 // 4, args.warmup // 4, 2)[0]

        def run_sft():
            runs = [sft_step(args.prompt, args.completion, 2)]
            if steps == 2 and time.perf_counter() - start + 1.1 * runs[0][0] + 10 <= args.budget_s:
                runs.append(sft_step(args.prompt, args.completion, 3))
            return dict(step_s=sum(t for t, _ in runs), steps_s=[t for t, _ in runs], losses=[x for _, x in runs])

        phase("sft", False, False, doc, run_sft, sft_plan)
    rec["total_s"] = time.perf_counter() - start
    (args.out / "dpo.json").write_text(json.dumps(rec, indent=1))
    lines = [f"{rec['machine']}; {args.shape} with {rec['layers']} layers, LoRA r {args.lora_r}; pair {args.prompt:,} + "
             f"{args.completion:,} tokens per document", "phase  tokens   plan         GPU predicted / measured   step s"]
    for name in ("dpo", "sft"):
        r = rec.get(name, {})
        if "gpu_peak" in r:
            lines.append(f"{name:<6} {r['tokens']:>8,} {str(r['plan']):<12} {r['predicted_gpu']:6.1f} / "
                         f"{r['gpu_peak']:6.1f} GB ({r['predicted_gpu'] / r['gpu_peak']:.3f})   {r['step_s']:.1f}"
                         + (f" (reference forward {r['reference_forward_s']:.1f})" if name == "dpo" else
                            f" ({len(r['steps_s'])} step{'s' if len(r['steps_s']) > 1 else ''})"))
        else:
            lines.append(f"{name:<6} {r.get('status', 'not run')}")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
