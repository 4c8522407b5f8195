"""The event loop of hivemind's DHT and averager processes, made to keep every task it runs.

asyncio holds only weak references to tasks: "save a reference to the result of [create_task], to
avoid a task disappearing mid-execution" (the asyncio docs). hivemind 1.1.12's DHT and averager
processes start a task per request from their parent (``DHT.run``, ``DecentralizedAverager._run_internal``:
``task = asyncio.create_task(...)``, overwritten by the next request) and keep no reference to it. A
task that waits on p2pd can then be garbage-collected mid-call ("Task was destroyed but it is
pending!"); its MPFuture is never set and the caller waits for ever. Seen here: ``DHT.get_visible_maddrs``
right after an averager process forked, in 1 run of tests/allreduce_case.py in 4 on a 2-core machine.

Each of those processes creates its loop with hivemind's ``switch_to_uvloop``; :func:`keep_tasks_in`
rebinds that name, in the calling process only, to a loop whose task factory holds each task until
it is done.
"""

from __future__ import annotations

import asyncio
import types
from typing import Callable


def loop_keeping_its_tasks(new_loop: Callable[[], asyncio.AbstractEventLoop]) -> Callable[[], asyncio.AbstractEventLoop]:
    """`new_loop`, whose loops reference every task they start until it is done."""

    def switch() -> asyncio.AbstractEventLoop:
        loop = new_loop()
        running: set[asyncio.Task] = set()

        def task_factory(loop: asyncio.AbstractEventLoop, coro, **kwargs) -> asyncio.Task:
            task = asyncio.Task(coro, loop=loop, **kwargs)
            running.add(task)
            task.add_done_callback(running.discard)
            return task

        loop.set_task_factory(task_factory)
        return loop

    return switch


def keep_tasks_in(module: types.ModuleType) -> None:
    """Make `module`'s ``switch_to_uvloop`` (hivemind's, bound by name) a loop that keeps its tasks.
    Call it in the process that is about to create its loop: the DHT's or the averager's own."""
    if not getattr(module.switch_to_uvloop, "keeps_tasks", False):
        module.switch_to_uvloop = loop_keeping_its_tasks(module.switch_to_uvloop)
        module.switch_to_uvloop.keeps_tasks = True
