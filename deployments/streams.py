"""Several async streams read as one (asyncio only: the ingress imports it without torch), and
the tail of a streamed text that may still turn out to begin a marker."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import TypeVar

Item = TypeVar("Item")


async def interleave(
    streams: Sequence[AsyncGenerator[Item, None]], first_alone: bool = False
) -> AsyncIterator[tuple[int, Item]]:
    """The items of ``streams`` as they come, each with its stream's index; done when every
    stream is. ``first_alone``: the others start once stream 0 has sent its first item (choices
    that copy the first one's prefill). An exception from a stream is raised here; leaving
    early or failing closes every stream (closing an engine stream cancels its request)."""
    queue: asyncio.Queue[tuple[int, Item | None, BaseException | None]] = asyncio.Queue()

    async def pump(index: int) -> None:
        try:
            async with contextlib.aclosing(streams[index]) as stream:
                async for item in stream:
                    await queue.put((index, item, None))
        except Exception as exc:
            await queue.put((index, None, exc))
        await queue.put((index, None, None))

    first = range(1) if first_alone else range(len(streams))
    tasks = [asyncio.create_task(pump(index)) for index in first]
    num_done = 0
    try:
        while num_done < len(streams):
            index, item, error = await queue.get()
            if index == 0 and len(tasks) < len(streams):
                tasks += [asyncio.create_task(pump(other)) for other in range(1, len(streams))]
            if error is not None:
                raise error
            if item is None:
                num_done += 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def marker_start_length(text: str, markers: Sequence[str]) -> int:
    """How many characters at the end of ``text`` could be the beginning of one of ``markers``
    (the longest such end, held back while streaming until the next text tells)."""
    for length in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(marker.startswith(text[-length:]) for marker in markers):
            return length
    return 0
