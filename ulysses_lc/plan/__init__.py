"""The sizing model: what each layer keeps, what a step holds and costs, and what was measured.

memory (plan_memory -> MemoryPlan), memory_model (a step's bytes per rank, fitted to H200 peaks), sizing (Job:
predicted memory, fit, longest sequence, step time), deltanet_time (the gated DeltaNet layers' path and measured
cost per token in that step time), first_step (what a first step adds where its kernels are not cached), metrics (FLOPs per step, StepLogger).
Imports: mixers, levers, objectives, parallel and the ground modules (it prices what they keep).
"""
