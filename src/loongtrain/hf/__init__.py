"""Hugging Face checkpoints in and out, and HF models on loongtrain attention.

- :mod:`~loongtrain.hf.families`: HF config <-> ``ModelConfig`` (llama, mistral, qwen2, qwen3)
- :mod:`~loongtrain.hf.weights`: parameter names and the q/k RoPE row order
- :mod:`~loongtrain.hf.folder`: a local folder's config.json and safetensors tensor table
- :mod:`~loongtrain.hf.load`: checks and sharded loading into a (FSDP2) model
- :mod:`~loongtrain.hf.attention`: 2D head-context attention in transformers' AttentionInterface

The trainer's side lives in ``loongtrain.train``: ``model_setup`` (``[model] init_from``) and
``export`` (a training checkpoint as an HF folder, ``loongtrain export``).

Needs ``pip install 'loongtrain[hf]'`` (transformers, safetensors) when used; importing
this package does not.
"""
