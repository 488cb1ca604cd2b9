"""A full DeepSpeed ZeRO-3 engine on CPU: SP=2 on 2 ranks against the same engine on 1 rank.

Both runs start from the same weights and train the same sequence for 3 optimizer steps. Checked:
every parameter's gradient after the first backward, as ZeRO-3 reduced it (1e-4 relative norm: this is
what catches a wrong reduction divisor, which AdamW's scale invariance would hide from the losses), and
the loss trajectory (1e-4 relative).
"""

import sys

import torch

from tests._dist import run_shared
from tests.models import VOCAB, build
from ulysses_lc import MemoryPlan, ParallelLayout, SequenceParallelCausalLM, shard_batch
from ulysses_lc.parallel.ds_config import check_deepspeed_config
from ulysses_lc.levers.tiled_mlp import plain_parameter_name

STEPS = 3
CONFIG = {
    "zero_optimization": {"stage": 3},
    "zero_allow_untested_optimizer": True,
    "gradient_clipping": 1.0,
    "steps_per_print": 1000,
}


NO_LEVERS = dict(chunked_loss=False, tiled_mlp=False, checkpointing=False, offload=False, efficient_norm=False)
ALL_LEVERS = dict(chunked_loss=16, tiled_mlp=3, checkpointing=True, offload=True, min_offload_bytes=0,
                  plan=MemoryPlan(2, 0, 2))


def engine_worker(rank, world_size, sp_size, input_ids, levers=NO_LEVERS, family="qwen3", overrides=None,
                  start="deepspeed"):
    """start: "deepspeed" (deepspeed.initialize) or "job" (the job's engine_start.deepspeed_initialize, on a rank
    where DeepSpeed's Muon module is not loaded yet, as in a fresh one: it must stay so)."""
    import deepspeed

    from ulysses_lc.parallel.distributed import init_distributed
    from ulysses_lc.train.engine_start import MUON_MODULE, deepspeed_initialize

    init_distributed("gloo")  # not deepspeed.init_distributed: it would build DeepSpeed's CPU shm op (distributed.py)
    layout = ParallelLayout.build(sp_size)
    model = SequenceParallelCausalLM(build(family, tie_word_embeddings=True, **(overrides or {})), layout, **levers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = check_deepspeed_config(CONFIG, layout)
    if start == "job":
        muon = sys.modules.pop(MUON_MODULE, None)  # an earlier body's import, put back below
        engine, *_ = deepspeed_initialize(model=model, optimizer=optimizer, config=config, mpu=layout.mpu)
        assert MUON_MODULE not in sys.modules, "ZeRO-3's start imported DeepSpeed's Muon module (engine_start.py)"
        if muon is not None:
            sys.modules[MUON_MODULE] = muon
    else:
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=layout.mpu)
    from deepspeed.utils import safe_get_full_grad

    losses, grads = [], None
    for _ in range(STEPS):
        batch = shard_batch(input_ids, layout)
        loss = engine(**batch.as_kwargs())
        engine.backward(loss)
        if grads is None:  # collective: every rank gathers every gradient
            grads = {plain_parameter_name(name): safe_get_full_grad(p).clone()
                     for name, p in engine.module.named_parameters()}
        engine.step()
        losses.append(loss.item())
    return losses, grads


def assert_same_run(parallel, single):
    single_losses, single_grads = single
    assert single_losses[0] != single_losses[-1]  # it trained
    for losses, grads in parallel:
        for a, b in zip(losses, single_losses):
            assert abs(a - b) <= 1e-4 * abs(b), (losses, single_losses)
        assert grads.keys() == single_grads.keys()
        for name, ref in single_grads.items():
            err = (grads[name] - ref).norm() / ref.norm().clamp(min=1e-12)
            assert err <= 1e-4, f"{name}: relative gradient error {err:.2e}"


