"""Motif3Model: embed_tokens -> n mHC streams -> blocks -> mean over streams -> norm -> lm_head (+ MTP).

Blocks (`layers.{i}`) are pre-norm: GDLA attention (sliding or full per `is_sliding_layer`) then a dense
PolyNorm MLP or an MoE (per `is_moe_layer`); with mHC each sub-layer is wrapped by its own MHC module
(`mhc_attn`, `mhc_ffn`), without it the residual is plain. MTP modules live in `mtp_layers.{k}`.
Build on the meta device, materialise (`to_empty`), then `init_weights()` (CONTRACTS.md, docs/model-spec.md §0.1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from llm_training.layers.attention.gdla import GDLAttention
from llm_training.layers.attention.backends import AttentionMetadata, build_attention_metadata
from llm_training.layers.embedding import Embedding
from llm_training.layers.ffn import FeedForward
from llm_training.layers.mhc.hyper_connections import MHC, StreamSource
from llm_training.layers.moe import MoE, RouterStats
from llm_training.layers.norms import RMSNorm
from llm_training.layers.projection import OutputHead
from llm_training.layers.attention.rope import RotaryEmbedding, build_rotary_embeddings
from llm_training.motif.args import Motif3ModelArgs, is_moe_layer, is_sliding_layer
from llm_training.motif.mtp import MTPModule, mtp_inputs


@dataclass
class Motif3Output:
    """What `Motif3Model.forward` returns (CONTRACTS.md "Model forward")."""

    logits: Optional[torch.Tensor]  # [B, S, V]; None when return_hidden
    hidden: torch.Tensor  # [B, S, H] final-normed (input of lm_head)
    mtp_logits: Optional[list]  # per MTP module [B, S, V]; None when return_hidden
    mtp_hidden: list  # per MTP module [B, S, H] (input of lm_head)
    router_stats: list  # per MoE layer RouterStats
    balance_loss: torch.Tensor  # 0-dim; sum of the sequence-wise balance losses (0 when disabled)
    # per attention layer (trunk then MTP) fp32 [n_h] max scaled logits when recording is on (QK-clip), else None
    max_logits: Optional[list] = None


class TransformerBlock(nn.Module):
    """One trunk block. forward(x, position_ids, metadata) -> (x, RouterStats or None, max_logits fp32 [n_h] or
    None), where x is the stream tensor [B, S, n, H] with mHC or the plain residual [B, S, H] without, metadata the
    forward's AttentionMetadata, and max_logits the attention's when recording (GDLAttention). The forward is its
    two halves in turn, `attention_sublayer` then `ffn_sublayer` ([compile] granularity = "sublayer" compiles the
    methods `compile_regions` names apart)."""

    def __init__(
        self,
        args: Motif3ModelArgs,
        layer_idx: int,
        rope_full: RotaryEmbedding,
        rope_sliding: RotaryEmbedding,
        attention_backend: str = "auto",
        mhc_backward: str = "auto",
    ):
        super().__init__()
        args = args.for_layer(layer_idx)  # per-layer PolyNorm output scale
        H, eps = args.hidden_size, args.rms_norm_eps
        self.layer_idx, self.init_std = layer_idx, args.initializer_range
        sliding = is_sliding_layer(layer_idx, args)
        self.input_layernorm = RMSNorm(H, eps)
        self.self_attn = GDLAttention(
            args,
            sliding=sliding,
            softmax_scale=args.softmax_scale(layer_idx),
            rope=rope_sliding if sliding else rope_full,
            attention_backend=attention_backend,
        )
        self.post_attention_layernorm = RMSNorm(H, eps)
        if is_moe_layer(layer_idx, args):
            self.moe, self.mlp = MoE(args), None
        else:
            self.moe, self.mlp = None, FeedForward(H, args.intermediate_size, args)
        if args.mhc_enabled:
            mhc = dict(
                hidden_size=H,
                n_streams=args.mhc_expansion_rate,
                sinkhorn_iters=args.mhc_sinkhorn_iters,
                eps=args.mhc_eps,
                identity_init=args.mhc_identity_init,
                h_post_alpha=args.mhc_h_post_alpha_start,
                fused_backward=mhc_backward != "tensor_ops",  # auto / fused: where `mhc_ops.uses_stream_kernels`
            )
            self.mhc_attn, self.mhc_ffn = MHC(**mhc), MHC(**mhc)
        else:
            self.mhc_attn = self.mhc_ffn = None

    def init_weights(self, buffer_device: Optional[torch.device] = None) -> None:
        self.input_layernorm.init_weights()
        self.self_attn.init_weights()
        self.post_attention_layernorm.init_weights()
        if self.moe is not None:
            self.moe.init_weights(self.init_std, buffer_device)
        else:
            self.mlp.init_weights(self.init_std)
        if self.mhc_attn is not None:
            self.mhc_attn.init_weights()
            self.mhc_ffn.init_weights()

    def _ffn(self, x_BSH: torch.Tensor) -> tuple[torch.Tensor, Optional[RouterStats]]:
        if self.moe is not None:
            return self.moe(x_BSH)
        return self.mlp(x_BSH), None

    def attention_sublayer(
        self, x: torch.Tensor, position_ids_BS: torch.Tensor, metadata: Optional[AttentionMetadata] = None
    ) -> tuple[torch.Tensor, Optional[StreamSource], Optional[torch.Tensor]]:
        """The attention half of the block: (x after it, how mHC made that mid-block stream (StreamSource; None
        without mHC), max_logits or None)."""
        if self.mhc_attn is None:
            y, max_logits = self.self_attn(self.input_layernorm(x), position_ids_BS, metadata)
            return x + y, None, max_logits
        fused = self.mhc_attn.fused_backward
        h_pre, h_post, h_res = self.mhc_attn.coefficients(x)
        y, max_logits = self.self_attn(
            self.input_layernorm(MHC.collapse(x, h_pre, fused=fused)), position_ids_BS, metadata
        )
        mid = StreamSource(x, h_res, h_post, y)  # the mid-block stream is rebuilt from this in backward
        return MHC.update(*mid, fused=fused), mid, max_logits

    def ffn_sublayer(self, x: torch.Tensor, mid: Optional[StreamSource]) -> tuple[torch.Tensor, Optional[RouterStats]]:
        """The feed-forward half of the block on `attention_sublayer`'s outputs: (x after it, RouterStats or None).
        With mHC it is three steps: `ffn_streams_in`, the dense MLP or the MoE (`_ffn`), `ffn_streams_out`."""
        if self.mhc_ffn is None:
            y, stats = self._ffn(self.post_attention_layernorm(x))
            return x + y, stats
        h_post, h_res, ffn_in = self.ffn_streams_in(x, mid)
        y, stats = self._ffn(ffn_in)
        return self.ffn_streams_out(x, h_res, h_post, y, mid), stats

    def ffn_streams_in(self, x: torch.Tensor, mid: StreamSource) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """mHC into the feed-forward: (h_post [B, S, n], H_res [B, S, n, n], the normed collapsed stream [B, S, H])."""
        h_pre, h_post, h_res = self.mhc_ffn.coefficients(x, mid)
        return h_post, h_res, self.post_attention_layernorm(MHC.collapse(x, h_pre, mid, self.mhc_ffn.fused_backward))

    def ffn_streams_out(
        self, x: torch.Tensor, h_res: torch.Tensor, h_post: torch.Tensor, y: torch.Tensor, mid: StreamSource
    ) -> torch.Tensor:
        """mHC out of the feed-forward: the streams updated with its output `y` [B, S, H]."""
        return MHC.update(x, h_res, h_post, y, mid, self.mhc_ffn.fused_backward)

    def compile_regions(self) -> tuple[str, ...]:
        """The methods that [compile] granularity = "sublayer" compiles apart (`distributed.compile.apply_compile`):
        the two halves, and with mHC the feed-forward half's three steps instead of it. Its mHC steps are the same
        code in a dense and a MoE block, so one compiled graph serves both kinds: only the MLP / MoE differs."""
        if self.mhc_ffn is None:
            return ("attention_sublayer", "ffn_sublayer")
        return ("attention_sublayer", "ffn_streams_in", "_ffn", "ffn_streams_out")

    def forward(self, x: torch.Tensor, position_ids_BS: torch.Tensor, metadata: Optional[AttentionMetadata] = None):
        x, mid, max_logits = self.attention_sublayer(x, position_ids_BS, metadata)
        x, stats = self.ffn_sublayer(x, mid)
        return x, stats, max_logits


class Motif3Model(nn.Module):
    """The Motif-3 model. `attention_backend` names a kernel of `layers.attention_backends`; `mhc_backward`
    ("auto", "fused" or "tensor_ops") how mHC's backward over the streams runs (`layers.mhc`)."""

    def __init__(self, args: Motif3ModelArgs, attention_backend: str = "auto", mhc_backward: str = "auto"):
        super().__init__()
        args.validate()
        if args.tie_word_embeddings:
            raise ValueError("tie_word_embeddings=True is not supported: Motif-3 has an untied lm_head")
        self.args = args
        H = args.hidden_size
        rope_full, rope_sliding = build_rotary_embeddings(args)
        self._ropes = (rope_full, rope_sliding)  # shared by the blocks; tables built in forward, before them
        self.embed_tokens = Embedding(args.vocab_size, H)
        self.layers = nn.ModuleList(
            TransformerBlock(args, i, rope_full, rope_sliding, attention_backend, mhc_backward)
            for i in range(args.num_hidden_layers)
        )
        self.norm = RMSNorm(H, args.rms_norm_eps)
        self.lm_head = OutputHead(H, args.vocab_size)
        self.mtp_layers = nn.ModuleList(
            MTPModule(args.for_layer(args.num_hidden_layers + k), rope_sliding, attention_backend)
            for k in range(args.num_nextn_predict_layers)
        )
        self.attention_backend = attention_backend
        self._attention = [m for m in self.modules() if isinstance(m, GDLAttention)]  # trunk then MTP, model order
        self.attention_windows = sorted({m.window for m in self._attention}, key=lambda w: -1 if w is None else w)

    # ------------------------------------------------------------------ init / knobs
    @torch.no_grad()
    def init_weights(self, buffer_device: Optional[torch.device] = None) -> None:
        """Initialise every parameter and buffer explicitly, in a fixed order (same numbers for a model
        built on CPU and one built on meta then `to_empty(device="cpu")`, given the same seed)."""
        std = self.args.initializer_range
        nn.init.normal_(self.embed_tokens.weight, mean=0.0, std=std)
        for layer in self.layers:
            layer.init_weights(buffer_device)
        self.norm.init_weights()
        nn.init.normal_(self.lm_head.weight, mean=0.0, std=std)
        for mtp in self.mtp_layers:
            mtp.init_weights()

    def set_record_max_logits(self, flag: bool) -> None:
        """Record per-head max logits (fp32 [n_h] per attention layer, `Motif3Output.max_logits`) on every forward,
        for QK-clip."""
        for module in self.modules():
            if isinstance(module, GDLAttention):
                module.record_max_logits = bool(flag)

    def set_mhc_progress(self, progress: float) -> None:
        """h_post coefficient schedule: alpha = start + (end - start) * progress, progress in [0, 1]
        (linear; c_post = 1 + alpha). The published end value 0 gives c_post = 1."""
        p = min(max(float(progress), 0.0), 1.0)
        a = self.args
        alpha = a.mhc_h_post_alpha_start + (a.mhc_h_post_alpha_end - a.mhc_h_post_alpha_start) * p
        for module in self.modules():
            if isinstance(module, MHC):
                module.h_post_alpha = alpha

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: Optional[torch.Tensor] = None,
        document_ids: Optional[torch.Tensor] = None,
        mtp_input_ids: Optional[list] = None,
        return_hidden: bool = False,
        attention_document_ids: Optional[torch.Tensor] = None,
        attention_cu_seqlens: Optional[torch.Tensor] = None,
    ) -> Motif3Output:
        """input_ids / position_ids / document_ids: [B, S]; `mtp_input_ids`: per MTP module k the ids it embeds,
        [B, S] each (the trainer's prepared batch carries them, sliced like every other [B, S] tensor;
        default: `mtp.mtp_inputs(input_ids)`). The attention metadata (document mask data) is built here,
        once per forward, and handed to every layer.

        Context parallelism: the [B, S] inputs are this rank's shard of longer sequences and
        `attention_document_ids` [B, S_full] are the document ids of the WHOLE sequences, which the attention
        metadata is built from (the context-parallel kernels attend across shards); default: `document_ids`.
        `attention_cu_seqlens`: those documents' cu_seqlens (`fa4.document_cu_seqlens`) when the caller computed
        them on the host, as the trainer does; else the metadata computes them from the device's ids, a host sync."""
        B, S = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(S, device=input_ids.device).expand(B, S)
        if mtp_input_ids is None:
            mtp_input_ids = mtp_inputs(input_ids, len(self.mtp_layers))
        attention_docs = document_ids if attention_document_ids is None else attention_document_ids
        attention_len = S if attention_document_ids is None else attention_document_ids.shape[1]
        metadata = build_attention_metadata(
            self.attention_backend,
            attention_docs,
            self.attention_windows,
            B,
            attention_len,
            input_ids.device,
            (self.args.head_dim, self.args.v_head_dim),
            cu_seqlens=attention_cu_seqlens,
        )
        for rope in self._ropes:
            rope.prepare(input_ids.device, S)
        # one lookup for the trunk's ids and every MTP module's ([(1 + K) B, S]): the table is read once per forward
        embedded, *mtp_embedded = self.embed_tokens(torch.cat([input_ids, *mtp_input_ids])).split(B)
        x = embedded
        if self.args.mhc_enabled:  # copy the embedding into n streams: [B, S, n, H]
            x = embedded.unsqueeze(2).expand(B, S, self.args.mhc_expansion_rate, -1).contiguous()
        router_stats, max_logits = [], []
        for layer in self.layers:
            x, stats, layer_max_logits = layer(x, position_ids, metadata)
            max_logits.append(layer_max_logits)
            if stats is not None:
                router_stats.append(stats)
        if self.args.mhc_enabled:  # the fp32 mean of the streams, summed in fp32 without an fp32 copy of them
            x = (x.sum(dim=2, dtype=torch.float32) / x.shape[2]).to(embedded.dtype)
        hidden = self.norm(x)

        mtp_hidden = []
        h = hidden if self.args.mtp_feeds_post_norm_hidden else x
        for mtp, mtp_embedded_BSH in zip(self.mtp_layers, mtp_embedded, strict=True):
            h, layer_max_logits = mtp(h, mtp_embedded_BSH, position_ids, metadata)
            max_logits.append(layer_max_logits)
            mtp_hidden.append(h)

        losses = [s.balance_loss for s in router_stats if s.balance_loss is not None]
        balance_loss = torch.stack(losses).sum() if losses else torch.zeros((), device=hidden.device)
        return Motif3Output(
            logits=None if return_hidden else self.lm_head(hidden),
            hidden=hidden,
            mtp_logits=None if return_hidden else [self.lm_head(h) for h in mtp_hidden],
            mtp_hidden=mtp_hidden,
            router_stats=router_stats,
            balance_loss=balance_loss,
            max_logits=max_logits if any(m is not None for m in max_logits) else None,
        )
