"""Reference transformer layer stacks in plain PyTorch, used to exercise graphpass.

Each module (``llama``, ``gpt``, ``deepseek``) exposes a frozen ``<Name>Config``,
``SIZES`` (at least ``"tiny"`` and ``"real"``), a ``Model`` and
``build(size, ...) -> (model, example_inputs)``.  ``"tiny"`` is a float32 CPU model
that runs forward+backward in well under a second; ``"real"`` has the published
dimensions of one layer in bfloat16 on the ``meta`` device, so it can be traced
and planned without allocating anything of the model's size.
"""

MODELS = ("llama", "gpt", "deepseek")
