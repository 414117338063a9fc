"""SDPA on the cuDNN backend at one attention shape, a few calls, for ncu to pick
one launch of (run.sh's `detail` step does the same for ours):
ncu --set full -k regex:flash_fprop --launch-skip 3 --launch-count 1 python3 ncu_cudnn_attn.py 4096 4 16 128 0
Arguments: s b h d causal."""
import sys
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

s, b, h, d, causal = (int(a) for a in sys.argv[1:6])
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
    for _ in range(6):
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=bool(causal))
torch.cuda.synchronize()
