"""The ensemble's output filter step as a Triton Python-backend model: ``text_input`` → ``text_output``
through the ``Blocklist`` its config.pbtxt holds (``parameters`` ``blocklist``, a JSON list, and ``action``).

In a stream it sees each response's piece of text on its own, so a term split over two pieces passes;
a filter that must see whole answers belongs behind a non-streamed request (``stream`` false).
"""

from __future__ import annotations

import json

from autodeploy.serve.triton import request_tensors
from autodeploy.serve.triton.blocklist import Blocklist
from autodeploy.serve.triton.tensor_specs import TEXT_INPUT, TEXT_OUTPUT


class OutputFilterModel:
    def initialize(self, args: dict) -> None:
        parameters = json.loads(args["model_config"])["parameters"]
        self.blocklist = Blocklist(json.loads(parameters["blocklist"]["string_value"]), parameters["action"]["string_value"])

    def execute(self, requests: list) -> list:
        return request_tensors.responses(requests, self._outputs)

    def _outputs(self, request) -> list:
        return [request_tensors.string_tensor(TEXT_OUTPUT.name, self.blocklist.apply(request_tensors.required_text(request, TEXT_INPUT.name)))]
