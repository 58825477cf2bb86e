"""One vLLM CPU attention call in bfloat16 (its AMX kernel where the CPU has AMX).

``python amx_attention.py ask|no``: ask Linux for AMX tiles first, or not.
Prints the ISA vLLM chose, then ``ok`` and a checksum of the output.
"""

from __future__ import annotations

import sys

if sys.argv[1] == "ask":
    from fabric.integrations.vllm.amx import request_amx_tiles

    assert request_amx_tiles()
import torch

# NOTE: not through fabric.launch.vllm_main (its import asks for tiles); these
# imports need no vllm distribution metadata
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

HEADS, DIM, BLOCKS, BLOCK, TOKENS = 2, 64, 4, 32, 32
isa = _get_attn_isa(torch.bfloat16, BLOCK, DIM)
print("isa", isa, flush=True)
key_cache = torch.randn(BLOCKS, HEADS, BLOCK, DIM, dtype=torch.bfloat16)
value_cache = torch.randn(BLOCKS, HEADS, BLOCK, DIM, dtype=torch.bfloat16)
query = torch.randn(TOKENS, HEADS, DIM, dtype=torch.bfloat16)
output = torch.empty_like(query)
starts = torch.tensor([0, TOKENS], dtype=torch.int32)
lengths = torch.tensor([TOKENS], dtype=torch.int32)
metadata = ops.cpu_attn_get_scheduler_metadata(
    num_reqs=1,
    num_heads=HEADS,
    num_kv_heads=HEADS,
    head_dim=DIM,
    seq_lens=lengths,
    dtype=torch.bfloat16,
    query_start_loc=starts,
    causal=True,
    sliding_window_size=-1,
    isa=isa,
    enable_kv_split=False,
)
ops.cpu_attention_with_kv_cache(
    query=query,
    key_cache=key_cache,
    value_cache=value_cache,
    output=output,
    query_start_loc=starts,
    seq_lens=lengths,
    scale=DIM**-0.5,
    causal=True,
    alibi_slopes=None,
    sliding_window=-1,
    block_table=torch.tensor([[0]], dtype=torch.int32),
    softcap=0.0,
    scheduler_metadata=metadata,
    s_aux=None,
)
print("ok", float(output.float().abs().sum()), flush=True)
