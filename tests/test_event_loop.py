"""hivemind's process loops keep the tasks they start (p2p_diloco/event_loop.py): a task that nothing
else references survives a garbage collection while it waits, as a DHT request waiting on p2pd must."""

import asyncio
import gc
import types
import weakref

import hivemind.averaging.averager
import hivemind.dht.dht
import hivemind.utils.asyncio
import pytest
import uvloop

from p2p_diloco.event_loop import keep_tasks_in, loop_keeping_its_tasks


def run_an_unreferenced_task(loop: asyncio.AbstractEventLoop) -> list[str]:
    """What becomes of a task started the way hivemind starts a request's (no reference kept) that waits on
    a future only it references, across a garbage collection: "done" if it finished, "destroyed" if collected."""
    outcome: list[str] = []
    waits_on: list[weakref.ref] = []

    async def request() -> None:
        future = asyncio.get_running_loop().create_future()
        waits_on.append(weakref.ref(future))
        try:
            await future
            outcome.append("done")
        except GeneratorExit:
            outcome.append("destroyed")
            raise

    async def serve() -> None:
        asyncio.create_task(request())
        await asyncio.sleep(0)  # the request runs up to its wait
        gc.collect()
        future = waits_on[0]()
        if future is not None:
            future.set_result(None)
        await asyncio.sleep(0.01)

    try:
        loop.run_until_complete(serve())
    finally:
        loop.close()
    return outcome


def test_a_plain_loop_loses_an_unreferenced_waiting_task():
    """The failure the module exists for: without it the request is collected mid-call."""
    assert run_an_unreferenced_task(uvloop.new_event_loop()) == ["destroyed"]


@pytest.mark.parametrize("new_loop", [uvloop.new_event_loop, asyncio.new_event_loop], ids=["uvloop", "asyncio"])
def test_a_loop_that_keeps_its_tasks_finishes_the_request(new_loop):
    assert run_an_unreferenced_task(loop_keeping_its_tasks(new_loop)()) == ["done"]


def test_keep_tasks_in_rebinds_the_modules_loop_once():
    # a stand-in for hivemind.dht.dht: its own switch_to_uvloop would install uvloop's policy in pytest's process
    module = types.SimpleNamespace(switch_to_uvloop=uvloop.new_event_loop)
    keep_tasks_in(module)
    rebound = module.switch_to_uvloop
    keep_tasks_in(module)  # a second call does not wrap it again
    assert module.switch_to_uvloop is rebound
    assert run_an_unreferenced_task(rebound()) == ["done"]


def test_the_dht_and_the_averager_name_the_loop_that_is_rebound():
    """keep_tasks_in rebinds a module-level name: it must still be the one hivemind's processes call."""
    for module in (hivemind.dht.dht, hivemind.averaging.averager):
        assert module.switch_to_uvloop is hivemind.utils.asyncio.switch_to_uvloop
