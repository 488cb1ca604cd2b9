"""The Hugging Face Trainer and TRL's SFTTrainer through ulysses_lc.integrations.hf_trainer, on 2 gloo ranks.

The plain Trainer's token weighting (num_items_in_batch) over gradient accumulation and DP ranks, on completion-only
rows of 8 and 63 labels. SP=2 against SP=1 through the same Trainer (and through SFTTrainer on prompt/completion rows,
with TRL's own tokenization and completion-only labels): the first step's loss (1e-5 relative) and every gradient as
ZeRO-3 reduced it (1e-4 relative norm), the logged losses; `evaluate()` against the plain model's loss; a Trainer
checkpoint resumed to the same trajectory, and its folder loaded by from_pretrained giving the trained model's
logits exactly (with a plain attention implementation); and each refusal at construction.
"""

import contextlib
import os
import time

import pytest
import torch

from tests._dist import run_distributed, run_shared
from tests._grads import assert_grads_close, first_step_grads
from tests.models import VOCAB, build
from ulysses_lc.levers.tiled_mlp import plain_parameter_name

LOSS_RTOL = 1e-5
DS = {"zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True, "gradient_clipping": 1.0,
      "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
      "steps_per_print": 1000}


def sequences(n=4, seq_len=64):
    return torch.randint(0, VOCAB, (n, seq_len), generator=torch.Generator().manual_seed(0)).tolist()


def training_args(out, steps, **overrides):
    from transformers import TrainingArguments

    kwargs = dict(output_dir=out, deepspeed=DS, per_device_train_batch_size=1, per_device_eval_batch_size=1,
                  max_steps=steps, learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to=[], seed=0,
                  lr_scheduler_type="constant", disable_tqdm=True, use_cpu=True)
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def trainer_worker(rank, world, sp_size, out, steps, mode):
    import datasets

    from ulysses_lc.integrations.hf_trainer import UlyssesTrainer

    ds = datasets.Dataset.from_dict({"input_ids": sequences()})
    record = {}
    save = dict(save_strategy="steps", save_steps=2) if mode == "save" else {}
    trainer = UlyssesTrainer(model=build("qwen3"), args=training_args(out, steps, **save), train_dataset=ds,
                             eval_dataset=ds.select(range(2)), sp_size=sp_size)
    if mode == "eval":
        return trainer.evaluate()["eval_loss"]
    with first_step_grads(record) if mode == "grads" else contextlib.nullcontext():
        trainer.train(resume_from_checkpoint=f"{out}/checkpoint-2" if mode == "resume" else None)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, record.get("grads")


def plain_losses():
    model = build("qwen3").eval()
    with torch.no_grad():
        return [model(input_ids=torch.tensor([s]), labels=torch.tensor([s])).loss.item() for s in sequences()]


def test_trainer_sp2_equals_sp1(tmp_path):
    (single,) = run_shared(trainer_worker, 1, 1, str(tmp_path / "sp1"), 3, "grads", kind="trainer")
    parallel = run_shared(trainer_worker, 2, 2, str(tmp_path / "sp2"), 3, "grads", kind="trainer")
    # The first logged loss is the first sequence's, the plain model's at the initial weights (sampler order:
    # DistributedSampler with one DP rank and the Trainer's seed, the same on both sides).
    for losses, grads in parallel:
        assert len(losses) == 3 and losses[0] != losses[-1]
        for a, b in zip(losses, single[0]):
            assert abs(a - b) <= LOSS_RTOL * abs(b), (losses, single[0])
        assert_grads_close(grads, single[1])
    assert any(abs(single[0][0] - p) <= LOSS_RTOL * p for p in plain_losses())
    # save_strategy "no": the folder the Trainer made for output_dir holds nothing, and is gone (issue 42)
    assert sorted(p.name for p in tmp_path.iterdir()) == [], sorted(tmp_path.iterdir())


