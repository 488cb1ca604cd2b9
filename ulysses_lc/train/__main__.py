"""`torchrun --nproc_per_node N -m ulysses_lc.train [flags]`: the main job from any folder, no checkout needed."""

from .cli import main

main()
