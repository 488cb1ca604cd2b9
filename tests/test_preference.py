"""DPO under SP=2 and 4 on gloo against TRL's DPOTrainer on one process: the loss and every gradient.

The reference is TRL's own computation: a `trl.DPOTrainer` (1.16) built on one process for the same rows, its
collated batch through its `compute_loss` (TRL's fused LM head, its per-sequence sums, its loss formulas) and
backward. The SP side packs each pair as two documents of one sequence (preference.py), runs the policy with every
lever on (the chunked head in 5-row chunks, so chunks meet document borders; tiled MLP; every layer checkpointed and
offloaded) and takes the reference from a frozen copy or from the adapters switched off. The rows are chosen so that
a prompt crosses a shard border at sp 2 and at sp 4, and the two completions differ in length.
Tolerances (fp32): loss within 1e-5 relative, each gradient within 1e-4 relative norm, reward margin within 5e-5
(absolute: MARGIN_ATOL says why).
"""

import tempfile

import pytest
import torch

from tests._dist import run_shared
from tests.models import build
from ulysses_lc import MemoryPlan, ParallelLayout, SequenceParallelCausalLM, reduce_gradients
from ulysses_lc.objectives.preference import PreferenceLoss, check_pair, reference_log_probs, shard_pairs
from ulysses_lc.tiny import tiny_tokenizer

pytest.importorskip("trl")
pytest.importorskip("peft")

LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4
# The reward margin is beta times a difference of four fp32 sums of about -100 (an ulp there is 8e-6): absolute.
MARGIN_ATOL = 5e-5
VOCAB = 257  # the tiny byte tokenizer's
OVERRIDES = {"vocab_size": VOCAB, "tie_word_embeddings": True}  # tied: the head's weight takes a gradient too
LEVERS = dict(chunked_loss=5, tiled_mlp=3, checkpointing=True, offload=True, plan=MemoryPlan(2, 0, 1),
              min_offload_bytes=0)
NO_LEVERS = dict(chunked_loss=False, tiled_mlp=False, checkpointing=False, offload=False, efficient_norm=False)
# 30-token prompt, completions of 15 and 26 tokens with TRL's EOS: documents of 45 and 56 tokens. Shard borders:
# sp 2 at 51 (the second document's prompt, 45..75), sp 4 at 26 (the first prompt), 52 (the second) and 78.
ROWS = [{"prompt": "The quick brown fox jumps over", "chosen": " the lazy dog.",
         "rejected": " a fence, twice and more."},
        {"prompt": "Once upon a time,", "chosen": " a king ruled a small land by the sea.", "rejected": " nothing."}]


def lora():
    from ulysses_lc.peft_support import lora_config

    config = lora_config(4, targets="q_proj,v_proj,down_proj")
    config.init_lora_weights = False  # random A and B: the policy differs from the base, every adapter grad is non-0
    return config


def trl_dpo(rows, reference="copy", **dpo_args):
    """TRL's DPO loss, gradients and reward margin for `rows` (one batch) on one process, and what the SP side needs:
    the pairs' token ids and the policy's and reference's weights."""
    import datasets
    from accelerate.state import AcceleratorState
    from trl import DPOConfig, DPOTrainer

    policy = build("qwen3", **OVERRIDES)
    ref_model = build("qwen3", seed=1, **OVERRIDES) if reference == "copy" else None
    with tempfile.TemporaryDirectory() as out:
        # fp32 throughout: TRL defaults to bf16, and accelerate then runs the reference copy under autocast
        args = DPOConfig(output_dir=out, use_cpu=True, bf16=False, report_to=[], max_length=None, disable_tqdm=True,
                         **dpo_args)
        trainer = DPOTrainer(model=policy, ref_model=ref_model, args=args, processing_class=tiny_tokenizer(),
                             train_dataset=datasets.Dataset.from_list(rows),
                             peft_config=lora() if reference == "adapters" else None)
        examples = [trainer.train_dataset[i] for i in range(len(rows))]
        loss = trainer.compute_loss(trainer.model, trainer.data_collator(examples))
        loss.backward()
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        margin = trainer._metrics["train"]["rewards/margins"][-1]
        pairs = [(e["prompt_ids"], e["chosen_ids"], e["rejected_ids"]) for e in examples]
        states = (trainer.model.state_dict(), None if ref_model is None else ref_model.state_dict())
    AcceleratorState._reset_state(reset_partial_state=True)  # the next test starts without this one's accelerator
    return loss.item(), grads, margin, pairs, states