def test_trainer_evaluate_is_the_plain_loss(tmp_path):
    ref = sum(plain_losses()[:2]) / 2
    for loss in run_shared(trainer_worker, 2, 2, str(tmp_path), 1, "eval", kind="trainer"):
        assert abs(loss - ref) <= LOSS_RTOL * ref, (loss, ref)


def weighted_rows():
    """Two sequences of 64 tokens with 8 and 63 labels trained (the Trainer counts labels[..., 1:]): completion-only
    data, whose short completion a per-sequence mean would weigh as much as the long one."""
    ids = sequences(2)
    return {"input_ids": ids, "labels": [[-100] * 56 + ids[0][56:], ids[1]]}


def plain_grads(record):
    """A TrainerCallback keeping a plain (no DeepSpeed) Trainer's first-step gradients in record["grads"], taken
    before the optimizer step, unclipped with max_grad_norm 0, as first_step_grads takes DeepSpeed's."""
    from transformers import TrainerCallback

    class Grads(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            record.setdefault("grads", {n: p.grad.clone() for n, p in model.named_parameters()})

    return Grads()


@contextlib.contextmanager
def late_last_look(rank):
    """Ranks other than 0 take their last look into output_dir (the Trainer's checkpoint sort at the end of train())
    late: rank 0 must not take away the folder it made until every rank is past that look."""
    import transformers.trainer

    sort = transformers.trainer.sort_checkpoints

    def late(*args, output_dir, **kwargs):
        if rank:  # the folder vanishing under a look that has begun fails it (scandir): a look must find it there
            time.sleep(0.5)
            assert os.path.isdir(output_dir), f"{output_dir} taken away while rank {rank} was still in train()"
        return sort(*args, output_dir=output_dir, **kwargs)

    transformers.trainer.sort_checkpoints = late
    try:
        yield
    finally:
        transformers.trainer.sort_checkpoints = sort


def weighting_worker(rank, world, sp_size, out, ulysses):
    """The first optimizer step over weighted_rows(), 2 sequences a step (gradient accumulation 2 on one DP rank, 1
    on two): its logged loss and gradients (plain names). ulysses=False: the plain Trainer on the plain model."""
    import datasets
    from transformers import Trainer

    from ulysses_lc.integrations.hf_trainer import UlyssesTrainer
    from ulysses_lc.model import SequenceParallelCausalLM

    ds = datasets.Dataset.from_dict(weighted_rows())
    ga = 2 * sp_size // world
    record = {}
    if ulysses:
        trainer = UlyssesTrainer(model=build("qwen3"), args=training_args(out, 1, gradient_accumulation_steps=ga),
                                 train_dataset=ds, sp_size=sp_size)
        with first_step_grads(record), late_last_look(rank):
            trainer.train()
        grads = {SequenceParallelCausalLM.plain_name(n): g for n, g in record["grads"].items()}
    else:
        args = training_args(out, 1, gradient_accumulation_steps=ga, deepspeed=None, max_grad_norm=0.0)
        trainer = Trainer(model=build("qwen3"), args=args, train_dataset=ds, callbacks=[plain_grads(record)])
        trainer.train()
        grads = record["grads"]
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], grads


def test_trainer_weighs_tokens_as_the_plain_trainer(tmp_path):
    # The swap changes nothing but memory and speed: the plain Trainer's token weighting (num_items_in_batch) over
    # gradient accumulation (sp 1 and sp 2, one DP rank) and over DP ranks (sp 1 on two ranks): the first step's
    # loss 1e-5 relative and every gradient 1e-4 (relative norm).
    # The plain Trainer in a process of its own: accelerate's state left by a DeepSpeed body fails its prepare().
    (plain,) = run_distributed(weighting_worker, 1, 1, str(tmp_path / "plain"), False)
    runs = run_shared(weighting_worker, 1, 1, str(tmp_path / "sp1"), True, kind="trainer")
    runs += run_shared(weighting_worker, 2, 2, str(tmp_path / "sp2"), True, kind="trainer")
    runs += run_shared(weighting_worker, 2, 1, str(tmp_path / "dp2"), True, kind="trainer")
    for losses, grads in runs:
        assert len(losses) == 1 and abs(losses[0] - plain[0][0]) <= LOSS_RTOL * plain[0][0], (losses, plain[0])
        assert_grads_close(grads, plain[1])


