"""Examples of using graphpass: ``train.py`` (a short training loop on a synthetic task, and
bf16 GEMMs computed in fp32 for comparisons) and ``torchtitan_step.py`` (torchtitan's models
compiled with graphpass). The reference models live in the package: ``graphpass.models``."""
