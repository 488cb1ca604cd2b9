"""What a step minimises over the SP group: the token loss's mean and the preference losses.

loss (sp_mean_loss / sp_sum over the SP group, step_num_items for token weighting), router_loss (the MoE routers'
load-balancing loss over the whole sequence), preference (DPO / IPO on packed pairs, reference log-probs).
Imports: levers (the chunked head), parallel and the ground modules.
"""
