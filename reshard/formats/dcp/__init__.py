"""PyTorch Distributed Checkpoint (DCP) directories: ``.metadata`` plus ``__{rank}_0.distcp`` files.

What is read. ``.metadata`` (see ``reshard.io.dcp_metadata``) lists every
flattened state-dict key: tensors with their global size and chunks (boxes),
and bytes entries. Keys follow ``get_state_dict``'s flattening:
``model.<fqn>`` (or bare ``<fqn>``, as torchtitan saves), then
``optim.state.<fqn>.<state>`` (``optimizer.`` also accepted) and
``optim.param_groups.<i>.<key>``. Each model parameter becomes a logical
tensor named by its fqn (``model.layers.0.self_attn.q_proj.weight`` for a
Hugging Face model), state ``param``; each optimizer state with the
parameter's shape becomes that tensor's state of the same name
(``exp_avg``, ``exp_avg_sq``, any other optimizer's). Every chunk is an item
whose bytes are located inside its ``torch.save`` archive in the ``.distcp``
file (the archive's zip index is read, never the tensor data), so a target
reads just the rows it needs instead of deserializing whole chunks.
A 0-d ``model.<fqn>`` entry (BatchNorm's ``num_batches_tracked``) is a
tensor of the model like any other; other 0-d tensors (Adam's per-parameter
``step``) and bytes entries (``param_groups``) are carried verbatim to a DCP
target. A tensor with no elements is refused by name (it would be lost).

Model sizes (for targets that need them: hf, megatron, deepspeed) come from a
Hugging Face Llama ``config.json`` in the checkpoint directory or its parent
(where Accelerate keeps it), or from ``sizes``. reshard writes one beside the
``.metadata`` it writes when the sizes are known; ``dcp.load`` ignores it.

What is written. The layout ``get_state_dict`` + ``dcp.save`` produce for a
model sharded with FSDP2 (``fully_shard``) over ``dp`` ranks: every tensor
``Shard(0)`` with ``torch.chunk`` semantics (64 rows at 3 ranks: 22, 22, 20;
ranks past the end hold nothing), rank ``r``'s chunks in ``__{r}_0.distcp``,
each a ``torch.save`` archive, then ``.metadata`` as DCP pickles it; a
0-d tensor (a buffer FSDP2 leaves whole) is one chunk in rank 0's file. Real
``dcp.load`` loads it at any mesh (DCP reshards boxes at load time); with the
same mesh, each rank reads only its own file. A source's fp32 master weights
(state ``master``), when it has them, are what ``model.<fqn>`` holds, since
FSDP2 keeps fp32 sharded parameters; optimizer states go to
``optim.state.<fqn>.<state>``. A non-DCP source gets Adam's per-parameter
``step`` (0-d float32, from the source's step or iteration count) for each
tensor with optimizer state (never a buffer) and one Adam ``param_groups``
entry (``lr`` from the source when known, torch's defaults otherwise).
A DeepSpeed source tells more, and all of it is carried: its param groups
(each group's hyperparameters, its params by fqn, its Adam ``step``), its
frozen params and persistent buffers (``model.<fqn>``, from their weights:
they have no master; a buffer whole, one chunk, as FSDP2 leaves it), and its
tied weights (``shared_params``), which ``get_state_dict`` holds under both
names: the ``.metadata`` FSDP2 itself writes for the same module.
``optimizer_groups`` gives a DCP source's param groups to another format's
target in the same terms.
"""

from reshard.formats.dcp.format import FORMAT, DcpFormat, optimizer_groups
from reshard.formats.dcp.reading import ParamGroup

__all__ = ["FORMAT", "DcpFormat", "ParamGroup", "optimizer_groups"]
