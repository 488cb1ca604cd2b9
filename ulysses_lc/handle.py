"""What every `install_*` call returns: a handle whose `undo()` gives the model back as it was."""

from __future__ import annotations

from collections.abc import Callable


class Handle:
    """An installed lever. `undo()` reverses the installation; a second call does nothing.

    Levers with state to show or change (checkpointing's plan and host memory) subclass it.
    """

    def __init__(self, undo: Callable[[], None] | None = None, name: str = ""):
        self._undo_fn = undo
        self.name = name

    @property
    def installed(self) -> bool:
        return self._undo_fn is not None

    def undo(self) -> None:
        fn, self._undo_fn = self._undo_fn, None
        if fn is not None:
            fn()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name or 'lever'}, {'installed' if self.installed else 'undone'})"


__all__ = ["Handle"]
