"""`radixkv serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one `LLM`.

    radixkv.serve.http_server  uvicorn with connection timers and the graceful shutdown
    radixkv.serve.door         every request's first stop: body limit, read deadline, 500s
    radixkv.serve.app          create_app(llm, ServeConfig(...)): routes, preparation, streaming
    radixkv.serve.bodies       request bodies checked (OpenAI's rules: null = default, strict types)
    radixkv.serve.structured   response_format / vLLM's structured_outputs -> one constraint
    radixkv.serve.tools        tools and tool_choice: prompt, grammar, reading the calls back
    radixkv.serve.choices      n > 1: the choices' replies and usage merged
    radixkv.serve.grammar_pool grammars compiled in killable worker processes (grammar_worker)
    radixkv.serve.engine_loop  EngineLoop: the one thread that owns and steps the LLM
    radixkv.serve.stop_strings the stop-string matcher     radixkv.serve.config    ServeConfig
    radixkv.serve.metrics      Prometheus metrics          radixkv.serve.protocol  OpenAI replies
    radixkv.serve.cli          the `radixkv serve` command

Nothing is imported here, so `radixkv serve --help` needs neither torch nor FastAPI.
"""