def planning_worker(rank, world, out, levers_list):
    """The Trainer path's plan for each of `levers_list`, with the CUDA branch of the planner on given free memory
    (room for the working set and one layer input)."""
    import datasets

    from tests._memory import room_for_one_input
    from ulysses_lc import memory, model as model_mod
    from ulysses_lc.integrations.hf_trainer import UlyssesTrainer

    real, measure = model_mod.plan_step_memory, memory.measure_free_memory
    model_mod.plan_step_memory = lambda shape, n, layout, device, **kw: real(shape, n, layout, torch.device("cuda"), **kw)
    results = []
    train = datasets.Dataset.from_dict({"input_ids": sequences()})
    try:
        for i, levers in enumerate(levers_list):
            trainer = UlyssesTrainer(model=build("qwen3"), args=training_args(f"{out}/{i}", 1), sp_size=1,
                                     levers=levers, train_dataset=train)
            wrapper, seq = trainer.model, 1 << 20
            room = room_for_one_input(wrapper.shape, seq)
            memory.measure_free_memory = lambda device, layout: (room, 1 << 40)
            trainer._plan_memory(seq)
            results.append((wrapper.plan, wrapper.checkpointing.offload, trainer.startup_block))
    finally:
        model_mod.plan_step_memory, memory.measure_free_memory = real, measure
    return results


def test_trainer_plans_no_host_offload_when_its_levers_turn_offload_off(tmp_path):
    (off, on), = run_shared(planning_worker, 1, str(tmp_path), [{"offload": False}, {}], kind="trainer")
    (plan, offload, _), (plan_on, offload_on, block) = off, on
    # One start-up block, as the main job's: layout and sp, the length, the plan it chose (issue 31).
    assert block.startswith("ulysses_lc trainer") and "layout    1 rank = sp 1" in block, block
    assert f"length    {1 << 20:,} tokens per step" in block and f"plan      {plan_on.describe(2)}" in block, block
    assert not offload and plan.recompute_layers > 0 and plan.keep_on_gpu == plan.recompute_layers, plan
    assert offload_on and plan_on.keep_on_gpu < plan_on.recompute_layers, plan_on  # the same memory, offloading


def test_trainer_checkpoint_resumes_the_same_trajectory(tmp_path):
    out = str(tmp_path)
    full, _ = run_shared(trainer_worker, 2, 2, out, 4, "save", kind="trainer")[0]
    resumed, _ = run_shared(trainer_worker, 2, 2, out, 4, "resume", kind="trainer")[0]
    # The resumed state carries the first two steps' log; the last two are trained after the resume.
    assert len(full) == 4 and len(resumed) == 4
    for a, b in zip(resumed[2:], full[2:]):
        assert abs(a - b) <= LOSS_RTOL * abs(b), (resumed, full)


REFUSALS = [
    (dict(deepspeed=None), "ZeRO-3"),
    (dict(use_liger_kernel=True), "use_liger_kernel"),
    (dict(label_smoothing_factor=0.1), "label_smoothing_factor"),
    (dict(per_device_train_batch_size=2), "per_device_train_batch_size"),
    (dict(gradient_checkpointing=True), "gradient_checkpointing"),
    (dict(activation_checkpointing=True), "activation_checkpointing"),  # transformers 5's name for it
]


@pytest.mark.parametrize("overrides,words", REFUSALS)
def test_trainer_settings_refused(overrides, words):
    from types import SimpleNamespace

    from ulysses_lc.integrations.hf_trainer import check_trainer_setup

    args = SimpleNamespace(**{**dict(deepspeed=DS, per_device_train_batch_size=1), **overrides})
    with pytest.raises(ValueError, match=words):
        check_trainer_setup(args, None, {})


