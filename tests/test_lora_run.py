"""The main job with --lora-r on 2 gloo ranks: adapters only, resume replays the trajectory, the export reloads with
peft; and the dry run's state bytes without optimizer state for the frozen base."""

import json
import os
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch

from tests._dist import run_distributed, run_shared
from tests.test_training import losses_of, tiny_config, train_worker
from ulysses_lc.tiny import tiny_model_config
from ulysses_lc.train import parse_args

pytest.importorskip("peft")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _tiny_folder(tmp_path):
    # A local folder: the real loading path (from_pretrained under zero.Init, then peft) with no hub.
    from transformers import AutoModelForCausalLM

    from ulysses_lc.tiny import tiny_tokenizer

    folder = tmp_path / "tiny-model"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_model_config()).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def test_lora_run_resumes_its_trajectory_and_exports_the_adapter(tmp_path):
    from peft import PeftModel, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from ulysses_lc.model import SequenceParallelCausalLM
    from ulysses_lc.peft_support import lora_config

    folder = _tiny_folder(tmp_path)
    run = tmp_path / "run"
    cfg = tiny_config(tmp_path, model=str(folder), steps=4, save_every=2, keep_checkpoints=0, lr=1e-2, lora_r=4,
                      lora_targets="q_proj,v_proj,down_proj", export_merged=True)
    losses = losses_of(run_shared(train_worker, 2, cfg, kind="deepspeed")[0])
    assert losses[-1] < losses[0], losses
    assert json.loads((run / "run.json").read_text())["lora_r"] == 4

    # A crash after step 2's checkpoint: `latest` back on step 2, then --resume replays steps 3 and 4. From the
    # command line without repeating a flag: --model, --lora-r and the rest are the saved run's.
    (run / "checkpoints" / "latest").write_text("step2")
    again = parse_args(["--resume", "--output-dir", str(run), "--no-export"])
    resumed = losses_of(run_shared(train_worker, 2, again, kind="deepspeed")[0])
    np.testing.assert_allclose(resumed, losses[2:], rtol=1e-6)
    # The frozen base is not in the checkpoints (it reloads from --model); the adapters and their moments are.
    (states,) = (run / "checkpoints" / "step2").glob("zero_pp_rank_0_*model_states.pt")
    assert torch.load(states, weights_only=False).get("frozen_param_fragments") is None

    # The trained adapters, from the ZeRO-3 checkpoint, on the base: the logits the export must give.
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    export = run / "hf_export"
    config = AutoConfig.from_pretrained(export)  # the base's config with the run's YaRN
    assert config.rope_parameters["rope_type"] == "yarn"
    trained = get_peft_model(AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=torch.float32),
                             lora_config(4, targets=cfg.lora_targets)).eval()
    adapters = {SequenceParallelCausalLM.plain_name(k): v for k, v in
                get_fp32_state_dict_from_zero_checkpoint(str(run / "checkpoints")).items()}
    assert adapters and all("lora_" in k for k in adapters)
    missing, unexpected = trained.load_state_dict(adapters, strict=False)
    assert not unexpected and not [k for k in missing if "lora_" in k]

    base = AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=torch.float32).eval()
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=torch.float32),
                                       export).eval()
    merged = AutoModelForCausalLM.from_pretrained(export / "merged", dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = trained(input_ids=ids).logits
        assert (want - base(input_ids=ids).logits).abs().max() > 1e-3  # the adapters trained
        torch.testing.assert_close(loaded(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)

    # The same step-2 checkpoint, saved on 2 ranks without its frozen base, resumes on 1 rank: the adapters' ZeRO-3
    # state resharded (tests/test_reshard.py states the tolerance; fp32 reduction order only).
    one = tmp_path / "one-rank"
    shutil.copytree(run, one, ignore=shutil.ignore_patterns("step3", "step4", "hf_export"))
    (one / "checkpoints" / "latest").write_text("step2")
    # Fresh: the suite's shared 1-rank pool runs plain bodies here (a DeepSpeed body would make it restart twice).
    resharded = losses_of(run_distributed(train_worker, 1, replace(cfg, output_dir=str(one), resume=True, export=False))[0])
    np.testing.assert_allclose(resharded, losses[2:], rtol=1e-6)


def test_lora_dry_run_counts_no_optimizer_state_for_the_frozen_base(tmp_path):
    from transformers import Qwen3Config

    from ulysses_lc.train import TrainConfig, dry_run
    from ulysses_lc.train.estimate import DoesNotFit

    folder = tmp_path / "qwen3-8b-shape"  # the Qwen3-8B shape, config only
    Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960).save_pretrained(folder)

    def state_gb(**lora):
        cfg = TrainConfig(model=str(folder), seq_len=131072, data="tiny", dry_run=True, world_size=1,
                          host_memory_gb=250, **lora)
        try:
            text = dry_run(cfg)
        except DoesNotFit as e:  # the full fine-tune's state alone nearly fills one H200: its report still says it
            assert not lora, e
            text = e.report
        return text, float(text.split("ZeRO-3 state ")[1].split()[0].rstrip(","))

    full_text, full = state_gb()
    lora_text, lora = state_gb(lora_r=16)
    assert "LoRA r 16 on all: 43.65 M trained" in lora_text, lora_text
    # 8.19 B weights: 18 bytes each when every one trains; 2 (bf16) frozen plus 18 per adapter parameter with LoRA.
    assert abs(full - 147.4) < 1 and abs(lora - (8.19e9 * 2 + 43.65e6 * 18) / 1e9) < 0.2, (full, lora)
