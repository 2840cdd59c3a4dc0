"""DeepSpeed checkpoints: ZeRO stage 1/2 and 3 and pipeline-engine directories, as
``engine.save_checkpoint`` writes them (format ``deepspeed``), and universal checkpoints, as
``ds_to_universal`` writes them (format ``ucp``, ``reshard.formats.deepspeed.ucp``).

On disk (DeepSpeed ``runtime/engine.py``: ``save_checkpoint``, ``_get_ckpt_name``,
``_get_rank_zero_ckpt_name``)::

    <dir>/latest                                                    the tag, e.g. global_step100
    <dir>/<tag>/mp_rank_{tp:02d}_model_states.pt                    one per tp rank
    <dir>/<tag>/[bf16_]zero_pp_rank_{dp}_mp_rank_{tp:02d}_optim_states.pt   one per (tp, dp) rank

``bf16_`` prefixes the optimizer files when bf16 is on. DeepSpeed also copies its own
``zero_to_fp32.py`` (and, from 0.19.8, ``zero_to_torch.py``) into ``<dir>``: DeepSpeed's
code, which reshard never writes.

States: model weights ``param``; fp32 master ``master``; every tensor the torch optimizer
keeps per flat param (``exp_avg``, ``exp_avg_sq``, ...) under its own name, laid out like
``master``. Scalars (``step``) and all other non-tensor state are carried, never resharded.

Layouts: without a spec, derived from what the files record (``derive``): ``param_shapes`` (the param
groups, each param under its own name in its group's flat buffer), ``frozen_param_shapes``,
``buffer_names``, ``shared_params`` and the module's state dict, so a checkpoint of any model, of a family
reshard knows or of none, is read and written alike, with any number of param groups, frozen parameters,
persistent buffers and tied weights. A pipeline-engine checkpoint is derived alike (``pipe``): each stage's
``param_shapes`` and ``buffer_names`` and the layer files' tensors, each under its recorded name
``<layer index>.<name>`` on the stage holding it (``@stage(s)``), converted at its own pp. A spec
(``deepspeed-llama``, a user's file) lays it out instead, and is needed where DeepSpeed records too little:
tensor parallelism (how tp split each tensor) and a new pp for the pipeline engine (which layers a stage holds
is the model's partitioning: ``deepspeed-pipe-<family>``, its family taken from the ``config.json`` beside it).
A family's layout holds each tensor as the transformers model does (GPT-2's Conv1D weights ``[in, out]``), and
the output projection of a family that always ties it (Gemma, Gemma 2, Gemma 3, GPT-2) as a DeepSpeed run of
that model saves it: the embedding once in the flat buffer, ``lm_head.weight`` beside it in the module's state
dict, named in ``shared_params`` (``derive.model_of_layout``: a family's layout's ``DsModel``, whose ties the
files record as a derived layout's are).

From a checkpoint of another format, a derived layout puts the tensors with optimizer state in the param
groups the source's optimizer had when it records them (a DCP checkpoint's ``param_groups``: each group's
params in its order, its hyperparameters and Adam ``step`` carried), in one group otherwise; the rest are
frozen. No ``clip_grad`` is written for such a source (DeepSpeed's loader would put it over the resuming
run's ``gradient_clipping``). ``optimizer_groups`` gives a DeepSpeed source's param groups, params by name,
to another format's target.

ZeRO stage 3 checkpoints are read and written by ``reshard.formats.deepspeed.zero3``; universal
folders by ``reshard.formats.deepspeed.ucp``; the pipeline engine's layer files by
``reshard.formats.deepspeed.pipe``.

Not supported, each refused with a message: MoE expert files, tied pipeline modules
(``tied_modules.*``, and so the pipeline engine for a family that ties its head, or stores its tensors other
than its model holds them: Gemma, GPT-2), ``round_robin_gradients``, ``parameter_alignment``, tp > 1 without a spec that
splits over tp, another pp or tp for a pipeline of a model no family describes, and (until the planner
can take the weights of some tensors from their fp32 masters and of others as stored) conversions between
ZeRO-3 and ZeRO-1/2 of a model with frozen parameters or persistent buffers.

The modules, each importing only modules listed above it::

    state    the non-tensor state: carried from a source, synthesized, put back into a file's tree
    files    the files: names, finding them under a save dir or tag dir, reading and writing one
    derive   the layouts derived from what a checkpoint records (``DsModel``), for any model
    sources  what a target takes from a source of any format: layout, training dtype, identity
    sizes    the model sizes: given, from a config.json, or from the param shapes
    zero12   ZeRO-1/2: the flat-partition layout, and the checks of the files against it
    pipe     the pipeline engine: its layer files, read and written; the layout a pipeline records
    write    the trees of the ZeRO-1/2 model and optimizer files a write lays down
    zero3    ZeRO stage 3, read and written
    format   ``DeepSpeedFormat``: the ``deepspeed`` format's entry points, and ``FORMAT``
    ucp      universal checkpoints: the ``ucp`` format
"""

from __future__ import annotations

from reshard.formats.deepspeed.derive import DsModel
from reshard.formats.deepspeed.format import FORMAT, DeepSpeedFormat, optimizer_groups
from reshard.formats.deepspeed.state import DeepSpeedExtra, DsOptimizer, Scalar, synthesize_extra

__all__ = ["FORMAT", "DeepSpeedExtra", "DeepSpeedFormat", "DsModel", "DsOptimizer", "Scalar", "optimizer_groups",
           "synthesize_extra"]
