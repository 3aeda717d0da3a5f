"""FP8 lowering of linear layers: quantization recipes (``recipes``) and the pieces built on them."""
