"""Paged attention in plain PyTorch: the reference backend, and the CPU path."""
import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionMetadata


class TorchNativeBackend(AttentionBackend):
    """PagedAttention (Kwon et al., SOSP 2023) with torch ops, on any device.

    Decodes are batched: their blocks are gathered into a padded [B, L] key/value batch, and a length
    mask hides the padding. GQA is done by viewing the query heads as [num_kv_heads, group] so K/V are
    never repeated. Prefill chunks, few per step, each run one causal SDPA over their gathered prefix.
    """

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata):
        k_cache, v_cache = kv_cache
        # Write every new token's K/V before any read, so that sequences sharing prefix blocks being
        # filled in this same step (n > 1 siblings, same-step prefix hits) see them.
        k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, nd)
        qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        for i in range(nd, meta.num_seqs):
            start, end, ctx = qsl[i], qsl[i + 1], lens[i]
            out[start:end] = self._prefill(q[start:end], k_cache, v_cache, meta.block_tables[i], ctx)
        return out

    def _gather(self, cache, block_table, ctx_len):
        # block_table [..., nb] -> [..., nb * block_size, kvh, d]
        kv = cache[block_table]
        return kv.flatten(-4, -3)[..., :ctx_len, :, :]

    def _decode(self, q, k_cache, v_cache, meta, nd):
        max_len = max(meta.seq_lens_cpu[:nd])
        nb = -(-max_len // self.block_size)
        bt = meta.block_tables[:nd, :nb]
        kvh, d = self.num_kv_heads, self.head_dim
        k = self._gather(k_cache, bt, max_len).transpose(1, 2)  # [nd, kvh, L, d]
        v = self._gather(v_cache, bt, max_len).transpose(1, 2)
        qg = q.view(nd, kvh, -1, d)  # [nd, kvh, group, d]
        scores = torch.matmul(qg, k.transpose(-1, -2)) * self.scale  # [nd, kvh, group, L]
        pad = torch.arange(max_len, device=q.device)[None, :] >= meta.seq_lens[:nd, None]
        scores.masked_fill_(pad[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v).view(nd, self.num_heads, d)

    def _prefill(self, q, k_cache, v_cache, block_table, ctx_len):
        q_len = q.shape[0]
        nb = -(-ctx_len // self.block_size)
        k = self._gather(k_cache, block_table[:nb], ctx_len).transpose(0, 1)  # [kvh, ctx, d]
        v = self._gather(v_cache, block_table[:nb], ctx_len).transpose(0, 1)
        qh = q.transpose(0, 1)  # [h, q_len, d]
        if ctx_len == q_len:
            o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        else:
            # query i sits at position ctx_len - q_len + i and sees keys up to that position
            qpos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)[:, None]
            mask = torch.arange(ctx_len, device=q.device)[None, :] <= qpos
            o = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)
        return o.transpose(0, 1)
