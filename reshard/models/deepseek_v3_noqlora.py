"""DeepSeek-V3 without the queries' low-rank compression (``q_lora_rank`` null: Moonlight, small V3-style models):
``self_attn.q_proj`` ``[(heads qhd), h]`` where ``deepseek_v3`` has ``q_a_proj``, ``q_a_layernorm`` and
``q_b_proj``; Megatron-core's ``linear_q_proj`` (column-parallel: split by head over tp; no input norm) and
``q_lora_rank`` None in its args. Everything else is ``reshard.models.deepseek_v3``'s."""

from __future__ import annotations

from reshard.models.deepseek_v3 import family

__all__ = ["FAMILY"]

FAMILY = family(q_lora=False)
