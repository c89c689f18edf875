"""tandem's proxy: one port for many models. It starts and stops `python -m server` processes as
jobs and relays OpenAI-style requests to them; it never imports torch or the engine.

Who does what:
    config.py       profiles and proxy settings, validated once (all problems at once)
    jobs.py         job records and their SQLite store
    router.py       one model's replicas, slot leases and FIFO of waiting requests (pure data)
    model_state.py  one model's status, jobs and pool, as the controller sees it
    controller.py   the one task that owns all of the above; it decides, events tell it what happened
    events.py       those events, and the Effects the controller may ask for
    supervisor.py   the Effects: start (ports, health, /props check) and stop servers, timers
    process.py      one server process and its log; children.py: no server outlives the proxy
    forward.py      the byte-for-byte relay; passthrough.py: the routes that use it
    upstream.py     keep-alive HTTP/1.1 to the servers for the relay (h11 on asyncio streams)
    logbus.py       log lines of proxy and servers for /logs/stream; metrics.py: /metrics
    app.py          the FastAPI app behind a small ASGI front; __main__.py the CLI

The life of a streamed chat request:
    1. Completions reads the body, takes `model` from it and starts watching for a disconnect.
    2. controller.acquire posts an Acquire event; the controller answers at once with a lease on the
       least-busy replica that has a free slot, or queues the request (FIFO, bounded: 429 beyond),
       or waits for a load job (starting one when the profile says `autoload`), or refuses it
       (503 not loaded, 404 unknown model).
    3. relay sends the body untouched to the replica and forwards each chunk as it arrives.
    4. A client that leaves cancels the request's task: a queued request leaves the queue; a relayed
       one closes its upstream connection, so the server frees the slot.
    5. At the end, the final `timings` feed /metrics and a Release event frees the slot; the
       controller grants it to the oldest waiter. An upstream that broke marks the replica failed
       (stopped, and restarted when the profile says `restart: on-failure`).
"""
