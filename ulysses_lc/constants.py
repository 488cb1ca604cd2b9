"""Constants shared across ulysses_lc."""

# Label value that contributes nothing to the loss (PyTorch's cross_entropy default).
IGNORE_INDEX = -100
