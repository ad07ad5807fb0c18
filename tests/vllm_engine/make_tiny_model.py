"""Write a tiny Llama model with random weights and its tokenizer, locally.

    python tests/vllm_engine/make_tiny_model.py DIR

No model can be downloaded where the tests run, and none is needed: the
engine's batching, priorities, aborts and streaming are real whatever the
weights say. The model: 2 layers, hidden 128, 2 attention heads (head_dim
64: the CPU attention kernels reject 16), 1 KV head, vocabulary 512, about
0.7 MB. The tokenizer: byte-level BPE trained on a few sentences here, with
a chat template, so chat requests go through the model's own template.
"""

from __future__ import annotations

import sys
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

SENTENCES = [
    "The gateway queues every request by its tenant's tier.",
    "Interactive requests must see their first token within half a second.",
    "Batch work waits, ages, and is never starved.",
    "Quotas are metered in tokens per minute and per day.",
    "hello world, the quick brown fox jumps over the lazy dog 0123456789",
] * 20


def write(target: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    target.mkdir(parents=True, exist_ok=True)
    specials = ["<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        SENTENCES,
        trainers.BpeTrainer(
            vocab_size=512,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(target)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        torch_dtype="bfloat16",
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(target)


if __name__ == "__main__":
    write(Path(sys.argv[1]))
    print(sys.argv[1])
