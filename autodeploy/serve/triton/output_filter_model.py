"""The ensemble's output filter step as a Triton Python-backend model, through the ``Blocklist`` its
config.pbtxt holds (``parameters`` ``blocklist``, a JSON list, and ``action``).

In: ``text_input`` (the text a response adds), ``text_so_far`` (the answer up to that response's end) and
``finish_reason`` ("" until the last response). Out: the filtered ``text_output`` and ``finish_reason``,
"content_filter" when ``refuse`` cut the answer (``Blocklist.filter_response``: a stream is filtered as
a whole, without state between responses).
"""

from __future__ import annotations

import json

from autodeploy.serve.triton import request_tensors
from autodeploy.serve.triton.blocklist import Blocklist
from autodeploy.serve.triton.tensor_specs import FINISH_REASON, TEXT_INPUT, TEXT_OUTPUT, TEXT_SO_FAR


class OutputFilterModel:
    def initialize(self, args: dict) -> None:
        parameters = json.loads(args["model_config"])["parameters"]
        self.blocklist = Blocklist(json.loads(parameters["blocklist"]["string_value"]), parameters["action"]["string_value"])

    def execute(self, requests: list) -> list:
        return request_tensors.responses(requests, self._outputs)

    def _outputs(self, request) -> list:
        piece = request_tensors.required_text(request, TEXT_INPUT.name)
        finish_reason = request_tensors.optional_scalar(request, FINISH_REASON.name) or ""
        text, finish_reason = self.blocklist.filter_response(piece, request_tensors.optional_scalar(request, TEXT_SO_FAR.name), finish_reason)
        return [request_tensors.string_tensor(TEXT_OUTPUT.name, text), request_tensors.string_tensor(FINISH_REASON.name, finish_reason)]
