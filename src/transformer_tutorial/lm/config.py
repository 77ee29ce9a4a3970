"""Chapters 13-17: the language model's configuration, at the bottom of its imports.

:class:`LMConfig` holds every hyperparameter as ``transformers``' ``config.json`` does, one flat
field each; ``LLAMA`` and ``QWEN3`` are today's choices. A field that names a piece
(``attention``, ``positions``, ``attention_backend``, ``router``) is looked up in its registry
(:mod:`~transformer_tutorial.lm.registry`), and the piece found checks the fields it reads: the
config knows no piece by name. It imports only the registries, the checks and the rope-scaling
spec; the model, its layer, the pieces and the factories import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from transformer_tutorial.checks import check_bool, check_choice, check_int, check_number
from transformer_tutorial.feed_forward import FEED_FORWARDS
from transformer_tutorial.lm.registry import CONFIG_REGISTRIES
from transformer_tutorial.lm.rope_scaling import RopeScaling
from transformer_tutorial.norms import NORMS

# The switches: True or False only, whether or not their piece is in use (a 0 or 1 would pass
# the comparisons with the defaults).
BOOL_FIELDS = (
    "norm_first",
    "bias",
    "tie_embeddings",
    "scale_embeddings",
    "qk_norm",
    "norm_topk_prob",
    "rope_interleave",
)


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
        check_number("dropout", self.dropout, low=0.0, high=1.0, high_open=True)
        check_number("layer_norm_eps", self.layer_norm_eps, low=0.0, low_open=True)
        check_number("rope_base", self.rope_base, low=1.0, low_open=True)
        check_choice("norm", self.norm, NORMS)
        check_choice("activation", self.activation, FEED_FORWARDS)
        for name in BOOL_FIELDS:
            check_bool(name, getattr(self, name))
        for registry in CONFIG_REGISTRIES:  # each chosen piece checks the fields it reads
            registry.check(self)

    def is_sparse(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) has a mixture of experts, as Qwen3-MoE decides."""
        return (
            self.n_experts > 0
            and layer not in self.dense_layers
            and (layer + 1) % self.sparse_step == 0
        )


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
