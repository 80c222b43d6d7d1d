"""The Megatron-core trainer for GPUs (``docs/megatron.md``).

``config.py``: config.json -> ``TransformerConfig``/``GPTModel`` arguments and the trainer's
options (pure); ``names.py``: Hugging Face <-> Megatron weight names and layouts (torch
only); ``model.py``: the ``GPTModel``, one process (needs the ``megatron`` extra);
``trainer.py``: ``MegatronTrainer`` (CUDA); ``device_check.py``: its check against vLLM,
run by ``scripts/device-check``. Importing this package imports no megatron.
"""
