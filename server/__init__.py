"""tandem's HTTP server: one engine behind llama-server-compatible endpoints (`python -m server`).

The life of a request here:
1. edge.EdgeMiddleware checks the API key, the body size and whether the server is draining.
2. FastAPI parses the body into a protocol model (types and ranges); errors become 400s in the
   OpenAI shape (http_errors.py, shared with the proxy).
3. openai_api renders the chat template and tokenizes (tokenizing.py); generation.prepare checks
   the model name, the lengths against the slot context, the sampling parameters and the wait
   queue's limit, all before a slot is taken.
4. runner.EngineRunner submits to the engine thread; each step's outputs come back through
   call_soon_threadsafe into the request's asyncio queue.
5. generation.run decodes text incrementally, applies stop strings (stop.py) and ends with
   finish_reason, usage and timings; openai_api shapes chunks (SSE) or one object.
6. A client that leaves cancels its request (the slot frees within one engine step); SIGTERM
   drains in-flight requests, then exits 0 (__main__.py).

Modules: flags (the command line, no torch; the proxy checks profiles with it), cli (engine config
and settings from the flags), state (settings, shared state), protocol (wire models, no torch),
metrics (Prometheus text), tokenizing (prompt text to ids, off the event loop), memory (freed heap
back to the OS), logs (logging setup, no torch; the proxy uses it too).
"""