def test_logits_losses_and_trl_settings_refused():
    from types import SimpleNamespace

    from ulysses_lc.integrations.hf_trainer import check_trainer_setup

    args = SimpleNamespace(deepspeed=DS)
    with pytest.raises(ValueError, match="compute_loss_func"):
        check_trainer_setup(args, None, {"compute_loss_func": lambda *a, **k: 0})
    with pytest.raises(ValueError, match="compute_metrics"):
        check_trainer_setup(args, None, {"compute_metrics": lambda p: {}})
    with pytest.raises(ValueError, match="loss_type"):
        check_trainer_setup(SimpleNamespace(deepspeed=DS, loss_type="dft"), None, {})
    with pytest.raises(ValueError, match="wrapped"):
        check_trainer_setup(SimpleNamespace(deepspeed=DS, packing=True, packing_strategy="wrapped"), None, {})
    with pytest.raises(ValueError, match="parallelism_config"):
        check_trainer_setup(SimpleNamespace(deepspeed=DS, parallelism_config=SimpleNamespace(sp_size=2)), None, {})
    with pytest.raises(ValueError, match="load_model_for_length"):
        check_trainer_setup(args, build("qwen3"), {}, seq_len=1 << 20)


def test_packed_positions_become_document_lengths():
    from ulysses_lc import ParallelLayout
    from ulysses_lc.integrations.hf_trainer import ShardingCollator

    # TRL's padding_free/packing collator: positions restart per document, the first label of each is ignored.
    def collate(examples):
        return {"input_ids": torch.tensor([examples[0]["input_ids"]]), "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]])}

    batch = ShardingCollator(collate, ParallelLayout(2, 2, 0), VOCAB, 0)([{"input_ids": [5, 6, 7, 8, 9, 10]}])
    assert batch["cu_seqlens"] == (0, 3, 6)
    assert batch["position_ids"].tolist() == [[0, 1, 2]]
    assert batch["labels"].tolist() == [[6, 7, -100]]  # the document's last token predicts nothing


# -- TRL's SFTTrainer: prompt/completion rows, TRL's own tokenization and completion-only labels --

def sft_rows(n=4):
    """Offline prompt/completion rows of different lengths (the tiny byte tokenizer: one token per byte)."""
    g = torch.Generator().manual_seed(1)
    words = ["north", "river", "lamp", "seven", "quiet", "harbour", "stone", "letter"]
    pick = lambda k: " ".join(words[int(i)] for i in torch.randint(0, len(words), (k,), generator=g))
    return [{"prompt": f"Q: {pick(3 + i)}?\n", "completion": f"A: {pick(5 + 2 * i)}."} for i in range(n)]


def sft_worker(rank, world, sp_size, out, mode):
    import datasets
    from trl import SFTConfig

    from ulysses_lc.integrations.hf_trainer import UlyssesSFTTrainer
    from ulysses_lc.parallel.distributed import init_distributed
    from ulysses_lc.tiny import tiny_tokenizer

    init_distributed()  # as a script does: zero.Init (from_config after the SFTConfig below) then sees both ranks
    tokenizer = tiny_tokenizer()
    # evaluate() is compared with the plain model's weights, built before the ZeRO-3 config exists; the gradient
    # test builds the model after it, under zero.Init, as a ZeRO-3 script does.
    model = build("qwen3", vocab_size=len(tokenizer)) if mode == "eval" else None
    ds = datasets.Dataset.from_list(sft_rows())
    record = {}
    args = SFTConfig(output_dir=out, deepspeed=DS, per_device_train_batch_size=1, per_device_eval_batch_size=1,
                     max_steps=2, learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to=[], seed=0,
                     lr_scheduler_type="constant", disable_tqdm=True, use_cpu=True, bf16=False,
                     activation_checkpointing=False, max_length=128)
    model = model or build("qwen3", vocab_size=len(tokenizer))
    trainer = UlyssesSFTTrainer(model=model, args=args, train_dataset=ds,
                                eval_dataset=ds.select(range(2)), processing_class=tokenizer, sp_size=sp_size)
    if mode == "eval":
        # trl 1.16 writes the completion-only labels into the dataset ("Building labels").
        rows = [(r["input_ids"], r["labels"]) for r in trainer.eval_dataset]
        return trainer.evaluate()["eval_loss"], rows
    with first_step_grads(record) if mode == "grads" else contextlib.nullcontext():
        trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], record.get("grads")


