"""The front ends a program talks to: ``LLM`` (generate, stream, logits, chat, save), ``AsyncLLM`` for asyncio
servers, chat templates, tool calls and the ``ToolRegistry`` agent loop, and reasoning blocks.

They take a built ``Deployment`` (``autodeploy/deployment.py``) and drive the engine in ``autodeploy/runtime``,
which imports nothing from here; the HTTP and Triton servers (``autodeploy/serve``), the CLI and the
benchmarks sit above. The public names are ``autodeploy``'s (``from autodeploy import LLM, AsyncLLM, ToolRegistry``).
"""
