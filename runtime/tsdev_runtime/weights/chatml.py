"""ChatML: the chat template of checkpoints that have none, and (with Qwen3's thinking switch) the embedded models'."""
_TURNS = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
)
CHATML = _TURNS + "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
# The embedded models are Qwen3's kind, so they take what Qwen3's template takes from chat_template_kwargs:
# `enable_thinking: false` closes an empty thinking block after the generation prompt (Qwen3's own lines); true
# or absent opens nothing, and the model may think.
EMBEDDED_TEMPLATE = _TURNS + (
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
