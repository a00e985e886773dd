"""The deployed model as an artifact (TensorRT-LLM's "plan file"): ``LLM.save(DIR)`` / ``autodeploy build``.

A saved deployment is the transformed graph in ``torch.export``'s format, its tensors in safetensors, the
resolved settings, the kernel choices and tuning dispatches, the tokenizer, and a manifest with the
versions, device and source it was built from and every file's sha256 (``layout.py`` lists the files).
``autodeploy(DIR)`` serves it without export, transforms or verification; under other library versions or
on another device kind it is rebuilt from its source with a warning, or refused when the source is gone.
Only safetensors and checked ``torch.export`` archives are read: nothing is unpickled.

```python
from autodeploy import autodeploy
llm = autodeploy("path/to/checkpoint")
llm.save("deployed/my-model")
llm = autodeploy("deployed/my-model", max_batch_size=8)   # runtime settings may change; dtype etc. may not
```
"""

from .layout import SETTINGS, is_saved_deployment
from .load import load_deployment
from .manifest import Manifest
from .rebuild import rebuild_source
from .save import check_save_destination, save_deployment

__all__ = [
    "SETTINGS",
    "Manifest",
    "check_save_destination",
    "is_saved_deployment",
    "load_deployment",
    "rebuild_source",
    "save_deployment",
]
