"""Config of a materialised DiffEqFormer: a parallel-block transformer with static weights.

Shipped with ode-lm `hf` exports of the gpt2 and llama flavours (trust_remote_code=True).
"""

from transformers import PretrainedConfig


class OdeLMConfig(PretrainedConfig):
    model_type = "ode_lm_parallel"

    def __init__(
        self,
        vocab_size: int = 256,
        hidden_size: int = 64,
        num_hidden_layers: int = 12,
        num_attention_heads: int = 2,
        intermediate_size: int = 256,
        max_position_embeddings: int = 1024,
        norm_type: str = "layernorm",  # layernorm | rmsnorm
        norm_eps: float = 1e-5,
        norm_bias: bool = True,
        attention_bias: bool = True,
        mlp_bias: bool = True,
        mlp_act: str = "gelu_tanh",  # gelu_tanh | gelu | swiglu
        position_type: str = "learned",  # learned | rope
        rope_theta: float = 10000.0,
        rotary_fraction: float = 1.0,
        tied_head: bool = True,
        ode_flavour: str = "gpt2",
        ode_solver_steps: int = 12,
        use_cache: bool = True,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.max_position_embeddings = max_position_embeddings
        self.norm_type = norm_type
        self.norm_eps = norm_eps
        self.norm_bias = norm_bias
        self.attention_bias = attention_bias
        self.mlp_bias = mlp_bias
        self.mlp_act = mlp_act
        self.position_type = position_type
        self.rope_theta = rope_theta
        self.rotary_fraction = rotary_fraction
        self.tied_head = tied_head
        self.ode_flavour = ode_flavour
        self.ode_solver_steps = ode_solver_steps
        self.use_cache = use_cache  # generate() keeps a DynamicCache (one layer per layer)
        kwargs.setdefault("tie_word_embeddings", False)  # the tied head is computed explicitly
        super().__init__(**kwargs)
