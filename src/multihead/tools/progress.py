"""One progress bar for the tools' long loops: tqdm on stderr, else rich, else none."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["progress_bar"]


@contextmanager
def progress_bar(total: int, enabled: bool, desc: str, unit: str = "step") -> Iterator[Callable[..., None]]:
    """Yields ``step(note=None)``: one unit done, with an optional short note (e.g. the loss).

    A tqdm bar on stderr when ``enabled`` (rich's when tqdm is missing, none
    when neither is installed); ``step`` does nothing when not enabled.
    """
    if not enabled:
        yield lambda note=None: None
        return
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr)

        def step(note: str | None = None) -> None:
            if note is not None:
                bar.set_postfix_str(note, refresh=False)
            bar.update(1)

        try:
            yield step
        finally:
            bar.close()
        return
    try:
        from rich.progress import Progress
    except ImportError:
        yield lambda note=None: None  # neither installed: no bar
        return
    with Progress(transient=True) as rich_bar:
        task = rich_bar.add_task(desc, total=total)
        yield lambda note=None: rich_bar.update(task, advance=1, description=desc if note is None else f"{desc} {note}")
