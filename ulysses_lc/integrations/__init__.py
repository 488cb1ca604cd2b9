"""Other frameworks driving the same step: transformers' Trainer, TRL's SFT and DPO trainers, accelerate.

hf_trainer (UlyssesTrainer, ulysses_trainer), hf_dpo (TRL's DPOTrainer on SP log-probabilities), trainer_engine
(the Trainer's DeepSpeed engine gets our mpu).
Imports: anything below train/ (model.py, data, plan, ...).
"""
