"""`radixkv serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one `LLM`.

    radixkv.serve.app          create_app(llm, ServeConfig(...)): routes, checks, streaming
    radixkv.serve.engine_loop  EngineLoop: the one thread that owns and steps the LLM
    radixkv.serve.metrics      Prometheus metrics        radixkv.serve.protocol  OpenAI wire format
    radixkv.serve.cli          the `radixkv serve` command

Nothing is imported here, so `radixkv serve --help` needs neither torch nor FastAPI.
"""
