"""Hugging Face checkpoints: ``config.json`` plus safetensors weights.

A directory holds ``config.json`` and either ``model.safetensors`` or
``model.safetensors.index.json`` with the shards it names
(``model-00001-of-0000N.safetensors``, ...). Every tensor is stored whole and
unsharded under its Hugging Face name, which is also its logical name, so
the layout is the model family's (``reshard.models``, chosen by the config's
``model_type``, never guessed) resolved at the trivial topology: ``hf-llama``
(``hf-llama-tied`` with ``tie_word_embeddings``), ``hf-mixtral`` (experts
stored per expert), ``hf-gpt2`` (output layer tied, Conv1D weights stored
``[in, out]``). A ``model_type`` no family claims (any other model) gets a
layout derived from the safetensors headers: every tensor whole under its own
name, in its own dtype, 0-d ones and ones with no elements included. The config travels: written back as read, or built from the family and the
source's sizes and hints when the source is another format. Not supported: GPT-2 files of old
``transformers`` versions (names without the ``transformer.`` prefix,
``attn.bias`` mask buffers) and untied GPT-2; they fail as unmatched tensors.

Reading checks both ways, before any tensor byte is read: every item the
spec expects is stored with the expected shape, and every stored tensor is
an item of the spec (fail closed: an unknown tensor is an error, never
skipped). Writing streams each tensor from ``fill`` in windows of at most
8 MiB into files laid out as ``save_pretrained`` lays them out. A Hugging
Face checkpoint holds model weights only (state ``param``).
"""

from reshard.formats.hf.format import FORMAT, HFFormat, hf_spec_name

__all__ = ["FORMAT", "HFFormat", "hf_spec_name"]
