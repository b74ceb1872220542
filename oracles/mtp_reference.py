"""A float64 reference of Qwen3.5's multi-token-prediction (MTP) block.

transformers loads a Qwen3.5 checkpoint's mtp.* tensors but builds no module
that runs them, so the block is put together here from transformers' own
pieces, as the released checkpoints' config describes it (mtp_num_hidden_layers
= 1) and llama.cpp's draft-mtp runs it:

    e_q = RMSNorm_enorm(embed(x_{q+1})),  h_q = RMSNorm_hnorm(model's final-normed hidden state at q)
    y_q = fc([e_q | h_q])                                     (mtp.fc: 2*hidden -> hidden)
    y   = Qwen3_5DecoderLayer (a full-attention layer: gated q, q/k norms, partial RoPE)
          over y_0 .. y_{n-1} at positions 0 .. n-1, causal
    logits_q = lm_head(RMSNorm_norm(y_q))                     (mtp.norm, the model's head)

logits_q guesses x_{q+2}. RMSNorm is Qwen3_5RMSNorm ((1 + w) x / rms). The
model runs in float64 as oracles.hf_reference loads it.
"""
from __future__ import annotations

import numpy as np


def mtp_tensors(state_dict: dict) -> dict:
    """The mtp.* tensors of a checkpoint's state dict, by their name under mtp."""
    return {k[len("mtp."):]: v for k, v in state_dict.items() if k.startswith("mtp.")}


def mtp_reference(model, mtp: dict, ids, extra=()):
    """(logits, block output) of the MTP block over the pairs (hidden state at
    q, ids[q+1]) for q = 0 .. len(ids)-2, after model (a float64
    Qwen3_5ForCausalLM) on ids; mtp: the block's tensors (mtp_tensors). Each
    token of extra then chains on: the block's last normed output and that
    token, one position further. Logits (n, vocab), outputs (n, hidden)."""
    import torch
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    cfg = model.config
    dtype = torch.float64
    inner = model.model
    with torch.no_grad():
        x = torch.tensor([list(ids)], dtype=torch.long)
        hidden = inner(x).last_hidden_state[0]   # final-normed, (n, dim)

        def norm(weight):
            n = hf.Qwen3_5RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps).to(dtype)
            n.weight.copy_(weight.to(dtype))
            return n

        enorm, hnorm, out_norm = norm(mtp["pre_fc_norm_embedding.weight"]), \
            norm(mtp["pre_fc_norm_hidden.weight"]), norm(mtp["norm.weight"])
        fc = mtp["fc.weight"].to(dtype)
        full = cfg.layer_types.index("full_attention")
        layer = hf.Qwen3_5DecoderLayer(cfg, full).to(dtype)
        layer.load_state_dict({k[len("layers.0."):]: v.to(dtype) for k, v in mtp.items()
                               if k.startswith("layers.0.")})
        layer.eval()
        embed, head = inner.embed_tokens.weight, model.lm_head.weight

        def block(h_rows, tokens):
            """The block over len(tokens) pairs at positions 0 .. n-1."""
            e = embed[torch.tensor(tokens, dtype=torch.long)]
            y = torch.cat([enorm(e), hnorm(h_rows)], dim=-1) @ fc.T
            n = y.shape[0]
            positions = torch.arange(n)[None]
            cos_sin = inner.rotary_emb(y[None], positions)
            mask = torch.full((n, n), float("-inf"), dtype=dtype).triu(1)[None, None]
            out = layer(y[None], position_embeddings=cos_sin, attention_mask=mask, position_ids=positions)
            out = out[0] if isinstance(out, tuple) else out
            normed = out_norm(out[0])
            return normed @ head.T, normed

        h_rows, tokens = hidden[:-1], list(ids[1:])
        for token in extra:   # each chained step: the whole block again, one pair longer
            _, normed = block(h_rows, tokens)
            h_rows = torch.cat([h_rows, normed[-1:]])
            tokens = tokens + [token]
        logits, normed = block(h_rows, tokens)
    return logits.numpy(), normed.numpy()
