"""The engine core: the scheduler (which owns every request's state), the KV cache manager and block
pool, the request, and the data that crosses the scheduler/runner seam (step_io)."""
