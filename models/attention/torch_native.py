"""Paged attention in plain PyTorch: the reference backend, and the CPU path."""

import torch
import torch.nn.functional as F

from models.attention.base import AttentionBackend, AttentionMetadata
from models.attention.kv_cache_dtype import dequantize_rows, quantize_rows
from models.kernels import ops


class TorchNativeBackend(AttentionBackend):
    """PagedAttention (Kwon et al., SOSP 2023) with torch ops, on any device.

    Decodes are batched: their whole blocks are gathered (one contiguous copy per block, much
    cheaper than per-token gathers) into a [B, L] key/value batch padded to the longest context,
    and SDPA runs over it with a length mask, viewing the query heads as [num_kv_heads, group] so
    K/V are never repeated for GQA. Prefill chunks, few per step, each run one causal SDPA: over the
    fresh K/V when nothing precedes the chunk, else over its gathered context. `plan` builds the
    per-step masks once for all layers. A quantized cache (kv_cache_dtype) is written through
    models.attention.kv_cache_dtype.quantize_rows and dequantized as it is gathered.
    """

    def plan(self, meta: AttentionMetadata) -> None:
        nd = meta.num_decodes
        if nd:
            self.decode_len = max(meta.seq_lens_cpu[:nd])
            self.decode_blocks = meta.block_tables[:nd, : -(-self.decode_len // self.block_size)]
            pos = torch.arange(self.decode_len, device=meta.seq_lens.device)[None, :]
            lens = meta.seq_lens[:nd, None]
            mask = pos < lens
            if self.sliding_window is not None:  # the query at lens - 1 sees the last W keys
                mask &= pos >= lens - self.sliding_window
            self.decode_mask = mask[:, None, None, :]  # [nd, 1, 1, L]

    def _gather(self, cache, block_table, ctx_len, dtype=None):
        """K or V of the first ctx_len tokens of one or more block tables: [..., ctx_len, kvh, d] (a quantized
        cache's dequantized to `dtype`)."""
        rows = cache[block_table].flatten(-4, -3)[..., :ctx_len, :, :]
        return dequantize_rows(rows, self.head_dim, self.kv_quant).to(dtype) if self.kv_quant else rows

    supports_sinks = True

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, sinks=None):
        k_cache, v_cache = kv_cache
        # Write every new token's K/V before any read, so that sequences sharing prefix blocks being
        # filled in this same step (n > 1 siblings, same-step prefix hits) see them.
        if self.kv_quant:  # as bytes: torch copies no float8 by index
            kq, vq = (quantize_rows(x, self.kv_quant).view(torch.uint8) for x in (k, v))
            ops.write_kv(kq, vq, k_cache.view(torch.uint8), v_cache.view(torch.uint8), meta.slot_mapping)
            k = v = None  # below, the fresh K/V as the cache has them
        else:
            ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = q.new_empty(q.shape)  # contiguous, whatever q's strides
        nd = meta.num_decodes
        if nd:
            qd = q[:nd].view(nd, self.num_kv_heads, -1, self.head_dim)  # [nd, kvh, group, d]
            # SDPA takes the gathered [nd, L, kvh, d] transposed as a strided view: no copy
            kd = self._gather(k_cache, self.decode_blocks, self.decode_len, q.dtype).transpose(1, 2)
            vd = self._gather(v_cache, self.decode_blocks, self.decode_len, q.dtype).transpose(1, 2)
            o = self._attend(qd, kd, vd, self.decode_mask, None if sinks is None else sinks.view(-1, qd.shape[2], 1))
            out[:nd] = o.reshape(nd, self.num_heads, self.head_dim)
        qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        for i in range(nd, meta.num_seqs):
            start, end, ctx = qsl[i], qsl[i + 1], lens[i]
            window = self.sliding_window
            if k is not None and ctx == end - start and (window is None or window >= ctx):  # its own fresh K/V
                kc, vc, mask = k[start:end], v[start:end], None
            else:
                nb = -(-ctx // self.block_size)
                kc = self._gather(k_cache, meta.block_tables[i, :nb], ctx, q.dtype)  # [ctx, kvh, d]
                vc = self._gather(v_cache, meta.block_tables[i, :nb], ctx, q.dtype)
                # query j sits at position ctx - q_len + j and sees keys up to that position (the last
                # `window` of them)
                qpos = torch.arange(ctx - (end - start), ctx, device=q.device)[:, None]
                kpos = torch.arange(ctx, device=q.device)[None, :]
                mask = kpos <= qpos
                if window is not None:
                    mask &= kpos > qpos - window
            # 4-D [1, heads, len, d] views: SDPA's fused CPU kernel (with GQA) only takes 4-D inputs,
            # 3-D ones fall back to the slow math path.
            o = self._attend(
                q[None, start:end].transpose(1, 2),
                kc[None].transpose(1, 2),
                vc[None].transpose(1, 2),
                mask,
                None if sinks is None else sinks.view(-1, 1, 1),
            )
            out[start:end] = o[0].transpose(0, 1)
        return out

    def _attend(self, q, k, v, mask, sinks=None):
        """Attention of q [B, H, m, d] over k, v [B, KVH, n, d] (or q [B, KVH, G, d] for decodes) with a
        boolean `mask` broadcastable to the scores (None: causal, aligned to the end). SDPA, except with a
        soft cap or attention sinks (float32, broadcastable to the scores without their last dimension, plus a
        trailing 1), which SDPA does not take: then the scores are computed, capped and masked here, and each
        row's sink joins its softmax as one more logit whose probability is dropped (transformers' gpt-oss)."""
        cap = self.logits_soft_cap
        if cap is None and sinks is None:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=True
            )
        if q.shape[-3] != k.shape[-3]:  # GQA: each KV head serves a group of query heads
            k, v = (x.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3) for x in (k, v))
        s = (q.float() @ k.float().transpose(-1, -2)) * self.scale
        if cap is not None:
            s = cap * torch.tanh(s / cap)
        if mask is None:
            m, n = s.shape[-2:]
            mask = torch.arange(n, device=s.device)[None, :] <= torch.arange(n - m, n, device=s.device)[:, None]
        s = s.masked_fill(~mask, float("-inf"))
        if sinks is None:
            return (s.softmax(-1) @ v.float()).to(q.dtype)
        p = torch.cat((s, sinks.float().expand(*s.shape[:-1], 1)), dim=-1).softmax(-1)[..., :-1]
        return (p @ v.float()).to(q.dtype)