def dpo_worker(rank, world_size, sp_size, pairs, states, loss_kwargs, levers):
    from ulysses_lc.peft_support import apply_peft

    layout = ParallelLayout.build(sp_size)
    policy_state, ref_state = states
    policy = build("qwen3", **OVERRIDES)
    if ref_state is None:
        policy = apply_peft(policy, lora())
    policy.load_state_dict(policy_state)
    model = SequenceParallelCausalLM(policy, layout, **levers)
    reference = None
    if ref_state is not None:
        ref_model = build("qwen3", **OVERRIDES)
        ref_model.load_state_dict(ref_state)
        reference = SequenceParallelCausalLM(ref_model.requires_grad_(False), layout, **levers)
    batch = shard_pairs(pairs, layout, vocab_size=VOCAB)
    ref_logps = reference_log_probs(model, batch, reference)
    loss, metrics = PreferenceLoss(**loss_kwargs)(model(**batch.as_kwargs()), ref_logps, batch)
    loss.backward()
    reduce_gradients(model.parameters(), layout)
    grads = {name: p.grad for name, p in model.plain_named_parameters() if p.grad is not None}
    return loss.item(), grads, metrics["rewards/margins"].item()


def assert_matches(results, ref_loss, ref_grads, ref_margin):
    for loss, grads, margin in results:
        assert abs(loss - ref_loss) <= LOSS_RTOL * abs(ref_loss), (loss, ref_loss)
        assert abs(margin - ref_margin) <= MARGIN_ATOL, (margin, ref_margin)
        assert grads.keys() == ref_grads.keys()
        for name, ref in ref_grads.items():
            err = (grads[name] - ref).norm() / ref.norm().clamp(min=1e-12)
            assert err <= GRAD_RTOL, f"{name}: relative gradient error {err:.2e}"


def test_rows_cross_shard_borders():
    pairs = trl_dpo(ROWS[:1], beta=0.3)[3]
    prompt, chosen, rejected = (len(x) for x in pairs[0])
    assert (prompt, chosen, rejected) == (30, 15, 26)
    second_prompt = range(prompt + chosen + 1, 2 * prompt + chosen)
    assert 51 in second_prompt and 26 < prompt and 52 in second_prompt


@pytest.mark.parametrize("world", [2, 4])
def test_dpo_with_a_frozen_reference_copy_equals_trl(world):
    ref_loss, ref_grads, ref_margin, pairs, states = trl_dpo(ROWS[:1], beta=0.3)
    results = run_shared(dpo_worker, world, world, pairs, states, dict(beta=0.3), LEVERS)
    assert_matches(results, ref_loss, ref_grads, ref_margin)


@pytest.mark.parametrize("world", [2, 4])
def test_dpo_lora_with_the_adapters_off_as_reference_equals_trl(world):
    ref_loss, ref_grads, ref_margin, pairs, states = trl_dpo(ROWS[:1], reference="adapters", beta=0.3)
    assert all(".lora_" in n for n in ref_grads)  # only the adapters train
    results = run_shared(dpo_worker, world, world, pairs, states, dict(beta=0.3), LEVERS)
    assert_matches(results, ref_loss, ref_grads, ref_margin)


def test_two_pairs_in_one_sequence_equal_trls_batch_of_two():
    ref = trl_dpo(ROWS, beta=0.2)
    results = run_shared(dpo_worker, 4, 4, ref[3], ref[4], dict(beta=0.2), LEVERS)
    assert_matches(results, *ref[:3])


