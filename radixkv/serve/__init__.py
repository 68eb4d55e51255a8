"""`radixkv serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one engine, which
runs in a process of its own (the front end keeps HTTP, templates, tokenizing, grammar compiles,
detokenizing and streaming) or, given an `LLM`, on a thread of the server's process.

    radixkv.serve.http_server  uvicorn with connection timers and the graceful shutdown
    radixkv.serve.door         every request's first stop: body limit, read deadline, 500s
    radixkv.serve.app          create_app(engine, ServeConfig(...)): routes, preparation, streaming
    radixkv.serve.bodies       request bodies checked (OpenAI's rules: null = default, strict types)
    radixkv.serve.structured   response_format / vLLM's structured_outputs -> one constraint
    radixkv.serve.tools        tools and tool_choice: prompt, grammar, reading the calls back
    radixkv.serve.choices      n > 1: the choices' replies and usage merged
    radixkv.serve.grammar_pool grammars compiled in killable worker processes (grammar_worker)
    radixkv.serve.engine_handle   EngineHandle: the request streams, whatever carries them
    radixkv.serve.engine_worker   EngineWorker: the step loop, the one owner of the LLM
    radixkv.serve.engine_loop     EngineLoop: the worker on a thread of this process
    radixkv.serve.engine_client   EngineClient: the worker in an engine process (engine_process)
    radixkv.serve.served_model    what the front end knows of the model: tokenizer, sizes
    radixkv.serve.stop_strings the stop-string matcher     radixkv.serve.config    ServeConfig
    radixkv.serve.metrics      Prometheus metrics          radixkv.serve.protocol  OpenAI replies
    radixkv.serve.cli          the `radixkv serve` command

Nothing is imported here, so `radixkv serve --help` needs neither torch nor FastAPI.
"""
