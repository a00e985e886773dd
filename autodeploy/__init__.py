"""autodeploy: a Hugging Face causal LM in, a fast inference engine out.

```python
from autodeploy import autodeploy, SamplingParams
llm = autodeploy("path/to/checkpoint")
print(llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=32, temperature=0))[0].text)
```

The public names load on first use (PEP 562): ``import autodeploy`` and the CLI's ``--help`` do not
pay the seconds that torch, transformers and the registries take to import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from autodeploy import errors

if TYPE_CHECKING:  # the same names, for type checkers and IDEs
    from autodeploy.api import autodeploy, deployment_settings
    from autodeploy.custom_ops import register_backend, register_op, register_tuning_input
    from autodeploy.export import register_export_patch
    from autodeploy.patterns import register_pattern
    from autodeploy.runtime.draft_trees import DraftTree
    from autodeploy.runtime.speculative import register_drafter
    from autodeploy.frontend.async_llm import AsyncLLM
    from autodeploy.frontend.llm import LLM
    from autodeploy.runtime.outputs import CompletionOutput, RequestOutput
    from autodeploy.runtime.sampling_params import SamplingParams
    from autodeploy.frontend.tools import ToolRegistry
    from autodeploy.transforms import Transform, TransformConfig, TransformContext, TransformResult, register_transform

# Public name → the module that defines it.
_MODULE_OF: dict[str, str] = {
    "AsyncLLM": "autodeploy.frontend.async_llm",
    "CompletionOutput": "autodeploy.runtime.outputs",
    "DraftTree": "autodeploy.runtime.draft_trees",
    "LLM": "autodeploy.frontend.llm",
    "RequestOutput": "autodeploy.runtime.outputs",
    "SamplingParams": "autodeploy.runtime.sampling_params",
    "ToolRegistry": "autodeploy.frontend.tools",
    "Transform": "autodeploy.transforms",
    "TransformConfig": "autodeploy.transforms",
    "TransformContext": "autodeploy.transforms",
    "TransformResult": "autodeploy.transforms",
    "autodeploy": "autodeploy.api",
    "deployment_settings": "autodeploy.api",
    "register_backend": "autodeploy.custom_ops",
    "register_drafter": "autodeploy.runtime.speculative",
    "register_export_patch": "autodeploy.export",
    "register_op": "autodeploy.custom_ops",
    "register_pattern": "autodeploy.patterns",
    "register_transform": "autodeploy.transforms",
    "register_tuning_input": "autodeploy.custom_ops",
}

__all__ = [
    "AsyncLLM",
    "CompletionOutput",
    "DraftTree",
    "LLM",
    "RequestOutput",
    "SamplingParams",
    "ToolRegistry",
    "Transform",
    "TransformConfig",
    "TransformContext",
    "TransformResult",
    "autodeploy",
    "deployment_settings",
    "errors",
    "register_backend",
    "register_drafter",
    "register_export_patch",
    "register_op",
    "register_pattern",
    "register_transform",
    "register_tuning_input",
]


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from importlib import metadata

        value: Any = metadata.version("autodeploy")
    elif name in _MODULE_OF:
        value = getattr(importlib.import_module(_MODULE_OF[name]), name)
    else:
        raise AttributeError(f"module 'autodeploy' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, "__version__"})
