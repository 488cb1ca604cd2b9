"""`python -m ulysses_lc.eval`: the `ulysses-lc-eval` command (cli.py)."""

from .cli import main

if __name__ == "__main__":
    main()
