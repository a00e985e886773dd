"""autodeploy: a Hugging Face causal LM in, a fast inference engine out.

```python
from autodeploy import autodeploy, SamplingParams
llm = autodeploy("path/to/checkpoint")
print(llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=32, temperature=0))[0].text)
```
"""

from autodeploy import errors
from autodeploy.transforms import Transform, TransformConfig, TransformContext, TransformResult, register_transform
from autodeploy.export import register_export_patch
from autodeploy.custom_ops import register_op
from autodeploy.patterns import register_pattern
from autodeploy.models import factory as _factory, load_weights as _load_weights  # noqa: F401  (register transforms)
from autodeploy.runtime.outputs import CompletionOutput, RequestOutput
from autodeploy.runtime.sampling_params import SamplingParams
from autodeploy.runtime.llm import LLM
from autodeploy.runtime.async_llm import AsyncLLM
from autodeploy.api import autodeploy, deployment_settings

__all__ = [
    "AsyncLLM",
    "CompletionOutput",
    "LLM",
    "RequestOutput",
    "SamplingParams",
    "Transform",
    "TransformConfig",
    "TransformContext",
    "TransformResult",
    "autodeploy",
    "deployment_settings",
    "errors",
    "register_export_patch",
    "register_op",
    "register_pattern",
    "register_transform",
]