def test_zero3_sp2_matches_one_rank():
    # The SP run's engine starts as the job's do (engine_start.py: without DeepSpeed's Muon import), the one-rank
    # run's through deepspeed.initialize itself.
    input_ids = torch.randint(0, VOCAB, (1, 64), generator=torch.Generator().manual_seed(0))
    (single,) = run_shared(engine_worker, 1, 1, input_ids, kind="deepspeed")
    parallel = run_shared(engine_worker, 2, 2, input_ids, NO_LEVERS, "qwen3", None, "job", kind="deepspeed")
    assert_same_run(parallel, single)


def test_the_muon_stand_in_answers_only_zeros_question_and_leaves_the_real_module_to_any_other(monkeypatch):
    """engine_start.without_muon_import: inside, DeepSpeed's MuonWithAuxAdam is a class no optimizer is an instance
    of; after, the module is not loaded; a config asking for Muon gets no stand-in; any other name asked of the
    stand-in (a later DeepSpeed's) imports the real module, which stays."""
    from ulysses_lc.train.engine_start import MUON_MODULE, without_muon_import

    monkeypatch.delitem(sys.modules, MUON_MODULE, raising=False)
    adamw = torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    with without_muon_import({"zero_optimization": {"stage": 3}}):
        from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

        assert not isinstance(adamw, MuonWithAuxAdam) and MuonWithAuxAdam.__module__ == "ulysses_lc.train.engine_start"
    assert MUON_MODULE not in sys.modules
    with without_muon_import({"optimizer": {"type": "Muon", "params": {"lr": 1e-3}}}):
        assert MUON_MODULE not in sys.modules  # no stand-in: DeepSpeed's own import loads the real one
    with without_muon_import({}):
        from deepspeed.runtime.zero.muon.muon_optimizer import muon_update

        real = sys.modules[MUON_MODULE]
        assert muon_update.__module__ == "deepspeed.runtime.zero.muon.original_muon"
        assert real.MuonWithAuxAdam.__module__ == MUON_MODULE
    assert sys.modules[MUON_MODULE] is real


def test_zero3_sp2_all_levers_matches_one_rank_plain():
    # ZeRO-3 gathers the tied LM head inside the chunked loss head and the tiled MLP's weights once per
    # layer (leaf modules); a gather or reduction missed there would change the trajectory.
    input_ids = torch.randint(0, VOCAB, (1, 64), generator=torch.Generator().manual_seed(1))
    (single,) = run_shared(engine_worker, 1, 1, input_ids, NO_LEVERS, "qwen3_moe", kind="deepspeed")
    assert_same_run(run_shared(engine_worker, 2, 2, input_ids, ALL_LEVERS, "qwen3_moe", kind="deepspeed"), single)


def test_zero3_sp2_hybrid_all_levers_matches_one_rank_plain():
    # A gated DeltaNet hybrid with MoE (Qwen3-Next): ZeRO-3 gathers the conv weight, which transformers' own forward
    # reads without calling its module, through the conv1d module the exchange runs (linear_attention.py).
    input_ids = torch.randint(0, VOCAB, (1, 64), generator=torch.Generator().manual_seed(1))
    (single,) = run_shared(engine_worker, 1, 1, input_ids, NO_LEVERS, "qwen3_next", kind="deepspeed")
    assert_same_run(run_shared(engine_worker, 2, 2, input_ids, ALL_LEVERS, "qwen3_next", kind="deepspeed"), single)


def test_zero3_sp2_router_loss_all_levers_matches_one_rank_plain():
    # The MoE router loss on (test_router_loss.py holds our one-rank plain run to transformers'): under ZeRO-3 the
    # routers' hooks run inside the tiled MLP's leaf modules and the checkpointed layers, whose weights it gathers.
    input_ids = torch.randint(0, VOCAB, (1, 64), generator=torch.Generator().manual_seed(2))
    moe = dict(output_router_logits=True, router_aux_loss_coef=0.5)
    (single,) = run_shared(engine_worker, 1, 1, input_ids, NO_LEVERS, "qwen3_moe", moe, kind="deepspeed")
    assert_same_run(run_shared(engine_worker, 2, 2, input_ids, ALL_LEVERS, "qwen3_moe", moe, kind="deepspeed"), single)