def test_ipo_and_label_smoothing_equal_trl():
    # IPO: TRL's length-normalised form. Sigmoid with label smoothing (cDPO): TRL's "aot" loss, which on one pair
    # is exactly that (its sort over the batch is the identity). Also the path without the chunked head.
    ipo = trl_dpo(ROWS[:1], beta=0.5, loss_type=["ipo"])
    results = run_shared(dpo_worker, 2, 2, ipo[3], ipo[4], dict(beta=0.5, loss_type="ipo"), LEVERS)
    assert_matches(results, *ipo[:3])
    cdpo = trl_dpo(ROWS[:1], beta=0.3, loss_type=["aot"], label_smoothing=0.2)
    results = run_shared(dpo_worker, 2, 2, cdpo[3], cdpo[4], dict(beta=0.3, label_smoothing=0.2), NO_LEVERS)
    assert_matches(results, *cdpo[:3])


def test_pairs_that_cannot_be_exact_are_refused():
    with pytest.raises(ValueError, match="no rejected completion tokens"):
        check_pair([1, 2], [3], [])
    with pytest.raises(ValueError, match="no prompt tokens"):
        check_pair([], [3], [4])
    with pytest.raises(ValueError, match="raise --seq-len to at least 9"):
        check_pair([1, 2, 3], [4, 5], [6], seq_len=8)
    for bad in (dict(loss_type="hinge"), dict(beta=0.0), dict(label_smoothing=0.5),
                dict(loss_type="ipo", label_smoothing=0.1)):
        with pytest.raises(ValueError):
            PreferenceLoss(**bad)
    assert torch.isfinite(torch.tensor(check_pair([1], [2], [3], seq_len=4)))


def test_the_main_jobs_tokenization_of_pairs_is_trls():
    # Plain and chat rows: ulysses_lc.data.pairs.tokenize_pair gives the ids TRL's DPOTrainer prepares; chat rows also
    # with their own tools (a list, or its JSON text) and chat_template_kwargs (enable_thinking), which TRL renders.
    import datasets
    from accelerate.state import AcceleratorState
    from trl import DPOConfig, DPOTrainer

    from tests.test_data_samples import tools_rows, tools_tokenizer
    from ulysses_lc.data.pairs import tokenize_pair

    chat = [{"prompt": [{"role": "user", "content": "Name a colour."}],
             "chosen": [{"role": "assistant", "content": "Blue."}],
             "rejected": [{"role": "assistant", "content": "Seven, probably."}]}]
    with_tools = [{"prompt": r["messages"][:1], "chosen": r["messages"][1:],
                   "rejected": [{"role": "assistant", "content": "No idea."}],
                   **{k: r[k] for k in ("tools", "chat_template_kwargs")}}
                  for r in (tools_rows(i, tools_as_text=i >= 2) for i in range(4))]
    cases = [(ROWS, tiny_tokenizer()), (chat, tiny_tokenizer()), (with_tools[:2], tools_tokenizer()),
             (with_tools[2:], tools_tokenizer())]
    for rows, tokenizer in cases:
        dataset = datasets.Dataset.from_list(rows)
        with tempfile.TemporaryDirectory() as out:
            args = DPOConfig(output_dir=out, use_cpu=True, bf16=False, report_to=[], max_length=None)
            trainer = DPOTrainer(model=build("qwen3", **OVERRIDES), ref_model=build("qwen3", **OVERRIDES), args=args,
                                 processing_class=tokenizer, train_dataset=dataset)
            for i, (row, prepared) in enumerate(zip(dataset, trainer.train_dataset, strict=True)):
                ours = tokenize_pair(row, tokenizer, i)
                assert ours == tuple(prepared[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")), \
                    tokenizer.decode(ours[0])
        AcceleratorState._reset_state(reset_partial_state=True)
