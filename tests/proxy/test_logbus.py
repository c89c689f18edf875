"""/logs/stream's bus: a subscriber that falls behind loses lines and is told how many, where."""
import asyncio

from proxy.logbus import SUBSCRIBER_BUFFER, LogBus


def test_a_slow_subscriber_is_told_how_many_lines_it_lost_before_the_next_it_gets():
    async def scenario() -> list[str]:
        bus = LogBus()
        sub = bus.subscribe("m")
        for i in range(SUBSCRIBER_BUFFER + 5):
            bus.publish("server", f"line {i}", "m")
        bus.publish("server", "another model's line", "other")
        got = [(await sub.next()).line for _ in range(SUBSCRIBER_BUFFER)]
        bus.publish("server", "after", "m")
        got += [(await sub.next()).line for _ in range(2)]
        assert sub.queue.empty()
        return got

    got = asyncio.run(scenario())
    assert got[:SUBSCRIBER_BUFFER] == [f"line {i}" for i in range(SUBSCRIBER_BUFFER)]
    assert got[SUBSCRIBER_BUFFER:] == ["[5 lines dropped]", "after"]


def test_a_subscriber_that_keeps_up_loses_nothing_and_hears_no_notice():
    async def scenario() -> list[str]:
        bus = LogBus()
        sub = bus.subscribe()
        got = []
        for i in range(3 * SUBSCRIBER_BUFFER):
            bus.publish("proxy", f"line {i}")
            got.append((await sub.next()).line)
        return got

    assert asyncio.run(scenario()) == [f"line {i}" for i in range(3 * SUBSCRIBER_BUFFER)]
