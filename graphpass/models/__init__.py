"""Reference transformer layer stacks in plain PyTorch, shipped with graphpass for
``graphpass report --model llama|gpt|deepseek`` and for trying graphpass on a known model.

Each module (``llama``: Llama-3-8B, ``gpt``: the GPT-3 175B layer, ``deepseek``: DeepSeek-V3's
MLA and MoE) exposes a frozen ``<Name>Config``, ``SIZES`` (at least ``"tiny"`` and ``"real"``),
a ``Model`` and ``build(size, ...) -> (model, example_inputs)``. ``"tiny"`` is a float32 CPU
model that runs forward+backward in well under a second; ``"real"`` has the published
dimensions of one layer in bfloat16 on the ``meta`` device, so it can be traced and planned
without allocating anything of the model's size.

    from graphpass.models import llama
    model, (x,) = llama.build("tiny")
"""

MODELS = ("llama", "gpt", "deepseek")
