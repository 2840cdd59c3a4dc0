"""Python's cyclic garbage collector, paused while layouts and plans are built.

Resolving a spec and planning allocate hundreds of thousands of small objects that form no cycles (items,
fragments, boxes, copies). The cyclic collector would walk all of them again and again as they pile up: about half
the time of resolving and planning a Llama-405B-shaped checkpoint, and of a 100,000-tensor plan. Once made, they
live until the conversion ends, while copying makes few objects and fewer cycles (18 collected over the 100,000
tensors of ``bench/small_tensors.py``): a conversion keeps the collector paused until it has written its manifest,
which saved a sixth of that benchmark's time.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["collector_paused"]


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic collector for the ``with`` block; it runs again afterwards (if it ran before).

    What the block made then joins the oldest generation (``freeze`` then ``unfreeze``, both constant-time), so
    the collector's first young-generation pass does not walk it once more; a caller that froze objects itself
    keeps them frozen. Nested blocks are cheap: only the outermost one turns the collector back on.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if gc.get_freeze_count() == 0:
            gc.freeze()
            gc.unfreeze()
        if enabled:
            gc.enable()
