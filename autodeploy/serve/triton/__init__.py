"""Triton Inference Server backend: ``autodeploy triton-repo MODEL --out DIR`` writes a model repository
(the engine as a Python-backend model, decoupled unless ``--decoupled false``, tokenizer pre/post-processing,
an optional output filter, an ensemble of them); ``launch.py`` starts the server of the ``nvidia-pytriton``
wheel on it; ``client.py`` streams requests to it. See docs/triton.md (the manual) and notes/triton.md.

    from autodeploy import autodeploy
    from autodeploy.serve.triton import write_model_repository
    write_model_repository(autodeploy("path/to/checkpoint"), "triton-repo")
"""

from autodeploy.serve.triton.blocklist import Blocklist
from autodeploy.serve.triton.repository import write_model_repository

__all__ = ["Blocklist", "write_model_repository"]