def test_sft_trainer_sp2_equals_sp1(tmp_path):
    (single,) = run_shared(sft_worker, 1, 1, str(tmp_path / "sp1"), "grads", kind="trainer")
    for losses, grads in run_shared(sft_worker, 2, 2, str(tmp_path / "sp2"), "grads", kind="trainer"):
        assert len(losses) == 2 and losses[0] != losses[-1]
        for a, b in zip(losses, single[0]):
            assert abs(a - b) <= LOSS_RTOL * abs(b), (losses, single[0])
        assert_grads_close(grads, single[1])


def test_sft_trainer_evaluate_is_the_plain_completion_loss(tmp_path):
    from ulysses_lc.tiny import tiny_tokenizer

    results = run_shared(sft_worker, 2, 2, str(tmp_path), "eval", kind="trainer")
    rows = results[0][1]
    model = build("qwen3", vocab_size=len(tiny_tokenizer())).eval()
    ref, unmasked = [], []
    with torch.no_grad():
        for input_ids, labels in rows:
            ids, labels = torch.tensor([input_ids]), torch.tensor([labels])
            assert (labels == -100).any() and (labels != -100).any()  # TRL masked the prompt
            ref.append(model(input_ids=ids, labels=labels).loss.item())
            unmasked.append(model(input_ids=ids, labels=ids).loss.item())
    ref, unmasked = sum(ref) / len(ref), sum(unmasked) / len(unmasked)
    assert abs(ref - unmasked) > 1e-3  # the comparison below can tell completion-only from every token
    for loss, _ in results:
        assert abs(loss - ref) <= LOSS_RTOL * ref, (loss, ref)


