"""Free memory figures for tests that run the CUDA branch of the plan on a CPU machine."""

from ulysses_lc import memory, memory_model


def room_for_one_input(shape, seq_len: int) -> float:
    """Free device bytes at which plan_step_memory (reserving nothing) can keep one checkpointed input and its
    attention output on the device beside one layer's recompute, and no more: every layer checkpointed, the rest
    of the inputs offloaded (by the memory model's terms, memory.step_terms)."""
    terms = memory.step_terms(shape, seq_len)
    slack = 1 + memory_model.allocator_slack(shape, 1)
    step = terms.loss + terms.recompute + 1.5 * (terms.kept + terms.cached)
    return memory.LATER_CONTEXT_BYTES + (memory_model.zero3_working_bytes(shape.largest_module_params) + step) * slack
