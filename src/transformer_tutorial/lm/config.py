"""Chapters 13-17: the language model's configuration, at the bottom of its imports.

:class:`LMConfig` holds every hyperparameter, the valid choices of each switchable piece are
named here as tuples (the norms' are ``norms.NORMS``, the feed-forwards'
``feed_forward.FEED_FORWARDS``), and ``LLAMA`` and ``QWEN3`` are today's choices. The model,
its layer and the factories of :mod:`~transformer_tutorial.lm.pieces` import this module; it
imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from transformer_tutorial.checks import (
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_optional_int,
)
from transformer_tutorial.feed_forward import FEED_FORWARDS
from transformer_tutorial.lm.latent_attention import check_latent_dims
from transformer_tutorial.lm.moe import check_experts, check_groups
from transformer_tutorial.lm.rope_scaling import REFUSED, RopeScaling, rotary_width
from transformer_tutorial.norms import NORMS

# The choices of lm_pieces' two factories of their own.
POSITIONS = ("learned", "sinusoidal", "rope")
ATTENTIONS = ("mha", "gqa", "mla")
# How chapter 16's attention computes softmax(q kᵀ) v: PyTorch's fused kernels, or chapter 22's
# tiled forward and backward (without the score matrix: equal in float64; in bf16/fp16 it sums
# in float32, as FlashAttention does, and is about as accurate; a teaching version).
ATTENTION_BACKENDS = ("sdpa", "tiled")
# How chapter 20's router scores the experts: Qwen3-MoE's softmax, or DeepSeek-V3's sigmoid with
# its correction bias, groups, scaling and shared experts.
ROUTERS = ("softmax", "sigmoid")

# The switches: True or False only, whether or not their piece is in use (a 0 or 1 would pass
# the comparisons with the defaults below).
BOOL_FIELDS = (
    "norm_first",
    "bias",
    "tie_embeddings",
    "scale_embeddings",
    "qk_norm",
    "norm_topk_prob",
    "rope_interleave",
)
# The fields only chapter 16's attention has.
GQA_FIELDS = {"n_kv_heads": None, "d_head": None, "qk_norm": False, "window": None}
# The fields only DeepSeek-V3's mixture of experts has (router="sigmoid").
DEEPSEEK_MOE_FIELDS = {
    "n_shared_experts": 0,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
}
# The fields only chapter 20's mixture of experts has (n_experts=0: every layer dense).
MOE_FIELDS = {
    "n_experts_per_token": 1,
    "moe_d_ff": None,
    "norm_topk_prob": False,
    "sparse_step": 1,
    "dense_layers": (),
    "router_aux_loss_coef": 0.001,
    "router": "softmax",
    **DEEPSEEK_MOE_FIELDS,
}
# The fields only chapter 21's latent attention has.
MLA_FIELDS = {
    "q_lora_rank": None,
    "kv_lora_rank": None,
    "qk_nope_head_dim": None,
    "qk_rope_head_dim": None,
    "v_head_dim": None,
    "rope_interleave": False,
}


@dataclass(frozen=True)
class LMConfig:
    """Every hyperparameter of the language model. Defaults are GPT-2 small (124 M weights).

    ``norm``, ``activation`` (``"swiglu"``: the gated layer), ``positions`` and ``attention``
    name the pieces the factories build. ``bias`` gives the attention and feed-forward
    projections biases (the norms keep theirs). ``tie_embeddings`` makes the output layer reuse
    the token embedding matrix; ``scale_embeddings`` multiplies embeddings by √D as the 2017
    paper does (GPT-2 does not). ``layer_norm_eps`` is every norm's epsilon (LayerNorm's or
    RMSNorm's). ``rope_base`` is the base of rotary positions' angles (``rope_theta`` in
    ``transformers``); with ``positions="rope"`` only, ``rope_scaling`` changes their
    frequencies (chapter 18's :class:`~transformer_tutorial.lm.rope_scaling.RopeScaling`, None:
    unchanged) and ``partial_rotary_factor`` rotates the first ``int(Dh · factor)``
    coordinates of each head (GPT-NeoX; 1: all).

    With ``attention="gqa"`` only: ``n_kv_heads`` key/value heads (None: ``n_heads``), a head
    width ``d_head`` of its own (None: ``d_model // n_heads``), ``qk_norm`` (Qwen3) and a
    sliding ``window`` (None: every earlier position). ``positions="rope"`` needs it too.

    With ``n_experts`` > 0 (chapter 20), the feed-forward layer of layer ``i`` is a mixture of
    ``n_experts`` SwiGLU experts of hidden width ``moe_d_ff`` (None: ``d_ff``), each token
    routed to ``n_experts_per_token`` of them (weights renormalised with ``norm_topk_prob``),
    when ``(i + 1) % sparse_step == 0`` and ``i`` is not in ``dense_layers`` (Qwen3-MoE's
    ``decoder_sparse_step`` and ``mlp_only_layers``); other layers keep the dense ``d_ff``
    layer. ``router_aux_loss_coef`` weighs the load-balancing loss in training.
    ``router="sigmoid"`` makes each mixture DeepSeek-V3's
    (:class:`~transformer_tutorial.lm.moe.DeepSeekMoE`): sigmoid scores with a correction bias,
    the experts chosen from the ``topk_group`` best of ``n_group`` groups, the weights times
    ``routed_scaling_factor``, plus ``n_shared_experts`` shared experts (a SwiGLU of
    ``n_shared_experts · moe_d_ff``); DeepSeek's ``first_k_dense_replace = k`` is
    ``dense_layers=tuple(range(k))``.

    With ``attention="mla"`` (chapter 21, needs ``positions="rope"``): DeepSeek's latent
    attention, keys and values from a latent of ``kv_lora_rank``, queries through one of
    ``q_lora_rank`` (None: directly), each head's query and key ``qk_nope_head_dim`` wide
    without positions plus ``qk_rope_head_dim`` rotary (``rope_interleave``: its pairs are
    interleaved, DeepSeek's checkpoints), values ``v_head_dim`` wide.

    ``attention_backend`` (chapter 22, ``attention="gqa"``, no dropout, no window): ``"sdpa"``
    (PyTorch's fused kernels) or ``"tiled"`` (FlashAttention-2's tiled forward and backward,
    never building the score matrix; a teaching version, slower). Both give the same numbers in
    float64; in bf16 and fp16 they round differently, the tiled one about as accurately (it
    accumulates in float32, as FlashAttention does).
    """

    vocab_size: int
    d_model: int = 768
    n_heads: int = 12
    n_layers: int = 12
    d_ff: int = 3072
    max_len: int = 1024
    dropout: float = 0.1
    norm_first: bool = True
    norm: str = "layer"
    layer_norm_eps: float = 1e-5
    activation: str = "gelu_tanh"
    positions: str = "learned"
    attention: str = "mha"
    bias: bool = True
    tie_embeddings: bool = True
    scale_embeddings: bool = False
    rope_base: float = 10000.0
    rope_scaling: RopeScaling | None = None
    partial_rotary_factor: float = 1.0
    n_kv_heads: int | None = None
    d_head: int | None = None
    qk_norm: bool = False
    window: int | None = None
    n_experts: int = 0
    n_experts_per_token: int = 1
    moe_d_ff: int | None = None
    norm_topk_prob: bool = False
    sparse_step: int = 1
    dense_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001
    router: str = "softmax"
    n_shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    rope_interleave: bool = False
    attention_backend: str = "sdpa"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_heads", "n_layers", "d_ff", "max_len"):
            check_int(name, getattr(self, name), at_least=1)
        for name in ("n_kv_heads", "d_head", "window"):
            check_optional_int(name, getattr(self, name), at_least=1)
        check_number("dropout", self.dropout, low=0.0, high=1.0, high_open=True)
        check_number("layer_norm_eps", self.layer_norm_eps, low=0.0, low_open=True)
        check_number("rope_base", self.rope_base, low=1.0, low_open=True)
        check_choice("norm", self.norm, NORMS)
        check_choice("activation", self.activation, FEED_FORWARDS)
        check_choice("positions", self.positions, POSITIONS)
        check_choice("attention", self.attention, ATTENTIONS)
        check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        tiled = self.attention_backend == "tiled"
        if tiled and (self.attention != "gqa" or self.dropout or self.window is not None):
            raise ValueError(
                "attention_backend='tiled' is chapter 22's attention for chapter 16's layout: "
                f"set attention='gqa', dropout=0 and window=None (got {self.attention!r}, "
                f"{self.dropout}, {self.window})"
            )
        for name in BOOL_FIELDS:
            check_bool(name, getattr(self, name))
        self._check_heads()
        self._check_latent()
        self._check_rope()
        self._check_experts()

    def _check_experts(self) -> None:
        check_int("n_experts", self.n_experts, at_least=0)
        if self.n_experts == 0:
            chosen = [
                f"{k}={getattr(self, k)!r}" for k, v in MOE_FIELDS.items() if getattr(self, k) != v
            ]
            if chosen:
                raise ValueError(f"{', '.join(chosen)}: mixture of experts only; set n_experts")
            return
        check_experts(self.n_experts, self.n_experts_per_token, top_k_name="n_experts_per_token")
        check_optional_int("moe_d_ff", self.moe_d_ff, at_least=1)
        check_int("sparse_step", self.sparse_step, at_least=1)
        check_number("router_aux_loss_coef", self.router_aux_loss_coef, low=0.0)
        check_choice("router", self.router, ROUTERS)
        if self.router == "softmax":
            chosen = [
                f"{k}={getattr(self, k)!r}"
                for k, v in DEEPSEEK_MOE_FIELDS.items()
                if getattr(self, k) != v
            ]
            if chosen:
                raise ValueError(
                    f"{', '.join(chosen)}: DeepSeek-V3's mixture only; set router='sigmoid'"
                )
        else:
            check_groups(
                self.n_experts,
                self.n_experts_per_token,
                self.n_group,
                self.topk_group,
                top_k_name="n_experts_per_token",
            )
            check_int("n_shared_experts", self.n_shared_experts, at_least=0)
            check_number(
                "routed_scaling_factor", self.routed_scaling_factor, low=0.0, low_open=True
            )
        if not isinstance(self.dense_layers, tuple) or not all(
            type(i) is int and 0 <= i < self.n_layers for i in self.dense_layers
        ):
            raise ValueError(
                f"dense_layers must be a tuple of layer indices 0 to {self.n_layers - 1}, "
                f"got {self.dense_layers!r}"
            )
        if self.activation != "swiglu" or self.bias:
            raise ValueError(
                "the experts are SwiGLU layers without biases: set activation='swiglu' and "
                f"bias=False with n_experts (got {self.activation!r}, bias={self.bias})"
            )

    def is_sparse(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) has a mixture of experts, as Qwen3-MoE decides."""
        return (
            self.n_experts > 0
            and layer not in self.dense_layers
            and (layer + 1) % self.sparse_step == 0
        )

    def _check_latent(self) -> None:
        if self.attention != "mla":
            chosen = [
                f"{k}={getattr(self, k)!r}" for k, v in MLA_FIELDS.items() if getattr(self, k) != v
            ]
            if chosen:
                raise ValueError(
                    f"{', '.join(chosen)}: latent attention only; set attention='mla'"
                )
            return
        chosen = [
            f"{k}={getattr(self, k)!r}" for k, v in GQA_FIELDS.items() if getattr(self, k) != v
        ]
        if chosen:
            raise ValueError(f"{', '.join(chosen)}: chapter 16's attention only, not 'mla'")
        missing = [k for k in list(MLA_FIELDS)[1:5] if getattr(self, k) is None]
        if missing:
            raise ValueError(f"attention='mla' needs {', '.join(missing)}")
        check_latent_dims(**{k: getattr(self, k) for k in list(MLA_FIELDS)[:5]})
        if self.positions != "rope" or self.partial_rotary_factor != 1.0 or self.bias:
            raise ValueError(
                "attention='mla' rotates its own qk_rope_head_dim part of each head, without "
                "biases: set positions='rope', partial_rotary_factor=1.0 and bias=False (got "
                f"{self.positions!r}, {self.partial_rotary_factor}, {self.bias})"
            )

    def _check_rope(self) -> None:
        scaled = self.rope_scaling is not None or self.partial_rotary_factor != 1.0
        if scaled and self.positions != "rope":
            raise ValueError(
                "rope_scaling and partial_rotary_factor change rotary positions: set "
                f"positions='rope' (got {self.positions!r})"
            )
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise TypeError(
                f"rope_scaling must be a RopeScaling or None, got {self.rope_scaling!r}; from "
                "transformers' rope_parameters: RopeScaling.from_parameters(...)"
            )
        if self.rope_scaling is not None and self.rope_scaling.rope_type in REFUSED:
            raise ValueError(REFUSED[self.rope_scaling.rope_type])
        if self.positions == "rope" and self.attention != "mla":
            rotary_width(self.head_dim, self.partial_rotary_factor)

    def _check_heads(self) -> None:
        if self.attention == "mha":
            chosen = [
                f"{k}={getattr(self, k)!r}" for k, v in GQA_FIELDS.items() if getattr(self, k) != v
            ]
            if self.positions == "rope":
                chosen.append("positions='rope'")
            if chosen:
                raise ValueError(
                    f"{', '.join(chosen)}: chapter 16's attention only; set attention='gqa'"
                )
        if self.attention == "mla":
            return  # its widths are its own fields (_check_latent)
        if self.d_head is None and self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if self.n_kv_heads is not None and self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}: each "
                "key/value head serves n_heads // n_kv_heads query heads"
            )
        if self.positions == "sinusoidal" and self.d_model % 2:
            raise ValueError(f"d_model={self.d_model} must be even for sinusoidal positions")
        if self.positions == "rope" and self.head_dim % 2:
            raise ValueError(f"the head width {self.head_dim} must be even for rotary positions")

    @property
    def head_dim(self) -> int:
        """Dh: ``d_head``, or ``d_model // n_heads``."""
        return self.d_model // self.n_heads if self.d_head is None else self.d_head


# Today's choices; the sizes are the caller's: LMConfig(vocab_size=V, d_model=..., **LLAMA).
# Llama (Touvron et al. 2023): pre-norm RMSNorm, SwiGLU, rotary positions, no biases, an output
# layer of its own; chapter 16's attention, so that n_kv_heads can be set: LLaMA 1 and Llama 2's
# 7B and 13B keep a key/value head per query head (None), Llama 2 70B and Llama 3 share 8.
# Qwen3 adds QK-norm.
# layer_norm_eps 1e-6 is Llama 1's and Qwen3's; Llama 2 and 3 use 1e-5 (a port passes its
# checkpoint's rms_norm_eps, as hf_weights does).
LLAMA = MappingProxyType(
    dict(
        norm_first=True,
        norm="rms",
        layer_norm_eps=1e-6,
        activation="swiglu",
        positions="rope",
        attention="gqa",
        bias=False,
        tie_embeddings=False,
        scale_embeddings=False,
    )
)
QWEN3 = MappingProxyType({**LLAMA, "qk_norm": True})