def save_worker(rank, world, out):
    import datasets
    import deepspeed

    from ulysses_lc.integrations.hf_trainer import UlyssesTrainer

    ds = datasets.Dataset.from_dict({"input_ids": sequences()})
    # _save writes weights only where ZeRO-3 gathers them for saving (the shipped zero3 config sets this too).
    config = {**DS, "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}}
    trainer = UlyssesTrainer(model=build("qwen3"), args=training_args(out, 2, deepspeed=config, save_strategy="steps",
                                                                      save_steps=2), train_dataset=ds, sp_size=2)
    trainer.train()
    hf_model = trainer.model.model
    with deepspeed.zero.GatheredParameters(list(hf_model.parameters())):
        weights = {plain_parameter_name(n): p.detach().clone() for n, p in hf_model.named_parameters()}
    return weights


def test_trainer_checkpoint_loads_as_a_plain_model(tmp_path):
    import json

    from transformers import AutoModelForCausalLM

    weights = run_shared(save_worker, 2, str(tmp_path), kind="trainer")[0]
    folder = tmp_path / "checkpoint-2"
    saved_config = json.loads((folder / "config.json").read_text())
    assert saved_config.get("attn_implementation", "sdpa") in ("sdpa", "eager"), saved_config
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert loaded.config._attn_implementation == "sdpa"
    trained = build("qwen3").eval()
    trained.load_state_dict(weights)
    assert not torch.equal(trained.model.embed_tokens.weight, build("qwen3").model.embed_tokens.weight)  # it trained
    input_ids = torch.tensor(sequences(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=input_ids).logits, trained(input_ids=input_ids).logits,
                                   rtol=0, atol=0)


def test_an_engine_built_without_our_mpu_is_refused():
    """The Trainer path reaches accelerate's deepspeed.initialize through a patch that works only while accelerate looks
    the function up at call time: the first training step checks that the engine holds our mpu (issue 28, item 4)."""
    from types import SimpleNamespace

    from ulysses_lc.integrations.hf_trainer import check_engine_mpu

    layout = SimpleNamespace()
    check_engine_mpu(SimpleNamespace(mpu=SimpleNamespace(layout=layout)), layout)
    for engine in (SimpleNamespace(mpu=None), SimpleNamespace(mpu=SimpleNamespace(layout=SimpleNamespace())),
                   torch.nn.Linear(1, 1)):
        with pytest.raises(RuntimeError, match="without ulysses_lc's mpu"):
            check_engine_mpu(engine, layout)


MOE = dict(output_router_logits=True, router_aux_loss_coef=0.5)  # the default 0.001 hides the term in the tolerances


def sft_moe_worker(rank, world, sp_size, out, ulysses):
    """TRL's SFTTrainer on a MoE model with its router loss, two prompt/completion rows of different completion
    lengths a step (accumulation 2 on one DP rank, 1 on two): the first step's loss and gradients (plain names).
    ulysses=False: TRL's own SFTTrainer on one process, no DeepSpeed."""
    import datasets
    from trl import SFTConfig, SFTTrainer

    from ulysses_lc.integrations.hf_trainer import UlyssesSFTTrainer
    from ulysses_lc.model import SequenceParallelCausalLM
    from ulysses_lc.tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    ds = datasets.Dataset.from_list(sft_rows(2))
    ga = 2 * sp_size // world
    record = {}
    common = dict(output_dir=out, per_device_train_batch_size=1, max_steps=1, learning_rate=1e-2, logging_steps=1,
                  save_strategy="no", report_to=[], seed=0, lr_scheduler_type="constant", disable_tqdm=True,
                  use_cpu=True, bf16=False, activation_checkpointing=False, max_length=128,
                  gradient_accumulation_steps=ga)
    if ulysses:
        from ulysses_lc.parallel.distributed import init_distributed

        init_distributed()
        trainer = UlyssesSFTTrainer(model=build("qwen3_moe", vocab_size=len(tokenizer), **MOE),
                                    args=SFTConfig(deepspeed=DS, **common), train_dataset=ds,
                                    processing_class=tokenizer, sp_size=sp_size)
        with first_step_grads(record):
            trainer.train()
        grads = {SequenceParallelCausalLM.plain_name(n): g for n, g in record["grads"].items()}
    else:
        trainer = SFTTrainer(model=build("qwen3_moe", vocab_size=len(tokenizer), **MOE),
                             args=SFTConfig(max_grad_norm=0.0, **common), train_dataset=ds,
                             processing_class=tokenizer, callbacks=[plain_grads(record)])
        trainer.train()
        grads = record["grads"]
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], grads


def test_sft_trainer_weighs_the_router_loss_as_trl(tmp_path):
    # TRL's SFTTrainer averages the MoE router term over the step's micro steps and DP ranks where the plain Trainer
    # sums it: the swap follows TRL (sp 2 with accumulation 2, and two DP ranks): the first step's gradients within
    # 1e-4 (relative norm), the routers' included, against TRL's own SFTTrainer on one process.
    (plain,) = run_distributed(sft_moe_worker, 1, 1, str(tmp_path / "plain"), False)
    runs = run_shared(sft_moe_worker, 2, 2, str(tmp_path / "sp2"), True, kind="trainer")
    runs += run_shared(sft_moe_worker, 2, 1, str(tmp_path / "dp2"), True, kind="trainer")
    assert any("router" in n or "gate" in n for n in plain[1])
    for _, grads in runs:
        assert_grads_close(grads, plain[1])
