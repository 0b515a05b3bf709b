"""The model registry: Hugging Face `config.architectures` names to our implementations."""

from models.gemma import GemmaForCausalLM
from models.gemma4 import Gemma4ForCausalLM
from models.lfm2 import Lfm2ForCausalLM
from models.llama import LlamaForCausalLM
from models.qwen3_5 import Qwen3_5ForCausalLM

# architecture -> (class, extra constructor kwargs)
_REGISTRY = {
    "LlamaForCausalLM": (LlamaForCausalLM, {}),
    "MistralForCausalLM": (LlamaForCausalLM, {}),
    "Qwen2ForCausalLM": (LlamaForCausalLM, {"qkv_bias": True}),
    "Qwen3ForCausalLM": (LlamaForCausalLM, {"qk_norm": True}),
    "Qwen2MoeForCausalLM": (LlamaForCausalLM, {"qkv_bias": True}),
    "Qwen3MoeForCausalLM": (LlamaForCausalLM, {"qk_norm": True}),
    "MixtralForCausalLM": (LlamaForCausalLM, {}),
    "GptOssForCausalLM": (LlamaForCausalLM, {}),
    "Phi3ForCausalLM": (LlamaForCausalLM, {}),
    "SmolLM3ForCausalLM": (LlamaForCausalLM, {}),
    "GraniteForCausalLM": (LlamaForCausalLM, {}),
    "Gemma2ForCausalLM": (GemmaForCausalLM, {}),
    "Gemma3ForCausalLM": (GemmaForCausalLM, {}),
    "Gemma4ForCausalLM": (Gemma4ForCausalLM, {}),
    "Gemma4ForConditionalGeneration": (Gemma4ForCausalLM, {}),
    "Lfm2ForCausalLM": (Lfm2ForCausalLM, {}),
    "Qwen3_5ForCausalLM": (Qwen3_5ForCausalLM, {}),
    "Qwen3_5ForConditionalGeneration": (Qwen3_5ForCausalLM, {}),
    "Qwen3_5MoeForCausalLM": (Qwen3_5ForCausalLM, {}),
    "Qwen3_5MoeForConditionalGeneration": (Qwen3_5ForCausalLM, {}),
}


def get_model_class(config):
    """Returns (model class, extra kwargs) for a Hugging Face config.

    Raises ValueError naming the supported architectures when none of the config's is known.
    """
    for arch in getattr(config, "architectures", None) or []:
        if arch in _REGISTRY:
            return _REGISTRY[arch]
    raise ValueError(
        f"unsupported architecture {getattr(config, 'architectures', None)}; supported: {', '.join(sorted(_REGISTRY))}"
    )
