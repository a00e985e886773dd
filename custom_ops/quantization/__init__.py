"""The quantization schemes, one module each (``int8_wo``, ``int4_wo``, ``int4_awq``, ``int4_gptq``, ``fp8``,
``smoothquant``): a :class:`~autodeploy.custom_ops.quantized_linear.QuantMethod` registered by name beside the
canonical ops it computes with. Importing this package imports every module in it, so a new scheme is one
file here (plus its kernels): nothing else names it.
"""

import importlib
import pkgutil

for _module in sorted(pkgutil.iter_modules(__path__), key=lambda found: found.name):
    importlib.import_module(f"{__name__}.{_module.name}")
